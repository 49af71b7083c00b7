//! AVX2's kernel for q6 and q5 matrices packed compact at load (`crate::packed`,
//! `crate::packed_q5`, `crate::packed_q5_blocks`; `wide_avx2.rs`'s narrow kinds' arithmetic),
//! for any number of rows: each tile reads its half of the packed group in place, widening the
//! six or five bits of a quant.
//!
//! Why: as `side_by_side_packed.rs` for 4-bit weights. From the row layout every call of two
//! rows or more transposed each block of eight columns into a buffer (eight loads, an 8 x 8
//! transposition, eight gathers of scales) while it waited on the weights' read, and one row took
//! `q6.rs`, a horizontal reduction per (block, column). Packed, a block's operand vectors are the
//! group's eight-column half of each 64-byte vector (q6: `q + 32`'s nibble and top bits; q5:
//! `q - low`'s nibble and fifth bit), its scales (and offsets) int8s times a `d` per 256 weights
//! (Q5_0's, Q5_1's: an f32 a block), in the order the tiles walk them; one row ([`one_row`])
//! takes a group of sixteen at once; 16 rows or more widen each block once into a buffer
//! ([`split`]; Q5_0's and Q5_1's of short rows into `wide_avx2.rs`'s tiles: [`NARROW_BLOCKS`]).
//! The sums are exact and the float operations `wide_avx2.rs`'s for the narrow kinds in their
//! order, so the bits are `plain.rs`'s (the tests check it).

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::side_by_side::{store_row, GROUP};
use super::wide_avx2::{self, Block8};
use super::{Activations, LANES};
use crate::packed::{position, value_at};
use crate::packed::{q6_at, q6_packed_lengths, super_at, PACK, Q6_BIAS, Q6_BLOCK_BYTES, SUPER};
use crate::packed_q5::{q5_at, q5_packed_lengths, Q5_BLOCK_BYTES};
use crate::packed_q5_blocks::{q5b_at, q5b_packed_lengths, Q5B_BLOCK_BYTES};
use crate::threads::Output;
use crate::weights::{Q8Packing, Weights, BLOCK};

/// Rows multiplied together against each block's operand vectors (as `wide_avx2.rs`).
const TILE: usize = 4;

/// Bytes ahead of the block being read whose lines the first tile asks for.
const AHEAD: usize = 4096;

/// The kinds, as constants of `tile`: q6 (two scales a block, each half corrected by `-32 Σ q`)
/// and q5 (Q5_K's q8 blocks: one sum, a scale and an offset).
const Q6: u8 = 0;
const Q5: u8 = 1;
/// Q5_0's and Q5_1's q8 blocks (`crate::packed_q5_blocks`): Q5's five bits, a scale a block (and
/// for Q5_1 an offset) read as they lie, the sum `Σ u q + low Σ q` as `wide_avx2.rs`'s narrow
/// kinds correct theirs: the same bits.
const Q5_BLOCKS: u8 = 2;
const Q5_BLOCKS_OFFSET: u8 = 3;

/// Whether the kernels here read `w`: a packed q6 or q5 matrix (every one packed is).
pub(super) fn takes(w: &Weights<'_>) -> bool {
    matches!(w, Weights::Q6(_) | Weights::Q8(_)) && w.packed()
}

/// Output columns `c0..c0 + GROUP` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX2 and FMA; [`takes`] holds, `c0` is a multiple of [`GROUP`] and `c0 + GROUP
/// <= w.n()`; `a` was quantised for `w`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Weights<'_>, c0: usize, y: &Output) {
    match q5_kind(&w) {
        Q5 => kind_group::<Q5>(a, w, c0, y),
        Q5_BLOCKS => kind_group::<Q5_BLOCKS>(a, w, c0, y),
        Q5_BLOCKS_OFFSET => kind_group::<Q5_BLOCKS_OFFSET>(a, w, c0, y),
        _ => kind_group::<Q6>(a, w, c0, y),
    }
}

