//! 4-bit matrices packed once at load into the operand layout of the side-by-side kernels, so
//! no product transposes them per call.
//!
//! Why: `int8/wide.rs` (AVX-512) and `int8/side_by_side.rs` (AVX2) multiply sixteen or eight
//! columns at once from vectors holding four weights of each column. From [`Q4Weights`]' row
//! layout every call transposed each block of a group into that form first: at eight rows (eight
//! chats decoding) about 45 % of the AVX-512 kernel on a Llama-1B shape, paid again every step.
//! Packed, the same bytes lie already in that order and a block's four operand vectors are four
//! aligned loads; the scales and offsets of a group's block are one vector each.
//!
//! # Layout
//! Columns go in groups of [`PACK`] (a packed matrix has a multiple of it); a group's blocks
//! go lane by lane of `int8`'s combine ([`position`]: `p` below); in group `g`, block at `p`,
//! quad `q` (bytes `4q..4q + 4` of a column's 16-byte block: weights `4q..4q + 4` in the low
//! nibbles, `16 + 4q..` in the high ones) of column `i` of the group sits at
//! `qs[(((g * blocks + p) * 4 + q) * PACK + i) * 4..][..4]`, and the column's scale and offset of
//! that block at `[(g * blocks + p) * PACK + i]`. A group's eight-column half is a contiguous
//! half of each 64-byte vector, which is what the AVX2 kernel reads.
//!
//! Every other kernel (the portable ones, the f32 path, the embedding lookup) reads a packed
//! matrix through [`unpacked_columns`] or [`block`]: the same values, so the same bits.

use std::cell::RefCell;
use std::ops::Range;

use crate::int8::LANES;
use crate::shape::{check, ShapeError};
use crate::threads::Output;
use crate::weights::{Q4Weights, Weights, BLOCK};

/// Columns per group of a packed matrix: the sixteen lanes of a 512-bit vector.
pub const PACK: usize = 16;

/// Where block `b` lies among a group's `blocks`: lane by lane of `int8`'s float combine (blocks
/// `l, l + 8, l + 16, ...` for lane `l`, lanes in order), the order in which the kernels walk
/// them, so a product reads its group front to back.
#[inline(always)]
pub(crate) fn position(blocks: usize, b: usize) -> usize {
    let (per_lane, longer) = (blocks / LANES, blocks % LANES);
    let l = b % LANES;
    // lanes before `l` hold `per_lane` blocks each, the first `longer` of them one more
    l * per_lane + l.min(longer) + b / LANES
}

/// Where column `c`'s quads of block `b` start (quad `q` at `+ q * PACK * 4`), in a packed
/// matrix of `blocks` blocks a column.
#[inline(always)]
pub(crate) fn quads_at(blocks: usize, c: usize, b: usize) -> usize {
    ((c / PACK * blocks + position(blocks, b)) * 4 * PACK + c % PACK) * 4
}

/// Where column `c`'s scale and offset of block `b` lie in a packed matrix.
#[inline(always)]
pub(crate) fn value_at(blocks: usize, c: usize, b: usize) -> usize {
    (c / PACK * blocks + position(blocks, b)) * PACK + c % PACK
}

/// Column `c`'s block `b` of a packed matrix: its 16 bytes as the row layout holds them, its
/// scale and its offset.
pub(crate) fn block(w: &Q4Weights<'_>, c: usize, b: usize) -> ([u8; BLOCK / 2], f32, f32) {
    let blocks = w.k / BLOCK;
    let at = quads_at(blocks, c, b);
    let mut bytes = [0u8; BLOCK / 2];
    for (q, quad) in bytes.chunks_exact_mut(4).enumerate() {
        let from = at + q * PACK * 4;
        quad.copy_from_slice(&w.qs[from..from + 4]);
    }
    let v = value_at(blocks, c, b);
    (bytes, w.scale[v], w.offset[v])
}

