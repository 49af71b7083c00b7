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
//! go lane by lane of `int8`'s combine (`position`: `p` below).
//!
//! q4: a block of a column is 4 quads of 4 bytes (its 16 bytes, weights `4q..4q + 4` in the
//! low nibbles of quad `q` and `16 + 4q..` in the high ones); in group `g`, block at `p`, quad
//! `q` of column `i` of the group sits at `qs[(((g * blocks + p) * 4 + q) * PACK + i) * 4..]
//! [..4]`: each quad of a block is one 64-byte vector of the group's sixteen columns. Its scale
//! and its offset lie at `[(g * blocks + p) * PACK + i]`: each a vector of the sixteen columns.
//!
//! q6 is packed compact, as the file holds it (6.5 bits a weight where the row layout takes
//! 10: a byte a quant and two f32 scales a block): its quants `q` in -32..32 as `u = q + 32`
//! in 0..64, six bits, and each scale as an int8 `sc` times an f32 `d` per column and run of
//! [`SUPER`] blocks (Q6_K's and Q3_K's own form, found again at packing: `int8_scales`).
//! A group's block at `p` is [`Q6_BLOCK_BYTES`] bytes from `qs[(g * blocks + p) * 416..]`;
//! with `u_t` the quad of weights `4t..4t + 4` of column `i` (byte `e` its weight `4t + e`):
//! - bytes `64 j + 4 i + e`, `j` in 0..4: `u_j`'s low four bits, `u_{j+4}`'s in the high nibble;
//! - bytes `256 + 64 j + 4 i + e`, `j` in 0..2: bits `2m, 2m + 1` hold `u_{j+2m} >> 4`, `m` in
//!   0..4;
//! - bytes `384 + 16 h + i`: the int8 `sc` of half `h` (weights `16h..16h + 16`).
//!
//! Column `i`'s `d` for block `b` lies at `scale[(g * supers + b / SUPER) * PACK + i]`
//! (`supers = ⌈blocks / SUPER⌉`), and its scale is `d * sc` (f32, exact: the row layout's value,
//! bit for bit).
//!
//! Every other reader (the portable kernel, the f32 path, columns past whole groups) takes a packed matrix through `unpacked_columns`, a group at a time into the row
//! layout; the embedding lookup reads a block in place (`q4_block`, `q6_block`): the same
//! values, so the same bits.

use std::cell::RefCell;
use std::ops::Range;

use crate::int8::LANES;
use crate::shape::{check, ShapeError};
use crate::threads::Output;
use crate::weights::{Q4Weights, Q6Weights, Q8Packing, Q8Weights, Weights, BLOCK, Q6_GROUP};

/// Columns per group of a packed matrix: the sixteen lanes of a 512-bit vector.
pub const PACK: usize = 16;

/// Blocks of a column that share one `d` in a packed q6 matrix: a K-quant super-block.
pub const SUPER: usize = 8;

/// Bytes of a packed q6 group's block: sixteen columns' 32 six-bit quants and two int8 scales.
pub const Q6_BLOCK_BYTES: usize = 26 * PACK;

/// What a packed q6 quant adds to `q` (in -32..32) to store it as six unsigned bits.
pub const Q6_BIAS: i8 = 32;

/// The lengths of a packed q6 matrix's quants (bytes) and `d` values, for `n` columns of `k`.
pub fn q6_packed_lengths(n: usize, k: usize) -> (usize, usize) {
    let blocks = k / BLOCK;
    (
        n * blocks * Q6_BLOCK_BYTES / PACK,
        n * blocks.div_ceil(SUPER),
    )
}

/// Where the packed q6 group holding column `c` has its block `b`.
#[inline(always)]
pub(crate) fn q6_at(blocks: usize, c: usize, b: usize) -> usize {
    (c / PACK * blocks + position(blocks, b)) * Q6_BLOCK_BYTES
}

/// Where column `c`'s value for block `b` lies in an array of one value a column and run of
/// [`SUPER`] blocks (a packed q6 matrix's `d`, a packed q5 one's `d` and `dmin`).
#[inline(always)]
pub(crate) fn super_at(blocks: usize, c: usize, b: usize) -> usize {
    (c / PACK * blocks.div_ceil(SUPER) + b / SUPER) * PACK + c % PACK
}

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

