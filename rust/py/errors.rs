//! Errors into Python exceptions, in one place: the `From<KvError> for PyErr` impl, the
//! `PoolFullError` exception it raises, and the CPU kernels' shape errors.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyError, PyRuntimeError, PyValueError};
use pyo3::PyErr;

use crate::KvError;

create_exception!(
    kvpark._core,
    PoolFullError,
    PyException,
    "Not enough free pages in the pool; the call changed nothing. The message says how many \
     pages were needed and how many are free."
);

impl From<KvError> for PyErr {
    fn from(err: KvError) -> Self {
        let msg = err.to_string();
        match err {
            KvError::UnknownSequence(_) => PyKeyError::new_err(msg),
            KvError::PoolFull { .. } => PoolFullError::new_err(msg),
            KvError::Integrity(_) => PyRuntimeError::new_err(msg),
            KvError::BadGeometry { .. }
            | KvError::SequenceExists(_)
            | KvError::WouldShrink { .. }
            | KvError::WouldGrow { .. }
            | KvError::OutOfRange { .. }
            | KvError::Released { .. }
            | KvError::LengthMismatch { .. }
            | KvError::UnknownPage { .. }
            | KvError::NotEmpty { .. }
            | KvError::RegisterMismatch { .. }
            | KvError::DuplicateRequest(_)
            | KvError::DuplicateSlot(_) => PyValueError::new_err(msg),
        }
    }
}

/// A CPU kernel's shape error: ValueError with its message.
pub(super) fn cpu_ops_err(err: kvpark_cpu_ops::ShapeError) -> PyErr {
    PyValueError::new_err(err.0)
}
