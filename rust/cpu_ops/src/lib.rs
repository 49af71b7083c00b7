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
//!   or the same bytes and values in [`packed`]'s layout, groups of sixteen columns side by side;
//! - [`Q8Weights`]: `qs` `[n, k]` i8; `scale` and optional `offset` `[n, k / 32]`: weight =
//!   `scale * q + offset` (Q8_0 has no offset; K-quants repacked at load time to 8-bit quants
//!   keep their per-block minimum as one);
//! - [`Q6Weights`]: `qs` `[n, k]` i8; `scale` `[n, k / 16]`: weight = `scale * q`, a scale per
//!   16 weights (GGUF's Q6_K, unpacked at load time).
//!
//! Every weight is expanded with one fused multiply-add (`scale * q + offset`, `offset` 0 where
//! there is none), which rounds to the same f32 a separate multiply and add give whenever
//! `scale * q` is exact (GGUF scales are f16, so it is): the weights are bitwise those of the
//! dequantised tensor. Q6 weights are one multiply, `scale * q` (exact: `d * sc` has at most
//! 18 significant bits and `q - 32` 5, so it is `gguf`'s product, the sign of a zero included).
//! Each output is then a sum over eight lanes in block order, reduced in a fixed tree. A row's
//! result depends only on that row of `x` and on `W`: never on the other rows, the row tiling or
//! the thread split (exact mode needs this), and the SIMD and plain paths give the same bits.
//!
//! Dense matrices ([`DenseWeights`]: f32, f16 or bf16 values) have their own product,
//! [`matmul_dense`], in the same spirit: each weight widened exactly in registers, one fixed
//! summation order on every path ([`dense`] gives it).
//!
//! [`matmul_i8`] is the other route to the same product: the activations are rounded to int8
//! per block inside the call and multiplied as integers ([`int8`] says how, in what order, and
//! how far the result may lie from this path's).

mod attention;
mod avx2;
mod cache;
pub mod decoder;
pub mod dense;
mod exp;
pub mod int8;
mod iq4;
pub mod isa;
pub(crate) mod lane_tree;
mod norm;
pub mod packed;
pub mod packed_q5;
pub mod packed_q5_blocks;
mod plain;
mod product;
mod row_split;
mod shape;
mod threads;
mod tiling;
mod weights;

pub use attention::{decode_attention, decode_attention_with, DecodeAttention, KvValues, Scores};
pub use dense::bf16_pairs::{matmul_bf16_pairs, round_bf16, PairKernel};
pub use dense::{matmul_dense, DenseKernel};
pub use int8::{
    matmul_i8, matmul_i8_parts, matmul_q4_i8, matmul_q6_i8, matmul_q8_i8, I8Kernel, I8Scratch,
};
pub use iq4::IQ4_TABLE;
pub use norm::rms_norm;
pub use packed::{pack_q4, pack_q6, q6_packed_lengths, PACK};
pub use packed_q5::{pack_q5, q5_packed_lengths};
pub use packed_q5_blocks::{pack_q5_blocks, q5b_packed_lengths};
pub use shape::ShapeError;
pub use threads::set_threads;
pub use tiling::ROW_TILE;
pub use weights::{
    narrow_low, DenseValues, DenseWeights, Iq4Weights, Q4Weights, Q6Weights, Q8Packing, Q8Weights,
    Weights, BLOCK, Q6_GROUP,
};

use product::product;

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

/// `y = x @ W.T` for IQ4_NL / IQ4_XS weights (nibbles into [`IQ4_TABLE`], a scale per 32):
/// bitwise [`matmul_q8`] of the q8 blocks they equal.
pub fn matmul_iq4(
    x: &[f32],
    rows: usize,
    w: Iq4Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    product(x, rows, Weights::Iq4(w), y, true)
}

/// `y = x @ W.T` for Q6_K weights (int8 quants, a scale per 16).
pub fn matmul_q6(
    x: &[f32],
    rows: usize,
    w: Q6Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    product(x, rows, Weights::Q6(w), y, true)
}

/// See [`matmul_q4_plain`].
pub fn matmul_q6_plain(
    x: &[f32],
    rows: usize,
    w: Q6Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    product(x, rows, Weights::Q6(w), y, false)
}
