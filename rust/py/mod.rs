//! The Python module `kvpark._core`: THE ONLY PLACE THAT USES PYO3.
//!
//! A thin wrapper, one file per wrapped type: [`pool`] (`KvPool`), [`planner`] (`RequestView`,
//! `Action`, `Planner`, `round_up_buffer`), [`cpu`] (the private CPU kernels), [`decoder`] (the
//! private whole-step CPU decoder; the values it is built from in [`decoder_specs`]) and [`errors`]
//! (exceptions). Each method converts plain Python values (ints, lists of ints, short strings)
//! and calls the same-named [`KvPool`](crate::KvPool) or planner function. Errors become Python
//! exceptions in one place, the `From<KvError> for PyErr` impl in [`errors`]. The stub
//! `python/kvpark/_core.pyi` mirrors this module and `mypy.stubtest` checks the two agree.

mod cpu;
mod cpu_pack;
mod decoder;
mod decoder_specs;
mod errors;
mod planner;
mod pool;

use pyo3::prelude::*;

use cpu::{
    _blockmm_q4, _blockmm_q4_i8, _blockmm_q6, _blockmm_q6_i8, _blockmm_q8, _blockmm_q8_i8,
    _cpu_features, _cpu_set_threads, _decode_attention, _rms_norm,
};
use cpu_pack::{_cpu_pack_q4, _cpu_pack_q5, _cpu_pack_q5_blocks, _cpu_pack_q6};
use decoder::PyCpuDecoder;
use errors::PoolFullError;
use planner::{round_up_buffer, PyAction, PyPlanner, PyRequestView};
use pool::PyKvPool;

/// kvpark's KV cell pool, page tables, occupancy queries and preemption planner, from the Rust
/// crate kvpark-core.
#[pymodule]
#[pyo3(name = "_core")]
fn kvpark_core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvPool>()?;
    m.add_class::<PyRequestView>()?;
    m.add_class::<PyAction>()?;
    m.add_class::<PyPlanner>()?;
    m.add_class::<PyCpuDecoder>()?;
    m.add_function(wrap_pyfunction!(round_up_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(_blockmm_q4, m)?)?;
    m.add_function(wrap_pyfunction!(_blockmm_q8, m)?)?;
    m.add_function(wrap_pyfunction!(_blockmm_q4_i8, m)?)?;
    m.add_function(wrap_pyfunction!(_blockmm_q8_i8, m)?)?;
    m.add_function(wrap_pyfunction!(_blockmm_q6, m)?)?;
    m.add_function(wrap_pyfunction!(_blockmm_q6_i8, m)?)?;
    m.add_function(wrap_pyfunction!(_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(_cpu_pack_q4, m)?)?;
    m.add_function(wrap_pyfunction!(_cpu_pack_q5, m)?)?;
    m.add_function(wrap_pyfunction!(_cpu_pack_q5_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(_cpu_pack_q6, m)?)?;
    m.add_function(wrap_pyfunction!(_cpu_set_threads, m)?)?;
    m.add_function(wrap_pyfunction!(_cpu_features, m)?)?;
    m.add("PoolFullError", m.py().get_type::<PoolFullError>())?;
    Ok(())
}
