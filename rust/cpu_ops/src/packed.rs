//! 4-bit and q6 matrices packed once at load into the operand layout of the side-by-side
//! kernels, so no product transposes them per call.
//!
//! Why: `int8/wide.rs` multiplies sixteen columns at once from vectors holding four weights of
//! each column. From the row layout ([`Q4Weights`], [`Q6Weights`]) every call transposed each
//! block of a group into that form first, into a buffer: at eight rows (eight chats decoding)
//! that phase, mostly waiting on the weights' read, was as long as the products on a Llama-1B
//! shape, paid again every step, and one row could not use the kernel at all. Packed, the same
//! bytes lie already in that order, the blocks in the order the kernel walks them, and
//! `int8/wide_packed.rs` (AVX-512 VNNI, q4 and q6) and `int8/side_by_side_packed.rs` (q4, eight
//! columns: AVX2) read a group in place, front to back, for any number of rows.
//!
//! # Layout
//! Columns go in groups of [`PACK`] (a packed matrix has a multiple of it); a group's blocks
//! go lane by lane of `int8`'s combine ([`position`]: `p` below). A block of a column is `Q`
//! quads of 4 bytes (q4: `Q = 4`, its 16 bytes, weights `4q..4q + 4` in the low nibbles of quad
//! `q` and `16 + 4q..` in the high ones; q6: `Q = 8`, its 32 int8 quants); in group `g`, block
//! at `p`, quad `q` of column `i` of the group sits at `qs[(((g * blocks + p) * Q + q) * PACK +
//! i) * 4..][..4]`: each quad of a block is one 64-byte vector of the group's sixteen columns.
//! A value array with `V` values a block (q4's scales, its offsets: `V = 1`; q6's scales, one
//! per half block: `V = 2`) holds the column's value `h` of that block at `[((g * blocks + p) *
//! V + h) * PACK + i]`: each a vector of the sixteen columns.
//!
//! Every other reader (the portable kernel, AVX2's q6 kernel, the f32 path, columns past whole
//! groups) takes a packed matrix through [`unpacked_columns`], a group at a time into the row
//! layout; the embedding lookup reads a block in place ([`q4_block`], [`q6_block`]): the same
//! values, so the same bits.

use std::cell::RefCell;
use std::ops::Range;

use crate::int8::LANES;
use crate::shape::{check, ShapeError};
use crate::threads::Output;
use crate::weights::{Q4Weights, Q6Weights, Weights, BLOCK, Q6_GROUP};

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
/// matrix of `blocks` blocks a column and `quads` quads a block (4 for q4, 8 for q6).
#[inline(always)]
pub(crate) fn quads_at(blocks: usize, c: usize, b: usize, quads: usize) -> usize {
    ((c / PACK * blocks + position(blocks, b)) * quads * PACK + c % PACK) * 4
}

/// Where column `c`'s value `h` of block `b` lies in a packed value array of `per` values a
/// block (q4's scales and its offsets: 1; q6's scales: 2).
#[inline(always)]
pub(crate) fn value_at(blocks: usize, c: usize, b: usize, per: usize, h: usize) -> usize {
    ((c / PACK * blocks + position(blocks, b)) * per + h) * PACK + c % PACK
}

/// Column `c`'s block `b` of a packed 4-bit matrix: its 16 bytes as the row layout holds them,
/// its scale and its offset.
pub(crate) fn q4_block(w: &Q4Weights<'_>, c: usize, b: usize) -> ([u8; BLOCK / 2], f32, f32) {
    let blocks = w.k / BLOCK;
    let mut bytes = [0u8; BLOCK / 2];
    gather(w.qs, quads_at(blocks, c, b, 4), &mut bytes);
    let v = value_at(blocks, c, b, 1, 0);
    (bytes, w.scale[v], w.offset[v])
}