/// `w`'s kind constant.
fn q5_kind(w: &Weights<'_>) -> u8 {
    match w {
        Weights::Q8(w) if w.packed == Q8Packing::Q5Blocks && w.offset.is_some() => Q5_BLOCKS_OFFSET,
        Weights::Q8(w) if w.packed == Q8Packing::Q5Blocks => Q5_BLOCKS,
        Weights::Q8(_) => Q5,
        _ => Q6,
    }
}

#[inline(always)]
unsafe fn kind_group<const K: u8>(a: &Activations<'_>, w: Weights<'_>, c0: usize, y: &Output) {
    let mut g = Packed::new(a, &w, c0, GROUP);
    let q5_blocks = K == Q5_BLOCKS || K == Q5_BLOCKS_OFFSET;
    if a.rows >= SPLIT_ROWS && q5_blocks && g.blocks <= NARROW_BLOCKS {
        // Q5_0, Q5_1: split into `wide_avx2.rs`'s narrow operands and run its tiles, whose four
        // rows keep their sums in registers (this file's spill them)
        let mut buffer = NARROW.take();
        split_narrow::<K>(&g, &mut buffer);
        let offset = K == Q5_BLOCKS_OFFSET;
        wide_avx2::narrow_tiles(a, &buffer[..g.blocks], y, w.n(), c0, g.low, offset);
        NARROW.set(buffer);
        return;
    }
    if a.rows >= SPLIT_ROWS {
        // the buffer taken out of its cell, not borrowed in a closure: a closure does not
        // inherit the caller's target features, and the tiles inlined in it ran their
        // intrinsics as calls (a prefill 20x slower)
        let mut buffer = SPLIT.take();
        split::<K>(&g, &mut buffer);
        g.split = buffer.as_ptr();
        tiles::<K, true>(a, &g, y, w.n(), c0);
        SPLIT.set(buffer);
        return;
    }
    tiles::<K, false>(a, &g, y, w.n(), c0)
}

/// Every row of `a`, a tile at a time, against the half `g` (from its split buffer: `S`).
#[inline(always)]
unsafe fn tiles<const K: u8, const S: bool>(
    a: &Activations<'_>,
    g: &Packed,
    y: &Output,
    n: usize,
    c0: usize,
) {
    let mut r0 = 0;
    while r0 < a.rows {
        let left = a.rows - r0;
        match left {
            1 => tile::<1, 1, K, S>(a, g, r0, y, n, c0),
            2 => tile::<2, 1, K, S>(a, g, r0, y, n, c0),
            3 => tile::<3, 1, K, S>(a, g, r0, y, n, c0),
            _ => tile::<TILE, 1, K, S>(a, g, r0, y, n, c0),
        }
        r0 += left.min(TILE);
    }
}

/// Blocks a column up to which Q5_0's and Q5_1's prompt chunks run on `wide_avx2.rs`'s narrow
/// tiles (a buffer of 608 bytes a block, in L1 up to here), beyond it on this file's split
/// tiles. Measured on 448 rows, two threads: at k = 576 the narrow tiles took a SmolLM2 Q4_K_M
/// prefill from 893-900 to 993-1,007 tok/s; at 2048 the two were even, at 8192 the narrow ones
/// 3-5 % slower; Q5_K's (whose combine here has no `low` to add) lost 11 % on them at 2048-8192.
const NARROW_BLOCKS: usize = 64;

/// Rows from which a call widens each block of its half once into a buffer ([`split`]) and runs
/// its tiles there, rather than again in every tile of four rows: a 448-token prefill of the
/// Llama-1B-shaped Q6_K lost 4-17 % to the repeated widening.
const SPLIT_ROWS: usize = 16;

/// One block of a half, widened: its eight quad vectors (q6: `q + 32`; q5: `q`) and two value
/// vectors (q6: its two scales; q5: its scale and its offset).
#[repr(C, align(32))]
#[derive(Clone, Copy)]
struct Split {
    quads: [__m256i; 8],
    values: [__m256; 2],
}

thread_local! {
    /// The widened half, reused by every call of many rows on this thread.
    static SPLIT: RefCell<Vec<Split>> = const { RefCell::new(Vec::new()) };
    /// A q5 half as `wide_avx2.rs`'s narrow operands, likewise.
    static NARROW: RefCell<Vec<Block8>> = const { RefCell::new(Vec::new()) };
}

