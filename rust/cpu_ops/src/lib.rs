//! kvpark-cpu-ops: kvpark's CPU kernels. `y = x @ W.T` with `x` in f32 and `W` kept in the
//! 32-weight blocks of a GGUF file (Q4_0, Q4_1, Q8_0) instead of being expanded to f32; and
//! decode attention read in place from the paged KV pool ([`decode_attention`]); and a one-call
//! [`rms_norm`]. Pure Rust, no Python: `rust/py/cpu.rs` of kvpark-core wraps them.
//!
//! Why: a decode step reads every weight once, so on a CPU its time is the bytes it reads. The
//! default model's Q4_1 weights are 4.5 bits a weight; expanded to f32 they are 32. This crate
//! multiplies the blocks directly, expanding each one in registers (AVX2 and FMA where the CPU
//! has them, plain Rust otherwise).
//!
//! Layouts (all row-major, `k` a multiple of [`BLOCK`]):
//! - `x`: `[rows, k]` f32; `y`: `[rows, n]` f32, overwritten;
//! - [`Q4Weights`]: `qs` `[n, k / 2]` bytes, block by block as in GGUF (weight `i` of a block in the
//!   low nibble of byte `i`, weight `i + 16` in its high nibble); `scale`, `offset` `[n, k / 32]`
//!   f32: weight = `scale * nibble + offset` (Q4_1 as stored; Q4_0 has `offset = -8 * scale`);
//! - [`Q8Weights`]: `qs` `[n, k]` i8; `scale` and optional `offset` `[n, k / 32]`: weight =
//!   `scale * q + offset` (Q8_0 has no offset; K-quants repacked at load time to 8-bit quants
//!   keep their per-block minimum as one).
//!
//! Every weight is expanded with one fused multiply-add (`scale * q + offset`, `offset` 0 where
//! there is none), which rounds to the same f32 a separate multiply and add give whenever
//! `scale * q` is exact (GGUF scales are f16, so it is): the weights are bitwise those of the
//! dequantised tensor. Each output is then a sum over eight lanes in block
//! order, reduced in a fixed tree. A row's result depends only on that row of `x` and on `W`:
//! never on the other rows, the row tiling or the thread split (exact mode needs this), and the
//! SIMD and plain paths give the same bits.
//!
//! [`matmul_i8`] is the other route to the same product: the activations are rounded to int8
//! per block inside the call and multiplied as integers ([`int8`] says how, in what order, and
//! how far the result may lie from this path's).

mod attention;
mod avx2;
pub mod decoder;
pub mod int8;
pub mod isa;
mod norm;
mod plain;
mod threads;

pub use attention::{decode_attention, DecodeAttention, KvValues};
pub use int8::{matmul_i8, matmul_q4_i8, matmul_q8_i8, I8Kernel, I8Scratch};
pub use norm::rms_norm;
pub use threads::set_threads;

/// Weights per quantisation block.
pub const BLOCK: usize = 32;
/// Rows of `x` multiplied together against one expanded weight block.
pub const ROW_TILE: usize = 8;
/// Output columns handed to a thread at a time.
const COLUMN_CHUNK: usize = 16;
/// Output columns computed side by side (a multiple of it divides [`COLUMN_CHUNK`]).
pub(crate) const COLUMN_GROUP: usize = 4;

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

/// Why a product cannot run: a size that does not match the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShapeError {}

fn check(what: &str, got: usize, want: usize) -> Result<(), ShapeError> {
    if got == want {
        Ok(())
    } else {
        Err(ShapeError(format!(
            "{what} has {got} elements, expected {want}"
        )))
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

/// One weight matrix in either format (what [`matmul_i8`] takes).
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

/// `y = x @ W.T`: on the thread team with SIMD where the CPU has it, or on the calling thread
/// through the portable path (`simd` false).
fn product(
    x: &[f32],
    rows: usize,
    w: Weights<'_>,
    y: &mut [f32],
    simd: bool,
) -> Result<(), ShapeError> {
    w.check(x, y, rows)?;
    if simd {
        threads::run(x, rows, w.k(), w, y);
    } else {
        columns(x, rows, w.k(), w, 0..w.n(), &threads::Output::new(y), false);
    }
    Ok(())
}

/// `y = x @ W.T` for 4-bit block weights.
pub fn matmul_q4(
    x: &[f32],
    rows: usize,
    w: Q4Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    product(x, rows, Weights::Q4(w), y, true)
}

/// `y = x @ W.T` for 8-bit block weights.
pub fn matmul_q8(
    x: &[f32],
    rows: usize,
    w: Q8Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    product(x, rows, Weights::Q8(w), y, true)
}

/// The same products without SIMD, for tests that check both paths give the same bits.
pub fn matmul_q4_plain(
    x: &[f32],
    rows: usize,
    w: Q4Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    product(x, rows, Weights::Q4(w), y, false)
}

/// See [`matmul_q4_plain`].
pub fn matmul_q8_plain(
    x: &[f32],
    rows: usize,
    w: Q8Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    product(x, rows, Weights::Q8(w), y, false)
}

/// Output columns `cols` of every row: `y[r * n + c]` for `c` in `cols`. `y` is the whole
/// output; only those columns are written, so threads given disjoint columns can share it.
pub(crate) fn columns(
    x: &[f32],
    rows: usize,
    k: usize,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &threads::Output,
    simd: bool,
) {
    let n = w.n();
    let mut out = [[0.0f32; ROW_TILE]; COLUMN_GROUP];
    let mut r0 = 0;
    while r0 < rows {
        let tile = ROW_TILE.min(rows - r0);
        let xt = &x[r0 * k..(r0 + tile) * k];
        let mut c = cols.start;
        while c < cols.end {
            let group = COLUMN_GROUP.min(cols.end - c);
            if simd {
                // SAFETY: `simd` is only true when avx2::available() said the CPU has AVX2 and FMA.
                unsafe { avx2::columns(xt, tile, k, w, c, group, &mut out) };
            } else {
                for (g, o) in out.iter_mut().enumerate().take(group) {
                    plain::column(xt, tile, k, w, c + g, o);
                }
            }
            for (g, o) in out.iter().enumerate().take(group) {
                for (r, v) in o[..tile].iter().enumerate() {
                    y.set((r0 + r) * n + c + g, *v);
                }
            }
            c += group;
        }
        r0 += tile;
    }
}