/// Column `c`'s block `b` of a packed q6 matrix: its 32 quants and its two scales.
pub(crate) fn q6_block(w: &Q6Weights<'_>, c: usize, b: usize) -> ([i8; BLOCK], [f32; 2]) {
    let blocks = w.k / BLOCK;
    let mut qs = [0i8; BLOCK];
    gather(w.qs, quads_at(blocks, c, b, 8), &mut qs);
    let scale = [0, 1].map(|h| w.scale[value_at(blocks, c, b, 2, h)]);
    (qs, scale)
}

/// A column's block from its quads, `PACK * 4` apart from `at`.
fn gather<T: Copy>(qs: &[T], at: usize, out: &mut [T]) {
    for (q, quad) in out.chunks_exact_mut(4).enumerate() {
        let from = at + q * PACK * 4;
        quad.copy_from_slice(&qs[from..from + 4]);
    }
}

/// Refuses what cannot be packed: a packed matrix, rows that are not whole blocks, columns
/// that are not whole groups, and arrays of other lengths than `lengths` (name, have, want).
fn packable(
    packed: bool,
    n: usize,
    k: usize,
    lengths: &[(&str, usize, usize)],
) -> Result<(), ShapeError> {
    if packed || k == 0 || !k.is_multiple_of(BLOCK) || !n.is_multiple_of(PACK) {
        return Err(ShapeError(format!(
            "packs a row-layout [{n}, {k}] matrix whose columns are a multiple of {PACK} and rows \
             of {BLOCK}"
        )));
    }
    for &(name, have, want) in lengths {
        check(name, have, want)?;
    }
    Ok(())
}

/// Every column's blocks of `quads` quads from the row layout `src` into the packed `dst`.
fn pack_quads<T: Copy>(src: &[T], dst: &mut [T], n: usize, blocks: usize, quads: usize) {
    for c in 0..n {
        for b in 0..blocks {
            let (from, at) = ((c * blocks + b) * quads * 4, quads_at(blocks, c, b, quads));
            for q in 0..quads {
                let to = at + q * PACK * 4;
                dst[to..to + 4].copy_from_slice(&src[from + 4 * q..from + 4 * q + 4]);
            }
        }
    }
}

/// Every column's `per` values a block from the row layout `src` into the packed `dst`.
fn pack_values(src: &[f32], dst: &mut [f32], n: usize, blocks: usize, per: usize) {
    for c in 0..n {
        for b in 0..blocks {
            for h in 0..per {
                dst[value_at(blocks, c, b, per, h)] = src[(c * blocks + b) * per + h];
            }
        }
    }
}

/// Packs the 4-bit `w` (row layout) into `qs`, `scale` and `offset` (its arrays' lengths).
pub fn pack_q4(
    w: Q4Weights<'_>,
    qs: &mut [u8],
    scale: &mut [f32],
    offset: &mut [f32],
) -> Result<(), ShapeError> {
    let blocks = w.n * w.k / BLOCK;
    packable(
        w.packed,
        w.n,
        w.k,
        &[
            ("qs", w.qs.len(), w.n * w.k / 2),
            ("scale", w.scale.len(), blocks),
            ("offset", w.offset.len(), blocks),
            ("packed qs", qs.len(), w.n * w.k / 2),
            ("packed scale", scale.len(), blocks),
            ("packed offset", offset.len(), blocks),
        ],
    )?;
    let blocks = w.k / BLOCK;
    pack_quads(w.qs, qs, w.n, blocks, 4);
    pack_values(w.scale, scale, w.n, blocks, 1);
    pack_values(w.offset, offset, w.n, blocks, 1);
    Ok(())
}