/// Every block of the Q5_0 or Q5_1 half `g`, by block, as `wide_avx2.rs`'s narrow operands
/// (quads `q - low` as u8; its scale and offset) into `buffer`.
#[inline(always)]
unsafe fn split_narrow<const K: u8>(g: &Packed, buffer: &mut Vec<Block8>) {
    if buffer.len() < g.blocks {
        // SAFETY: every field is plain SIMD data, for which all-zero bits are valid.
        buffer.resize(g.blocks, std::mem::zeroed());
    }
    let part = g.half / GROUP;
    for (b, out) in buffer.iter_mut().enumerate().take(g.blocks) {
        let p = position(g.blocks, b);
        let src = g.qs.add(p * g.bytes);
        for t in 0..8 {
            out.pairs[t] = quad::<K>(src.add(32 * part), t);
        }
        out.scale[0] = value::<K>(g, src, b, p, 0, part);
        out.offset = value::<K>(g, src, b, p, 1, part); // Q5_0's: the scale, never read
    }
}

/// Every block of the half `g`, in its position's order, widened into `buffer`.
#[inline(always)]
unsafe fn split<const K: u8>(g: &Packed, buffer: &mut Vec<Split>) {
    if buffer.len() < g.blocks {
        // SAFETY: every field is plain SIMD data, for which all-zero bits are valid.
        buffer.resize(g.blocks, std::mem::zeroed());
    }
    let (per_lane, longer) = (g.blocks / LANES, g.blocks % LANES);
    let mut p = 0;
    for l in 0..LANES {
        for j in 0..per_lane + usize::from(l < longer) {
            let b = l + j * LANES;
            let src = g.qs.add(p * g.bytes);
            let out = &mut buffer[p];
            for t in 0..8 {
                out.quads[t] = quad::<K>(src.add(32 * (g.half / GROUP)), t);
            }
            for v in 0..2 {
                out.values[v] = value::<K>(g, src, b, p, v, g.half / GROUP);
            }
            p += 1;
        }
    }
}

/// One row against a whole packed group of sixteen columns, both halves at once.
///
/// # Safety
/// As [`group`], with `a.rows == 1`, `c0` a multiple of [`PACK`] and `c0 + PACK <= w.n()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn one_row(a: &Activations<'_>, w: Weights<'_>, c0: usize, y: &Output) {
    assert!(a.rows == 1 && c0.is_multiple_of(PACK));
    let g = Packed::new(a, &w, c0, PACK);
    match q5_kind(&w) {
        Q5 => tile::<1, 2, Q5, false>(a, &g, 0, y, w.n(), c0),
        Q5_BLOCKS => tile::<1, 2, Q5_BLOCKS, false>(a, &g, 0, y, w.n(), c0),
        Q5_BLOCKS_OFFSET => tile::<1, 2, Q5_BLOCKS_OFFSET, false>(a, &g, 0, y, w.n(), c0),
        _ => tile::<1, 2, Q6, false>(a, &g, 0, y, w.n(), c0),
    }
}

/// Columns `c0..` of a packed group: their blocks (the block at position `p` at `qs + p *
/// bytes`, the second half of a group's columns 32 bytes on in each vector, 8 in each run of
/// int8 values) and their per-256 values (block `b`'s `d` at `d + b / SUPER * PACK`, q5's
/// `dmin` at `dmin + ..`), or for Q5_0 and Q5_1 their values a block (the block at `p`'s scale
/// at `d + p * PACK`, its offset at `dmin + ..`; null without) and the `low` of their quants.
struct Packed {
    qs: *const u8,
    bytes: usize,
    d: *const f32,
    dmin: *const f32,
    low: i8,
    blocks: usize,
    /// The half's column in its group: 0 or 8.
    half: usize,
    /// Whether this tile's first rows ask for the lines ahead (a second half finds them in
    /// cache, read by the first).
    ahead: bool,
    /// The half's blocks widened ([`split`]) for a call of many rows, else null.
    split: *const Split,
}

