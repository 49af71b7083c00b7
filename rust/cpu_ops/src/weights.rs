//! The block weight matrices the kernels read ([`Q4Weights`], [`Q8Weights`], either as
//! [`Weights`]) and the check that their slices and an `x`/`y` pair fit their shapes.

use crate::shape::{check, ShapeError};

/// Weights per quantisation block.
pub const BLOCK: usize = 32;

/// 4-bit weights: `weight = scale * nibble + offset`, per block of 32.
#[derive(Clone, Copy, Debug)]
pub struct Q4Weights<'a> {
    pub qs: &'a [u8],
    pub scale: &'a [f32],
    pub offset: &'a [f32],
    pub n: usize,
    pub k: usize,
}

/// 8-bit weights: `weight = scale * q + offset` (no offset: `scale * q`), per block of 32.
#[derive(Clone, Copy, Debug)]
pub struct Q8Weights<'a> {
    pub qs: &'a [i8],
    pub scale: &'a [f32],
    /// `[n, k / 32]`, or `None` (Q8_0).
    pub offset: Option<&'a [f32]>,
    pub n: usize,
    pub k: usize,
}

/// One weight matrix in either format (what [`crate::matmul_i8`] takes).
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    Q4(Q4Weights<'a>),
    Q8(Q8Weights<'a>),
}

impl<'a> From<Q4Weights<'a>> for Weights<'a> {
    fn from(w: Q4Weights<'a>) -> Self {
        Weights::Q4(w)
    }
}

impl<'a> From<Q8Weights<'a>> for Weights<'a> {
    fn from(w: Q8Weights<'a>) -> Self {
        Weights::Q8(w)
    }
}

fn check_common(x: &[f32], y: &[f32], rows: usize, n: usize, k: usize) -> Result<(), ShapeError> {
    if k == 0 || !k.is_multiple_of(BLOCK) {
        return Err(ShapeError(format!(
            "k = {k} is not a positive multiple of {BLOCK}"
        )));
    }
    check("x", x.len(), rows * k)?;
    check("y", y.len(), rows * n)
}

impl Weights<'_> {
    /// Output columns (rows of `W`).
    pub fn n(&self) -> usize {
        match self {
            Weights::Q4(w) => w.n,
            Weights::Q8(w) => w.n,
        }
    }

    /// Inputs per column, a multiple of [`BLOCK`].
    pub fn k(&self) -> usize {
        match self {
            Weights::Q4(w) => w.k,
            Weights::Q8(w) => w.k,
        }
    }

    /// Every slice has the length the shapes say.
    pub(crate) fn check(&self, x: &[f32], y: &[f32], rows: usize) -> Result<(), ShapeError> {
        let (n, k) = (self.n(), self.k());
        check_common(x, y, rows, n, k)?;
        match self {
            Weights::Q4(w) => {
                check("qs", w.qs.len(), n * k / 2)?;
                check("scale", w.scale.len(), n * k / BLOCK)?;
                check("offset", w.offset.len(), n * k / BLOCK)
            }
            Weights::Q8(w) => {
                check("qs", w.qs.len(), n * k)?;
                check("scale", w.scale.len(), n * k / BLOCK)?;
                w.offset
                    .map_or(Ok(()), |o| check("offset", o.len(), n * k / BLOCK))
            }
        }
    }
}
