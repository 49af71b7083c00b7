//! The weight matrices the kernels read: in blocks ([`Q4Weights`], [`Q8Weights`], [`Q6Weights`]) or dense
//! ([`DenseWeights`]: f32, f16 or bf16 values), any of them as [`Weights`]; and the check that
//! their slices and an `x`/`y` pair fit their shapes.

use crate::shape::{check, ShapeError};

/// Weights per quantisation block.
pub const BLOCK: usize = 32;

/// Weights per scale of [`Q6Weights`] (half a [`BLOCK`]).
pub const Q6_GROUP: usize = 16;

/// 4-bit weights: `weight = scale * nibble + offset`, per block of 32.
#[derive(Clone, Copy, Debug)]
pub struct Q4Weights<'a> {
    pub qs: &'a [u8],
    pub scale: &'a [f32],
    pub offset: &'a [f32],
    pub n: usize,
    pub k: usize,
    /// In [`crate::packed`]'s layout (groups of [`crate::PACK`] columns, each block's quads
    /// side by side, as the side-by-side kernels read them), not row by row: same bytes, same
    /// results, no per-call transposition.
    pub packed: bool,
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
    /// `Some(m)` where every `q` lies in `m..m + 32` (Q5_0 and Q5_1 as q8 blocks; `narrow_low(qs,
    /// 32)` finds it): AVX2 multiplies such weights as `q - m` in `vpmaddubsw`, four pairs summed in
    /// i16, where full-range ones need a `vpmaddwd` per pair (`int8/wide_avx2.rs`). Same bits
    /// either way; a wrong `m` gives wrong sums (no unsafety), so only [`narrow_low`] sets it.
    pub low: Option<i8>,
    /// Row by row, or packed compact at load (five bits a quant).
    pub packed: Q8Packing,
}

/// How a [`Q8Weights`] lies: the row layout, or one of the five-bit layouts packed at load (in
/// [`crate::packed`]'s groups, read in place by the side-by-side kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q8Packing {
    /// `[n, k]` quants, a scale (and offset) a block.
    Rows,
    /// Q5_K's blocks ([`crate::packed_q5`]): quants 0..32, `scale` and `offset` the `d` and
    /// `dmin` per column and 256 weights, `qs` the five-bit quants and int8 scales and offsets.
    Q5Super,
    /// Q5_0's and Q5_1's ([`crate::packed_q5_blocks`]): quants `q - low` in 0..32, the row
    /// layout's f32 scale (and offset) a block beside them.
    Q5Blocks,
}

/// The `m` of [`Q8Weights::low`] (`span` 32) or [`Q6Weights::low`] (`span` 64) for these quants:
/// their least value where the largest is less than `span` above it, else `None`.
pub fn narrow_low(qs: &[i8], span: i16) -> Option<i8> {
    let (lo, hi) = qs
        .iter()
        .fold((i8::MAX, i8::MIN), |(lo, hi), &q| (lo.min(q), hi.max(q)));
    (!qs.is_empty() && i16::from(hi) - i16::from(lo) < span).then_some(lo)
}

/// IQ4_NL / IQ4_XS weights: `weight = scale * IQ4_TABLE[nibble]`, per block of 32, the
/// nibbles in [`Q4Weights`]' order. Read at half the bytes of the [`Q8Weights`] they equal:
/// every product expands them into those q8 blocks a few columns at a time (`iq4.rs`), so its
/// bits are the q8 product's.
#[derive(Clone, Copy, Debug)]
pub struct Iq4Weights<'a> {
    /// `[n, k / 2]`.
    pub qs: &'a [u8],
    /// `[n, k / 32]`.
    pub scale: &'a [f32],
    pub n: usize,
    pub k: usize,
}

/// GGUF's Q6_K unpacked: `weight = scale * q`, int8 `q` (Q6_K's `q - 32`, in [-32, 31]; the
/// kernels take any int8) and one f32 scale per [`Q6_GROUP`] weights (Q6_K's `d * sc`, exact
/// in f32: an 11-bit f16 significand times an 8-bit integer). Blocks of 32 as for the other
/// kinds, each with two scales: `scale[2 b]` for its weights 0..16, `scale[2 b + 1]` for 16..32.
#[derive(Clone, Copy, Debug)]
pub struct Q6Weights<'a> {
    /// `[n, k]`.
    pub qs: &'a [i8],
    /// `[n, k / 16]`.
    pub scale: &'a [f32],
    pub n: usize,
    pub k: usize,
    /// `Some(m)` where every `q` lies in `m..m + 64` (Q6_K's, Q3_K's; `narrow_low(qs, 64)`):
    /// as [`Q8Weights::low`], with two pair sums in i16 rather than four.
    pub low: Option<i8>,
    /// In [`crate::packed`]'s layout, as [`Q4Weights::packed`].
    pub packed: bool,
}

/// A dense matrix's `[n, k]` values, row-major: f32; IEEE f16 bits (1 sign, 5 exponent, 10
/// fraction bits); or bf16 bits (the upper half of an f32's).
#[derive(Clone, Copy, Debug)]
pub enum DenseValues<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
}

/// A dense matrix, as a Hugging Face checkpoint or an F32/F16/BF16 GGUF tensor holds it. Its
/// products always take f32 activations ([`crate::dense`]): int8 activations are defined only
/// against blocks, so [`crate::matmul_i8`] refuses it.
#[derive(Clone, Copy, Debug)]
pub struct DenseWeights<'a> {
    pub values: DenseValues<'a>,
    pub n: usize,
    /// Any positive count: no block structure.
    pub k: usize,
}

