//! [`ShapeError`]: why a kernel refuses its arguments, and the length check behind most of them.

/// Why a product cannot run: a size that does not match the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShapeError {}

/// `what` has the `want` elements its shape says.
pub(crate) fn check(what: &str, got: usize, want: usize) -> Result<(), ShapeError> {
    if got == want {
        Ok(())
    } else {
        Err(ShapeError(format!(
            "{what} has {got} elements, expected {want}"
        )))
    }
}
