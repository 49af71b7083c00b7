//! Q5_0's and Q5_1's blocks packed compact, in `crate::packed`'s groups: five bits a quant beside
//! the row layout's f32 scale (and offset) a block.
//!
//! Why: the loader makes a Q5_0 or Q5_1 matrix [`Q8Weights`] (quants `q - 16` or `q`, a byte
//! each, an f32 scale and for Q5_1 an offset a block: 9 or 10 bits a weight where the file has
//! 5.5 or 6), and every product of several rows transposed each group of columns into the
//! kernels' operand layout first, waiting on the weights' read (about a third of the AVX2 kernel
//! at eight rows of SmolLM2's Q4_K_M file, whose matrices are mostly Q5_0). Packed, the blocks lie
//! as the side-by-side kernels read them, in the order they walk them, at 6 or 7 bits a weight.
//! Their f16 scales are no K-quant's int8s times a `d` a run, so unlike Q5_K's
//! ([`crate::packed_q5`]) they stay one f32 a block.
//!
//! # Layout
//! The quants are stored as `u = q - low` in 0..32 (`low`: the matrix's [`Q8Weights::low`], kept
//! with the packed matrix: -16 for Q5_0's, 0 for Q5_1's). Groups of [`PACK`] columns, a group's
//! blocks lane by lane of `int8`'s combine (`position`: `p`); a group's block at `p` is
//! [`Q5B_BLOCK_BYTES`] bytes from `qs[(g * blocks + p) * 320..]`, with `u_t` the quad of weights
//! `4t..4t + 4` of column `i` (byte `e` its weight `4t + e`):
//! - bytes `64 j + 4 i + e`, `j` in 0..4: `u_j`'s low four bits, `u_{j+4}`'s in the high nibble;
//! - bytes `256 + 4 i + e`: bit `t` holds `u_t >> 4`, `t` in 0..8
//!
//! (Q5_K's bytes without its int8 scales). Column `i`'s scale and offset for block `b` lie at
//! `scale[at]`, `offset[at]`, `at = (g * blocks + p) * PACK + i`: each block a vector of the
//! group's columns, as a packed 4-bit matrix's.

use crate::packed::{packable, position, value_at, PACK};
use crate::packed_q5::{put_quants, quants};
use crate::shape::ShapeError;
use crate::weights::{Q8Packing, Q8Weights, BLOCK};

/// Bytes of a packed q5 group's block: sixteen columns' 32 five-bit quants.
pub const Q5B_BLOCK_BYTES: usize = 20 * PACK;

/// The lengths of a packed q5 matrix's quants (bytes) and of its scales (and offsets), for `n`
/// columns of `k`.
pub fn q5b_packed_lengths(n: usize, k: usize) -> (usize, usize) {
    let blocks = n * k / BLOCK;
    (blocks * Q5B_BLOCK_BYTES / PACK, blocks)
}

/// Where the packed group holding column `c` has its block `b`.
#[inline(always)]
pub(crate) fn q5b_at(blocks: usize, c: usize, b: usize) -> usize {
    (c / PACK * blocks + position(blocks, b)) * Q5B_BLOCK_BYTES
}

/// Column `c`'s block `b` of a packed q5 matrix: its 32 quants, its scale and its offset (0
/// for none), as the row layout holds them.
pub(crate) fn q5b_block(w: &Q8Weights<'_>, c: usize, b: usize) -> ([i8; BLOCK], f32, f32) {
    let blocks = w.k / BLOCK;
    let low = w.low.expect("a packed q5 matrix has its low");
    let u = quants(&w.qs[q5b_at(blocks, c, b)..], c % PACK);
    let v = value_at(blocks, c, b, 1, 0);
    let offset = w.offset.map_or(0.0, |o| o[v]);
    (u.map(|u| (u as i8).wrapping_add(low)), w.scale[v], offset)
}

/// Packs the q8 `w` (row layout, its `low` set, every quant in `low..low + 32`) into `qs`,
/// `scale` and `offset` (the lengths of [`q5b_packed_lengths`]; `offset` exactly where `w` has
/// offsets): refused where a quant lies outside that window.
pub fn pack_q5_blocks(
    w: Q8Weights<'_>,
    qs: &mut [i8],
    scale: &mut [f32],
    offset: Option<&mut [f32]>,
) -> Result<(), ShapeError> {
    let (qs_len, values) = q5b_packed_lengths(w.n, w.k);
    let Some(low) = w.low else {
        return Err(ShapeError(
            "packs q8 blocks whose quants span 32 values (low set) only".into(),
        ));
    };
    if w.offset.is_some() != offset.is_some() {
        return Err(ShapeError(
            "packs offsets exactly where the matrix has them".into(),
        ));
    }
    packable(
        w.packed != Q8Packing::Rows,
        w.n,
        w.k,
        &[
            ("qs", w.qs.len(), w.n * w.k),
            ("scale", w.scale.len(), values),
            ("offset", w.offset.map_or(values, <[f32]>::len), values),
            ("packed qs", qs.len(), qs_len),
            ("packed scale", scale.len(), values),
            (
                "packed offset",
                offset.as_ref().map_or(values, |o| o.len()),
                values,
            ),
        ],
    )?;
    let window = i16::from(low)..i16::from(low) + 32;
    if let Some(q) = w.qs.iter().find(|q| !window.contains(&i16::from(**q))) {
        return Err(ShapeError(format!(
            "packs q5 quants in {window:?} only, not {q}"
        )));
    }
    let blocks = w.k / BLOCK;
    for c in 0..w.n {
        for b in 0..blocks {
            let from = (c * blocks + b) * BLOCK;
            put_quants(&mut qs[q5b_at(blocks, c, b)..], c % PACK, |j| {
                w.qs[from + j].wrapping_sub(low) as u8
            });
            scale[value_at(blocks, c, b, 1, 0)] = w.scale[c * blocks + b];
        }
    }
    if let (Some(src), Some(dst)) = (w.offset, offset) {
        for c in 0..w.n {
            for b in 0..blocks {
                dst[value_at(blocks, c, b, 1, 0)] = src[c * blocks + b];
            }
        }
    }
    Ok(())
}
