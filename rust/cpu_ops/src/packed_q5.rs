//! Q5_K's q8 blocks packed compact, in `crate::packed`'s groups: five bits a quant, int8 scales
//! and offsets with an f32 `d` and `dmin` per 256 weights, as its file held them.
//!
//! Why: the loader makes a Q5_K matrix [`Q8Weights`] with offsets (quants 0..32, `scale = d *
//! sc`, `offset = dmin * m`), a byte a quant and two f32 values a block: 10 bits a weight where
//! the file has 5.5. On a Llama-1B-shaped Q5_K_M that put peak memory at 1.4x llama-server's and
//! bound the single stream by the bytes it read. Packed, it takes 5.5 bits again, and
//! `int8/wide_packed.rs` (AVX-512 VNNI) and `int8/wide_avx2_packed.rs` (AVX2) widen each block
//! as they read it, as they do q6's.
//!
//! # Layout
//! Groups of [`PACK`] columns, a group's blocks lane by lane of `int8`'s combine
//! (`position`: `p`). A group's block at `p` is [`Q5_BLOCK_BYTES`] bytes from `qs[(g * blocks
//! + p) * 352..]`; with `u_t` the quad of weights `4t..4t + 4` of column `i` (byte `e` its
//! weight `4t + e`; `u = q`, in 0..32):
//! - bytes `64 j + 4 i + e`, `j` in 0..4: `u_j`'s low four bits, `u_{j+4}`'s in the high nibble;
//! - bytes `256 + 4 i + e`: bit `t` holds `u_t >> 4`, `t` in 0..8;
//! - bytes `320 + i`: the int8 `sc` of the block's scale, `336 + i`: the int8 `m` of its
//!   offset.
//!
//! Column `i`'s `d` and `dmin` for block `b` lie at `scale[at]` and `offset[at]`, `at = (g *
//! supers + b / SUPER) * PACK + i`, and its scale is `d * sc`, its offset `dmin * m` (f32,
//! exact: the row layout's values, bit for bit).

use crate::packed::{int8_scales, packable, position, PACK, SUPER};
use crate::shape::ShapeError;
use crate::weights::{Q8Packing, Q8Weights, BLOCK};

/// Bytes of a packed q5 group's block: sixteen columns' 32 five-bit quants, int8 scale and
/// offset.
pub const Q5_BLOCK_BYTES: usize = 22 * PACK;

/// The lengths of a packed q5 matrix's quants (bytes) and of its `d` (and `dmin`) values, for
/// `n` columns of `k`.
pub fn q5_packed_lengths(n: usize, k: usize) -> (usize, usize) {
    let blocks = k / BLOCK;
    (
        n * blocks * Q5_BLOCK_BYTES / PACK,
        n * blocks.div_ceil(SUPER),
    )
}

/// Where the packed q5 group holding column `c` has its block `b`.
#[inline(always)]
pub(crate) fn q5_at(blocks: usize, c: usize, b: usize) -> usize {
    (c / PACK * blocks + position(blocks, b)) * Q5_BLOCK_BYTES
}

/// Column `c`'s block `b` of a packed q5 matrix: its 32 quants, its scale and its offset, as
/// the row layout holds them.
pub(crate) fn q5_block(w: &Q8Weights<'_>, c: usize, b: usize) -> ([i8; BLOCK], f32, f32) {
    let blocks = w.k / BLOCK;
    let at = q5_at(blocks, c, b);
    let byte = |o: usize| w.qs[at + o] as u8;
    let i = c % PACK;
    let qs = quants(&w.qs[at..], i).map(|u| u as i8);
    let v = crate::packed::super_at(blocks, c, b);
    let offset = w.offset.expect("a packed q5 matrix has offsets");
    let scale = w.scale[v] * f32::from(byte(320 + i) as i8);
    (qs, scale, offset[v] * f32::from(byte(336 + i) as i8))
}

/// Column `c`'s block `b` of a packed q5 matrix of either layout (`Q5Super` here, `Q5Blocks` in
/// `packed_q5_blocks`): its quants, scale and offset (0 for none) as the row layout holds them.
pub(crate) fn either_block(w: &Q8Weights<'_>, c: usize, b: usize) -> ([i8; BLOCK], f32, f32) {
    match w.packed {
        Q8Packing::Q5Blocks => crate::packed_q5_blocks::q5b_block(w, c, b),
        _ => q5_block(w, c, b),
    }
}