impl DenseValues<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            DenseValues::F32(v) => v.len(),
            DenseValues::F16(v) | DenseValues::Bf16(v) => v.len(),
        }
    }
}

/// One weight matrix in any format (what the decoder's layers hold). A model may mix them.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    Q4(Q4Weights<'a>),
    Q8(Q8Weights<'a>),
    Q6(Q6Weights<'a>),
    Iq4(Iq4Weights<'a>),
    Dense(DenseWeights<'a>),
}

impl<'a> From<Iq4Weights<'a>> for Weights<'a> {
    fn from(w: Iq4Weights<'a>) -> Self {
        Weights::Iq4(w)
    }
}

impl<'a> From<DenseWeights<'a>> for Weights<'a> {
    fn from(w: DenseWeights<'a>) -> Self {
        Weights::Dense(w)
    }
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

impl<'a> From<Q6Weights<'a>> for Weights<'a> {
    fn from(w: Q6Weights<'a>) -> Self {
        Weights::Q6(w)
    }
}

fn check_common(x: &[f32], y: &[f32], rows: usize, n: usize, k: usize) -> Result<(), ShapeError> {
    if k == 0 {
        return Err(ShapeError("k = 0".into()));
    }
    check("x", x.len(), rows * k)?;
    check("y", y.len(), rows * n)
}

fn check_blocks(x: &[f32], y: &[f32], rows: usize, n: usize, k: usize) -> Result<(), ShapeError> {
    if k == 0 || !k.is_multiple_of(BLOCK) {
        return Err(ShapeError(format!(
            "k = {k} is not a positive multiple of {BLOCK}"
        )));
    }
    check_common(x, y, rows, n, k)
}

/// A packed matrix's columns fill whole groups.
fn check_packed(packed: bool, n: usize) -> Result<(), ShapeError> {
    if packed && !n.is_multiple_of(crate::PACK) {
        return Err(ShapeError(format!(
            "a packed matrix has a multiple of {} columns, not {n}",
            crate::PACK
        )));
    }
    Ok(())
}

impl Weights<'_> {
    /// Whether the matrix is in [`crate::packed`]'s layout.
    pub fn packed(&self) -> bool {
        match self {
            Weights::Q4(w) => w.packed,
            Weights::Q6(w) => w.packed,
            Weights::Q8(w) => w.packed != Q8Packing::Rows,
            _ => false,
        }
    }

    /// Output columns (rows of `W`).
    pub fn n(&self) -> usize {
        match self {
            Weights::Q4(w) => w.n,
            Weights::Q8(w) => w.n,
            Weights::Q6(w) => w.n,
            Weights::Iq4(w) => w.n,
            Weights::Dense(w) => w.n,
        }
    }

    /// Inputs per column, a multiple of [`BLOCK`] for block matrices.
    pub fn k(&self) -> usize {
        match self {
            Weights::Q4(w) => w.k,
            Weights::Q8(w) => w.k,
            Weights::Q6(w) => w.k,
            Weights::Iq4(w) => w.k,
            Weights::Dense(w) => w.k,
        }
    }

    /// Every slice has the length the shapes say.
    pub(crate) fn check(&self, x: &[f32], y: &[f32], rows: usize) -> Result<(), ShapeError> {
        let (n, k) = (self.n(), self.k());
        match self {
            Weights::Dense(w) => {
                check_common(x, y, rows, n, k)?;
                check("values", w.values.len(), n * k)
            }
            Weights::Q4(w) => {
                check_blocks(x, y, rows, n, k)?;
                check_packed(w.packed, n)?;
                check("qs", w.qs.len(), n * k / 2)?;
                check("scale", w.scale.len(), n * k / BLOCK)?;
                check("offset", w.offset.len(), n * k / BLOCK)
            }
            Weights::Q8(w) => {
                check_blocks(x, y, rows, n, k)?;
                check_packed(w.packed != Q8Packing::Rows, n)?;
                let (qs, values) = match w.packed {
                    Q8Packing::Rows => (n * k, n * k / BLOCK),
                    Q8Packing::Q5Super => crate::packed_q5::q5_packed_lengths(n, k),
                    Q8Packing::Q5Blocks => crate::packed_q5_blocks::q5b_packed_lengths(n, k),
                };
                check("qs", w.qs.len(), qs)?;
                check("scale", w.scale.len(), values)?;
                if w.packed == Q8Packing::Q5Super && w.offset.is_none() {
                    return Err(ShapeError("a packed Q5_K matrix has offsets".into()));
                }
                if w.packed == Q8Packing::Q5Blocks && w.low.is_none() {
                    return Err(ShapeError("a packed q5 matrix has its low".into()));
                }
                w.offset
                    .map_or(Ok(()), |o| check("offset", o.len(), values))
            }
            Weights::Q6(w) => {
                check_blocks(x, y, rows, n, k)?;
                check_packed(w.packed, n)?;
                let (qs, scale) = if w.packed {
                    crate::packed::q6_packed_lengths(n, k)
                } else {
                    (n * k, n * k / Q6_GROUP)
                };
                check("qs", w.qs.len(), qs)?;
                check("scale", w.scale.len(), scale)
            }
            Weights::Iq4(w) => {
                check_blocks(x, y, rows, n, k)?;
                check("qs", w.qs.len(), n * k / 2)?;
                check("scale", w.scale.len(), n * k / BLOCK)
            }
        }
    }
}