impl Packed {
    /// Checks the call and finds columns `c0..c0 + width` of `w`.
    #[inline(always)]
    unsafe fn new(a: &Activations<'_>, w: &Weights<'_>, c0: usize, width: usize) -> Packed {
        let (n, blocks) = (w.n(), a.k / BLOCK);
        assert!(takes(w) && c0.is_multiple_of(GROUP) && c0 + width <= n && a.k == w.k());
        assert!(a.padded.is_multiple_of(LANES) && a.q.len() == a.rows * a.k);
        assert!(a.d.len().min(a.sum.len()) == a.rows * a.padded);
        assert!(a.lo.len().min(a.hi.len()) == a.rows * a.padded);
        let start = c0 - c0 % PACK;
        // the group's per-256 values (q6, Q5_K) or its values a block (Q5_0, Q5_1)
        let (runs, per_block) = (super_at(blocks, start, 0), value_at(blocks, start, 0, 1, 0));
        let mut low = 0;
        let (qs, bytes, d, dmin) = match w {
            Weights::Q6(w) => {
                assert!((w.qs.len(), w.scale.len()) == q6_packed_lengths(n, w.k));
                let qs = w.qs.as_ptr().cast::<u8>().add(q6_at(blocks, start, 0));
                let d = w.scale.as_ptr().add(runs);
                (qs, Q6_BLOCK_BYTES, d, std::ptr::null())
            }
            Weights::Q8(w) if w.packed == Q8Packing::Q5Blocks => {
                let (qs, values) = q5b_packed_lengths(n, w.k);
                assert!(w.qs.len() == qs && w.scale.len() == values);
                assert!(w.offset.is_none_or(|o| o.len() == values));
                low = w.low.expect("a packed q5 matrix has its low");
                let qs = w.qs.as_ptr().cast::<u8>().add(q5b_at(blocks, start, 0));
                let dmin = w
                    .offset
                    .map_or(std::ptr::null(), |o| o.as_ptr().add(per_block));
                (qs, Q5B_BLOCK_BYTES, w.scale.as_ptr().add(per_block), dmin)
            }
            Weights::Q8(w) => {
                let dmin = w.offset.expect("a packed q5 matrix has offsets");
                let (qs, d) = q5_packed_lengths(n, w.k);
                assert!(w.qs.len() == qs && w.scale.len() == d && dmin.len() == d);
                let qs = w.qs.as_ptr().cast::<u8>().add(q5_at(blocks, start, 0));
                let d = w.scale.as_ptr().add(runs);
                (qs, Q5_BLOCK_BYTES, d, dmin.as_ptr().add(runs))
            }
            _ => unreachable!("`takes` holds"),
        };
        Packed {
            qs,
            bytes,
            d,
            dmin,
            low,
            blocks,
            half: c0 % PACK,
            ahead: c0.is_multiple_of(PACK),
            split: std::ptr::null(),
        }
    }
}