/// Column `c`'s block `b` of a packed q6 matrix: its 32 quants and its two scales, as the row
/// layout holds them.
pub(crate) fn q6_block(w: &Q6Weights<'_>, c: usize, b: usize) -> ([i8; BLOCK], [f32; 2]) {
    let blocks = w.k / BLOCK;
    let at = q6_at(blocks, c, b);
    let bytes = |o: usize| w.qs[at + o] as u8;
    let i = c % PACK;
    let mut qs = [0i8; BLOCK];
    for (t, quad) in qs.chunks_exact_mut(4).enumerate() {
        for (e, q) in quad.iter_mut().enumerate() {
            let low = bytes(64 * (t % 4) + 4 * i + e) >> (4 * (t / 4)) & 0x0f;
            let high = bytes(256 + 64 * (t % 2) + 4 * i + e) >> (2 * (t / 2)) & 0x03;
            *q = (low | high << 4) as i8 - Q6_BIAS;
        }
    }
    let d = w.scale[super_at(blocks, c, b)];
    let scale = [0, 1].map(|h| d * f32::from(bytes(384 + 16 * h + i) as i8));
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
pub(crate) fn packable(
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

/// Packs the q6 `w` (row layout) into `qs` and `scale` (the lengths of
/// [`q6_packed_lengths`]): refused where a quant lies outside -32..32 or a column's run of
/// [`SUPER`] blocks has scales that are not one f32 times int8s (not Q6_K's or Q3_K's).
pub fn pack_q6(w: Q6Weights<'_>, qs: &mut [i8], scale: &mut [f32]) -> Result<(), ShapeError> {
    let (qs_len, d_len) = q6_packed_lengths(w.n, w.k);
    packable(
        w.packed,
        w.n,
        w.k,
        &[
            ("qs", w.qs.len(), w.n * w.k),
            ("scale", w.scale.len(), w.n * w.k / Q6_GROUP),
            ("packed qs", qs.len(), qs_len),
            ("packed scale", scale.len(), d_len),
        ],
    )?;
    if let Some(q) = w.qs.iter().find(|q| !(-Q6_BIAS..Q6_BIAS).contains(*q)) {
        return Err(ShapeError(format!(
            "packs q6 quants in -32..32 only, not {q}"
        )));
    }
    let blocks = w.k / BLOCK;
    for c in 0..w.n {
        for (s, run) in w.scale[c * blocks * 2..(c + 1) * blocks * 2]
            .chunks(2 * SUPER)
            .enumerate()
        {
            let mut sc = [0i8; 2 * SUPER];
            let d = int8_scales(run, &mut sc[..run.len()]).ok_or_else(|| {
                ShapeError(format!(
                    "column {c}'s q6 scales {run:?} are not one f32 times int8s"
                ))
            })?;
            scale[super_at(blocks, c, s * SUPER)] = d;
            for (j, sc) in sc[..run.len()].iter().enumerate() {
                let (b, h) = (s * SUPER + j / 2, j % 2);
                qs[q6_at(blocks, c, b) + 384 + 16 * h + c % PACK] = *sc;
            }
        }
        for b in 0..blocks {
            let (at, i) = (q6_at(blocks, c, b), c % PACK);
            let u =
                |t: usize, e: usize| (w.qs[(c * blocks + b) * BLOCK + 4 * t + e] + Q6_BIAS) as u8;
            for e in 0..4 {
                for j in 0..4 {
                    let byte = u(j, e) & 0x0f | (u(j + 4, e) & 0x0f) << 4;
                    qs[at + 64 * j + 4 * i + e] = byte as i8;
                }
                for j in 0..2 {
                    let byte = (0..4).fold(0u8, |acc, m| acc | (u(j + 2 * m, e) >> 4) << (2 * m));
                    qs[at + 256 + 64 * j + 4 * i + e] = byte as i8;
                }
            }
        }
    }
    Ok(())
}

/// An f32 `d` and int8s `sc` with `d * sc[j]` equal to `values[j]`, bit for bit, if there are:
/// K-quant scales are `d * sc` with the largest `|sc|` 127 or 128 (their quantiser's) or less,
/// so `d` is the value of largest magnitude over its own `sc`, tried from the largest.
pub(crate) fn int8_scales(values: &[f32], sc: &mut [i8]) -> Option<f32> {
    let fits = |d: f32, sc: &mut [i8]| {
        values.iter().zip(sc.iter_mut()).all(|(v, sc)| {
            let t = (v / d).round();
            *sc = t.clamp(-128.0, 127.0) as i8;
            (-128.0..=127.0).contains(&t) && (d * f32::from(*sc)).to_bits() == v.to_bits()
        })
    };
    if values.iter().all(|v| *v == 0.0) {
        // d = 0: a -0.0 scale is 0 times -1
        for (v, sc) in values.iter().zip(sc.iter_mut()) {
            *sc = if v.is_sign_negative() { -1 } else { 0 };
        }
        return Some(0.0);
    }
    let top = values
        .iter()
        .copied()
        .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    (1..=128)
        .rev()
        .flat_map(|s: i16| [s, -s])
        .filter(|s| *s != 128)
        .map(|s| top / f32::from(s))
        .find(|d| d.is_finite() && *d != 0.0 && fits(*d, sc))
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
                        low: Some(-crate::packed::Q6_BIAS), // every quant in -32..32
                        packed: false,
                    })
                }
                Weights::Q8(w) => {
                    qs.resize(m * k, 0);
                    scale.resize(m * blocks, 0.0);
                    offset.resize(m * blocks, 0.0);
                    for i in 0..m {
                        for b in 0..blocks {
                            let (q, s, o) = crate::packed_q5::either_block(&w, c + i, b);
                            let at = i * blocks + b;
                            for (to, q) in qs[at * BLOCK..(at + 1) * BLOCK].iter_mut().zip(q) {
                                *to = q as u8;
                            }
                            (scale[at], offset[at]) = (s, o);
                        }
                    }
                    // SAFETY: as for q6 above.
                    let signed =
                        unsafe { std::slice::from_raw_parts(qs.as_ptr().cast::<i8>(), m * k) };
                    Weights::Q8(Q8Weights {
                        qs: signed,
                        scale: &scale[..m * blocks],
                        offset: w.offset.map(|_| &offset[..m * blocks]),
                        n: m,
                        k,
                        low: w.low, // every quant in low..low + 32
                        packed: Q8Packing::Rows,
                    })
                }
                _ => unreachable!("only q4, q6 and q5 (q8 blocks) matrices are packed"),
            };
            kernel(part, 0..m, &Output::new(&mut out[..rows * m]));
            for (r, values) in out[..rows * m].chunks_exact(m).enumerate() {
                y.set_run(r * n + c, values);
            }
            c += m;
        }
    });
}