/// Packs the q6 `w` (row layout) into `qs` and `scale` (its arrays' lengths).
pub fn pack_q6(w: Q6Weights<'_>, qs: &mut [i8], scale: &mut [f32]) -> Result<(), ShapeError> {
    packable(
        w.packed,
        w.n,
        w.k,
        &[
            ("qs", w.qs.len(), w.n * w.k),
            ("scale", w.scale.len(), w.n * w.k / Q6_GROUP),
            ("packed qs", qs.len(), w.n * w.k),
            ("packed scale", scale.len(), w.n * w.k / Q6_GROUP),
        ],
    )?;
    let blocks = w.k / BLOCK;
    pack_quads(w.qs, qs, w.n, blocks, 8);
    pack_values(w.scale, scale, w.n, blocks, 2);
    Ok(())
}

/// One chunk's quants, scales and offsets in the row layout, and its rows' outputs.
type Unpacked = (Vec<u8>, Vec<f32>, Vec<f32>, Vec<f32>);

thread_local! {
    static SCRATCH: RefCell<Unpacked> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new())) };
}

/// Output columns `cols` of `rows` rows of `y` (the whole `[rows, w.n]` output) for a packed
/// `w` (4-bit or q6): `kernel` runs on each group of them unpacked into the row layout, as
/// columns `0..m` of an output of its own, copied into `y` after (as `iq4::expanded_columns`
/// does for IQ4). For the kernels that have no packed path; no kernel's bits depend on its
/// column split.
pub(crate) fn unpacked_columns(
    w: Weights<'_>,
    rows: usize,
    cols: Range<usize>,
    y: &Output,
    kernel: &dyn Fn(Weights<'_>, Range<usize>, &Output),
) {
    SCRATCH.with(|s| {
        let (qs, scale, offset, out) = &mut *s.borrow_mut();
        let (n, k, blocks) = (w.n(), w.k(), w.k() / BLOCK);
        let mut c = cols.start;
        while c < cols.end {
            let m = (PACK - c % PACK).min(cols.end - c);
            out.resize(rows * m, 0.0);
            let part = match w {
                Weights::Q4(w) => {
                    qs.resize(m * k / 2, 0);
                    scale.resize(m * blocks, 0.0);
                    offset.resize(m * blocks, 0.0);
                    for i in 0..m {
                        for b in 0..blocks {
                            let (bytes, s, o) = q4_block(&w, c + i, b);
                            let at = i * blocks + b;
                            qs[at * BLOCK / 2..(at + 1) * BLOCK / 2].copy_from_slice(&bytes);
                            (scale[at], offset[at]) = (s, o);
                        }
                    }
                    Weights::Q4(Q4Weights {
                        qs: &qs[..m * k / 2],
                        scale: &scale[..m * blocks],
                        offset: &offset[..m * blocks],
                        n: m,
                        k,
                        packed: false,
                    })
                }
                Weights::Q6(w) => {
                    qs.resize(m * k, 0);
                    scale.resize(m * 2 * blocks, 0.0);
                    for i in 0..m {
                        for b in 0..blocks {
                            let (q, s) = q6_block(&w, c + i, b);
                            let at = i * blocks + b;
                            for (to, q) in qs[at * BLOCK..(at + 1) * BLOCK].iter_mut().zip(q) {
                                *to = q as u8;
                            }
                            scale[2 * at..2 * at + 2].copy_from_slice(&s);
                        }
                    }
                    // SAFETY: u8 and i8 have the same size and alignment, and every bit
                    // pattern is valid for both; the view ends before `qs` is touched again.
                    let signed =
                        unsafe { std::slice::from_raw_parts(qs.as_ptr().cast::<i8>(), m * k) };
                    Weights::Q6(Q6Weights {
                        qs: signed,
                        scale: &scale[..m * 2 * blocks],
                        n: m,
                        k,
                        low: w.low, // the same values
                        packed: false,
                    })
                }
                _ => unreachable!("only q4 and q6 matrices are packed"),
            };
            kernel(part, 0..m, &Output::new(&mut out[..rows * m]));
            for (r, values) in out[..rows * m].chunks_exact(m).enumerate() {
                y.set_run(r * n + c, values);
            }
            c += m;
        }
    });
}