/// Rows `r0..r0 + R` against `H` halves of the group `g` (eight columns each; read from its
/// split buffer where `S`, with `H == 1`), lane by lane of `int8`'s combine, as `wide_avx2::tile`
/// does for the narrow kinds. q6: per half block (weights 0..16, then 16..32) two i16 sums of two
/// `vpmaddubsw` widened by `vpmaddwd` and added, corrected by `-32` times the activations' half
/// sum, then combined with its scale. q5: per half block one i16 sum of four `vpmaddubsw` (at
/// most 8 · 31 · 127 a lane) widened and added, then the block's sum combined with its scale and
/// its offset.
#[inline(always)]
unsafe fn tile<const R: usize, const H: usize, const K: u8, const S: bool>(
    a: &Activations<'_>,
    g: &Packed,
    r0: usize,
    y: &Output,
    n: usize,
    c0: usize,
) {
    let xq: [*const i8; R] = std::array::from_fn(|i| a.q.as_ptr().add((r0 + i) * a.k));
    let row: [usize; R] = std::array::from_fn(|i| (r0 + i) * a.padded);
    let bias = _mm256_set1_ps(-f32::from(Q6_BIAS));
    let low = _mm256_set1_ps(f32::from(g.low));
    let ones = _mm256_set1_epi16(1);
    let (per_lane, longer) = (g.blocks / LANES, g.blocks % LANES);
    // q6 sums two pairs in i16 before each widening, q5 four
    let run = if K == Q6 { 2 } else { 4 };
    let mut p = 0; // the block's position in the group
                   // every lane is written below before it is read (zeroed first, it was a `memset` a tile)
    let mut acc = [[[std::mem::MaybeUninit::<__m256>::uninit(); LANES]; H]; R];
    #[allow(clippy::needless_range_loop)] // `l` picks both the blocks and the accumulators
    for l in 0..LANES {
        let mut lane = [[_mm256_setzero_ps(); H]; R];
        for j in 0..per_lane + usize::from(l < longer) {
            let b = l + j * LANES;
            let src = g.qs.add(p * g.bytes);
            if r0 == 0 && g.ahead && !S {
                let ahead = src.wrapping_add(AHEAD);
                for line in 0..g.bytes.div_ceil(64) {
                    _mm_prefetch(ahead.wrapping_add(64 * line).cast(), _MM_HINT_T0);
                }
            }
            // plain loops, not closures: a closure does not inherit this function's target
            // features, and its intrinsics would become calls
            let mut block = [[_mm256_setzero_si256(); H]; R]; // q5: the block's sum
            for half in 0..2 {
                let mut sums = [[_mm256_setzero_si256(); H]; R];
                for part in 0..4 / run {
                    let mut pairs = [[_mm256_setzero_si256(); H]; R];
                    for u in 0..run {
                        let t = 4 * half + run * part + u;
                        let mut w = [_mm256_setzero_si256(); H];
                        for (h, w) in w.iter_mut().enumerate() {
                            *w = if S {
                                (*g.split.add(p)).quads[t]
                            } else {
                                quad::<K>(src.add(32 * (g.half / GROUP + h)), t)
                            };
                        }
                        for i in 0..R {
                            let x = (xq[i].add(b * BLOCK + 4 * t) as *const i32).read_unaligned();
                            let x = _mm256_set1_epi32(x);
                            for h in 0..H {
                                let prod = _mm256_maddubs_epi16(w[h], x);
                                pairs[i][h] = if u == 0 {
                                    prod
                                } else {
                                    _mm256_add_epi16(pairs[i][h], prod)
                                };
                            }
                        }
                    }
                    // q5 adds into the block's sum at once: a second sum a row would spill
                    // the tile's registers
                    for i in 0..R {
                        for h in 0..H {
                            let wide = _mm256_madd_epi16(pairs[i][h], ones);
                            if K == Q6 {
                                sums[i][h] = _mm256_add_epi32(sums[i][h], wide);
                            } else {
                                block[i][h] = _mm256_add_epi32(block[i][h], wide);
                            }
                        }
                    }
                }
                if K != Q6 {
                    continue;
                }
                let half_sums = if half == 0 { a.lo } else { a.hi };
                for i in 0..R {
                    let q_sum = _mm256_set1_ps(*half_sums.as_ptr().add(row[i] + b));
                    let row_d = _mm256_set1_ps(*a.d.as_ptr().add(row[i] + b));
                    for h in 0..H {
                        let isum = _mm256_fmadd_ps(bias, q_sum, _mm256_cvtepi32_ps(sums[i][h]));
                        let s = if S {
                            (*g.split.add(p)).values[half]
                        } else {
                            value::<K>(g, src, b, p, half, g.half / GROUP + h)
                        };
                        lane[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, row_d), isum, lane[i][h]);
                    }
                }
            }
            if K != Q6 {
                for i in 0..R {
                    let row_d = _mm256_set1_ps(*a.d.as_ptr().add(row[i] + b));
                    let sum = _mm256_set1_ps(*a.sum.as_ptr().add(row[i] + b));
                    for h in 0..H {
                        let (s, o) = if S {
                            let v = (*g.split.add(p)).values;
                            (v[0], v[1])
                        } else {
                            let part = g.half / GROUP + h;
                            (
                                value::<K>(g, src, b, p, 0, part),
                                value::<K>(g, src, b, p, 1, part),
                            )
                        };
                        let mut isum = _mm256_cvtepi32_ps(block[i][h]);
                        if K != Q5 {
                            isum = _mm256_fmadd_ps(low, sum, isum); // Σ q x, exact
                        }
                        lane[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, row_d), isum, lane[i][h]);
                        if K != Q5_BLOCKS {
                            lane[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(o, row_d), sum, lane[i][h]);
                        }
                    }
                }
            }
            p += 1;
        }
        for i in 0..R {
            for h in 0..H {
                acc[i][h][l] = std::mem::MaybeUninit::new(lane[i][h]);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (h, acc) in acc.iter().enumerate() {
            // SAFETY: the loop above wrote lane `l` of every (row, half) for each `l`.
            store_row(
                &acc.map(|v| v.assume_init()),
                y,
                (r0 + i) * n + c0 + GROUP * h,
            );
        }
    }
}