/// Packs `w` (row layout) into `qs`, `scale` and `offset` (its arrays' lengths).
pub fn pack_q4(
    w: Q4Weights<'_>,
    qs: &mut [u8],
    scale: &mut [f32],
    offset: &mut [f32],
) -> Result<(), ShapeError> {
    if w.packed || w.k == 0 || !w.k.is_multiple_of(BLOCK) || !w.n.is_multiple_of(PACK) {
        return Err(ShapeError(format!(
            "packs a row-layout [{}, {}] matrix whose columns are a multiple of {PACK} and rows \
             of {BLOCK}",
            w.n, w.k
        )));
    }
    let blocks = w.k / BLOCK;
    for (name, have, want) in [
        ("qs", w.qs.len(), w.n * w.k / 2),
        ("scale", w.scale.len(), w.n * blocks),
        ("offset", w.offset.len(), w.n * blocks),
        ("packed qs", qs.len(), w.n * w.k / 2),
        ("packed scale", scale.len(), w.n * blocks),
        ("packed offset", offset.len(), w.n * blocks),
    ] {
        check(name, have, want)?;
    }
    for c in 0..w.n {
        for b in 0..blocks {
            let from = (c * blocks + b) * BLOCK / 2;
            let at = quads_at(blocks, c, b);
            for q in 0..4 {
                let to = at + q * PACK * 4;
                qs[to..to + 4].copy_from_slice(&w.qs[from + 4 * q..from + 4 * q + 4]);
            }
            let v = value_at(blocks, c, b);
            scale[v] = w.scale[c * blocks + b];
            offset[v] = w.offset[c * blocks + b];
        }
    }
    Ok(())
}

/// One chunk's quants, scales and offsets in the row layout, and its rows' outputs.
type Unpacked = (Vec<u8>, Vec<f32>, Vec<f32>, Vec<f32>);

thread_local! {
    static SCRATCH: RefCell<Unpacked> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new())) };
}

/// Output columns `cols` of `rows` rows of `y` (the whole `[rows, w.n]` output) for a packed
/// `w`: `kernel` runs on each group of them unpacked into the row layout, as columns `0..m` of an
/// output of its own, copied into `y` after (as `iq4::expanded_columns` does for IQ4). For the
/// kernels that have no packed path; no kernel's bits depend on its column split.
pub(crate) fn unpacked_columns(
    w: Q4Weights<'_>,
    rows: usize,
    cols: Range<usize>,
    y: &Output,
    kernel: &dyn Fn(Weights<'_>, Range<usize>, &Output),
) {
    SCRATCH.with(|s| {
        let (qs, scale, offset, out) = &mut *s.borrow_mut();
        let (k, blocks) = (w.k, w.k / BLOCK);
        let mut c = cols.start;
        while c < cols.end {
            let m = (PACK - c % PACK).min(cols.end - c);
            qs.resize(m * k / 2, 0);
            scale.resize(m * blocks, 0.0);
            offset.resize(m * blocks, 0.0);
            out.resize(rows * m, 0.0);
            for i in 0..m {
                for b in 0..blocks {
                    let (bytes, s, o) = block(&w, c + i, b);
                    let at = i * blocks + b;
                    qs[at * BLOCK / 2..(at + 1) * BLOCK / 2].copy_from_slice(&bytes);
                    (scale[at], offset[at]) = (s, o);
                }
            }
            let rows_layout = Q4Weights {
                qs: &qs[..m * k / 2],
                scale: &scale[..m * blocks],
                offset: &offset[..m * blocks],
                n: m,
                k,
                packed: false,
            };
            kernel(
                Weights::Q4(rows_layout),
                0..m,
                &Output::new(&mut out[..rows * m]),
            );
            for (r, values) in out[..rows * m].chunks_exact(m).enumerate() {
                y.set_run(r * w.n + c, values);
            }
            c += m;
        }
    });
}