/// Packs the q8 `w` (row layout, with offsets) into `qs`, `scale` (its `d`) and `offset` (its
/// `dmin`), the lengths of [`q5_packed_lengths`]: refused where a quant lies outside 0..32 or a
/// column's run of [`SUPER`] blocks has scales or offsets that are not one f32 times int8s (not
/// Q5_K's: Q5_0's and Q5_1's f16 scales, say).
pub fn pack_q5(
    w: Q8Weights<'_>,
    qs: &mut [i8],
    scale: &mut [f32],
    offset: &mut [f32],
) -> Result<(), ShapeError> {
    let (qs_len, d_len) = q5_packed_lengths(w.n, w.k);
    let Some(offsets) = w.offset else {
        return Err(ShapeError(
            "packs q5 blocks with offsets (Q5_K's) only".into(),
        ));
    };
    let blocks = w.n * w.k / BLOCK;
    packable(
        w.packed != Q8Packing::Rows,
        w.n,
        w.k,
        &[
            ("qs", w.qs.len(), w.n * w.k),
            ("scale", w.scale.len(), blocks),
            ("offset", offsets.len(), blocks),
            ("packed qs", qs.len(), qs_len),
            ("packed scale", scale.len(), d_len),
            ("packed offset", offset.len(), d_len),
        ],
    )?;
    if let Some(q) = w.qs.iter().find(|q| !(0..32).contains(*q)) {
        return Err(ShapeError(format!(
            "packs q5 quants in 0..32 only, not {q}"
        )));
    }
    let blocks = w.k / BLOCK;
    for c in 0..w.n {
        let column = c * blocks..(c + 1) * blocks;
        for (values, out, at) in [(w.scale, &mut *scale, 320), (offsets, &mut *offset, 336)] {
            for (s, run) in values[column.clone()].chunks(SUPER).enumerate() {
                let mut ints = [0i8; SUPER];
                let d = int8_scales(run, &mut ints[..run.len()]).ok_or_else(|| {
                    ShapeError(format!(
                        "column {c}'s q5 scales or offsets {run:?} are not one f32 times int8s"
                    ))
                })?;
                out[crate::packed::super_at(blocks, c, s * SUPER)] = d;
                for (j, v) in ints[..run.len()].iter().enumerate() {
                    qs[q5_at(blocks, c, s * SUPER + j) + at + c % PACK] = *v;
                }
            }
        }
        for b in 0..blocks {
            let from = (c * blocks + b) * BLOCK;
            put_quants(&mut qs[q5_at(blocks, c, b)..], c % PACK, |j| {
                w.qs[from + j] as u8
            });
        }
    }
    Ok(())
}

/// Column `i`'s 32 five-bit quants of the packed block whose bytes start `block`: bytes `64 j + 4
/// i + e` hold quad `j`'s low nibble (weight `4 j + e`) and quad `j + 4`'s in the high one,
/// bytes `256 + 4 i + e` bit `t` quad `t`'s fifth bit. Shared with `packed_q5_blocks`.
pub(crate) fn quants(block: &[i8], i: usize) -> [u8; BLOCK] {
    std::array::from_fn(|w| {
        let (t, e) = (w / 4, w % 4);
        let low = block[64 * (t % 4) + 4 * i + e] as u8 >> (4 * (t / 4)) & 0x0f;
        let high = block[256 + 4 * i + e] as u8 >> t & 1;
        low | high << 4
    })
}

/// Writes column `i`'s 32 quants `u(w)` (each in 0..32) into the packed block whose bytes
/// start `block`, as [`quants`] reads them (the other columns' bits kept).
pub(crate) fn put_quants(block: &mut [i8], i: usize, u: impl Fn(usize) -> u8) {
    for e in 0..4 {
        for j in 0..4 {
            let byte = u(4 * j + e) & 0x0f | (u(4 * (j + 4) + e) & 0x0f) << 4;
            block[64 * j + 4 * i + e] = byte as i8;
        }
        let top = (0..8).fold(0u8, |acc, t| acc | (u(4 * t + e) >> 4) << t);
        block[256 + 4 * i + e] = top as i8;
    }
}