/// Quad `t` (weights `4t..4t + 4`: q6 `q + 32`, q5 `q`) of eight columns of a packed block,
/// from `src`: the block's bytes at those columns' half of each vector.
#[inline(always)]
unsafe fn quad<const K: u8>(src: *const u8, t: usize) -> __m256i {
    let l = _mm256_loadu_si256(src.add(64 * (t % 4)).cast());
    let low = if t < 4 { l } else { _mm256_srli_epi16::<4>(l) };
    let low = _mm256_and_si256(low, _mm256_set1_epi8(0x0f));
    if K != Q6 {
        // bit t of the top-bits vector is quad t's fifth bit: moved to bit 4
        let h = _mm256_loadu_si256(src.add(256).cast());
        let high = match t {
            0 => _mm256_slli_epi16::<4>(h),
            1 => _mm256_slli_epi16::<3>(h),
            2 => _mm256_slli_epi16::<2>(h),
            3 => _mm256_slli_epi16::<1>(h),
            4 => h,
            5 => _mm256_srli_epi16::<1>(h),
            6 => _mm256_srli_epi16::<2>(h),
            _ => _mm256_srli_epi16::<3>(h),
        };
        return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x10)));
    }
    // bits 2m, 2m + 1 of the top-bits vector `t % 2` are quad `t % 2 + 2m`'s: moved to 4, 5
    let h = _mm256_loadu_si256(src.add(256 + 64 * (t % 2)).cast());
    let high = match t / 2 {
        0 => _mm256_slli_epi16::<4>(h),
        1 => _mm256_slli_epi16::<2>(h),
        2 => h,
        _ => _mm256_srli_epi16::<2>(h),
    };
    _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)))
}

/// Value `v` of eight columns (`8 part..` of the group) of block `b` at position `p`, whose bytes
/// are at `src`: q6 the scale of half `v`, `d * sc`; q5 its scale (`v = 0`, `d * sc`) or offset
/// (`dmin * m`); Q5_0's and Q5_1's as they lie (no offset: the scale again, never read).
#[inline(always)]
unsafe fn value<const K: u8>(
    g: &Packed,
    src: *const u8,
    b: usize,
    p: usize,
    v: usize,
    part: usize,
) -> __m256 {
    if K == Q5_BLOCKS || K == Q5_BLOCKS_OFFSET {
        let per = if v == 1 && K == Q5_BLOCKS_OFFSET {
            g.dmin
        } else {
            g.d
        };
        return _mm256_loadu_ps(per.add(p * PACK + 8 * part));
    }
    let (ints, per) = if K == Q6 {
        (src.add(384 + 16 * v), g.d)
    } else {
        (src.add(320 + 16 * v), if v == 0 { g.d } else { g.dmin })
    };
    let ints = _mm_loadl_epi64(ints.add(8 * part).cast());
    let per = _mm256_loadu_ps(per.add(b / SUPER * PACK + 8 * part));
    _mm256_mul_ps(per, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ints)))
}
