//! AVX2's q6 kernel (`wide_avx2.rs`, the narrow kind) for a q6 matrix packed at load
//! (`crate::packed`), for any number of rows: each tile reads its half of the packed group in
//! place.
//!
//! Why: as `side_by_side_packed.rs` for 4-bit weights. From the row layout every call of two
//! rows or more transposed each block of a group of eight columns into a buffer (eight 32-byte
//! loads, a 8 x 8 transposition of quads, eight gathers of scales), in a phase that also waited
//! on the weights' read, and one row took the column kernel (`q6.rs`), which ends every (block,
//! column) in a horizontal reduction. Packed, a block's eight operand vectors are eight 32-byte
//! loads (the group's eight-column half of each 64-byte vector) less `low`, its two scales two
//! loads, and the blocks lie in the order the tiles walk them, so the first tile streams them
//! while it multiplies; one row ([`one_row`]) takes a whole group of sixteen at once, each
//! activation quad broadcast once for both halves. The integer sums are exact and the float
//! operations `wide_avx2.rs`'s for the narrow q6 kind in its order, so the bits are
//! `plain.rs`'s (the tests check it).

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::side_by_side::{store_row, GROUP};
use super::{Activations, LANES};
use crate::packed::{q6_at, q6_d_at, q6_packed_lengths, PACK, Q6_BIAS, Q6_BLOCK_BYTES, SUPER};
use crate::threads::Output;
use crate::weights::{Q6Weights, BLOCK};

/// Rows multiplied together against each block's operand vectors (as `wide_avx2.rs`).
const TILE: usize = 4;

/// Bytes ahead of the block being read whose lines the first tile asks for.
const AHEAD: usize = 4096;

/// Whether the kernels here read `w` (packed: every q6 matrix packed is).
pub(super) fn takes(w: &Q6Weights<'_>) -> bool {
    w.packed
}

/// Output columns `c0..c0 + GROUP` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX2 and FMA; [`takes`] holds, `c0` is a multiple of [`GROUP`] and `c0 + GROUP
/// <= w.n`; `a` was quantised for `w`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Q6Weights<'_>, c0: usize, y: &Output) {
    let mut g = Packed::new(a, &w, c0, GROUP);
    if a.rows >= SPLIT_ROWS {
        return SPLIT.with_borrow_mut(|buffer| {
            split(&g, buffer);
            g.split = buffer.as_ptr();
            tiles::<true>(a, &g, y, w.n, c0)
        });
    }
    tiles::<false>(a, &g, y, w.n, c0)
}

/// Every row of `a`, a tile at a time, against the half `g` (from its split buffer: `S`).
#[inline(always)]
unsafe fn tiles<const S: bool>(a: &Activations<'_>, g: &Packed, y: &Output, n: usize, c0: usize) {
    let mut r0 = 0;
    while r0 < a.rows {
        let left = a.rows - r0;
        match left {
            1 => tile::<1, 1, S>(a, g, r0, y, n, c0),
            2 => tile::<2, 1, S>(a, g, r0, y, n, c0),
            3 => tile::<3, 1, S>(a, g, r0, y, n, c0),
            _ => tile::<TILE, 1, S>(a, g, r0, y, n, c0),
        }
        r0 += left.min(TILE);
    }
}

/// Rows from which a call widens each block of its half once into a buffer ([`split`]) and runs
/// its tiles there, rather than again in every tile of four rows: a 448-token prefill of the
/// Llama-1B-shaped Q6_K lost 4-17 % to the repeated widening.
const SPLIT_ROWS: usize = 16;

/// One block of a half, widened: its eight quad vectors (`u = q + 32`) and two scale vectors.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
struct Split {
    quads: [__m256i; 8],
    scale: [__m256; 2],
}

thread_local! {
    /// The widened half, reused by every call of many rows on this thread.
    static SPLIT: RefCell<Vec<Split>> = const { RefCell::new(Vec::new()) };
}

/// Every block of the half `g`, in its position's order, widened into `buffer`.
#[inline(always)]
unsafe fn split(g: &Packed, buffer: &mut Vec<Split>) {
    if buffer.len() < g.blocks {
        // SAFETY: every field is plain SIMD data, for which all-zero bits are valid.
        buffer.resize(g.blocks, std::mem::zeroed());
    }
    let (nibble, top) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
    let (per_lane, longer) = (g.blocks / LANES, g.blocks % LANES);
    let mut p = 0;
    for l in 0..LANES {
        for j in 0..per_lane + usize::from(l < longer) {
            let b = l + j * LANES;
            let src = g.qs.add(p * Q6_BLOCK_BYTES);
            let d = g.d.add(b / SUPER * PACK);
            let out = &mut buffer[p];
            for t in 0..8 {
                out.quads[t] = quad(src.add(32 * (g.half / GROUP)), t, nibble, top);
            }
            for half in 0..2 {
                out.scale[half] = scale(src, d, half, g.half / GROUP);
            }
            p += 1;
        }
    }
}

/// One row against a whole packed group of sixteen columns, both halves at once.
///
/// # Safety
/// As [`group`], with `a.rows == 1`, `c0` a multiple of [`PACK`] and `c0 + PACK <= w.n`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn one_row(a: &Activations<'_>, w: Q6Weights<'_>, c0: usize, y: &Output) {
    assert!(a.rows == 1 && c0.is_multiple_of(PACK));
    let g = Packed::new(a, &w, c0, PACK);
    tile::<1, 2, false>(a, &g, 0, y, w.n, c0)
}

/// Columns `c0..` of a packed group: their blocks (the block at position `p` at `qs + p *
/// Q6_BLOCK_BYTES`, the second half of a group's columns 32 bytes on in each vector, 8 in each
/// run of int8 scales) and their `d` (block `b`'s at `d + b / SUPER * PACK`).
struct Packed {
    qs: *const u8,
    d: *const f32,
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
    unsafe fn new(a: &Activations<'_>, w: &Q6Weights<'_>, c0: usize, width: usize) -> Packed {
        let blocks = a.k / BLOCK;
        assert!(takes(w) && c0.is_multiple_of(GROUP) && c0 + width <= w.n && a.k == w.k);
        assert!((w.qs.len(), w.scale.len()) == q6_packed_lengths(w.n, w.k));
        assert!(a.padded.is_multiple_of(LANES) && a.q.len() == a.rows * a.k);
        assert!(a.d.len().min(a.lo.len()).min(a.hi.len()) == a.rows * a.padded);
        let start = c0 - c0 % PACK;
        Packed {
            qs: w.qs.as_ptr().cast::<u8>().add(q6_at(blocks, start, 0)),
            d: w.scale.as_ptr().add(q6_d_at(blocks, start, 0)),
            blocks,
            half: c0 % PACK,
            ahead: c0.is_multiple_of(PACK),
            split: std::ptr::null(),
        }
    }
}

/// Rows `r0..r0 + R` against `H` halves of the group `g` (eight columns each; read from its
/// split buffer where `S`, with `H == 1`), lane by lane of `int8`'s combine: per half block
/// (weights 0..16, then 16..32) two i16 sums of two `vpmaddubsw` widened by `vpmaddwd` and
/// added, corrected by `low` times the activations' half sum, then combined with its scale, as
/// `wide_avx2::tile` does for the narrow q6 kind.
#[inline(always)]
unsafe fn tile<const R: usize, const H: usize, const S: bool>(
    a: &Activations<'_>,
    g: &Packed,
    r0: usize,
    y: &Output,
    n: usize,
    c0: usize,
) {
    let xq: [*const i8; R] = std::array::from_fn(|i| a.q.as_ptr().add((r0 + i) * a.k));
    let row: [usize; R] = std::array::from_fn(|i| (r0 + i) * a.padded);
    // the packed quants are `q + 32`: each half block's sum is corrected by `-32 Σ q`
    let (nibble, top) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
    let low = _mm256_set1_ps(-f32::from(Q6_BIAS));
    let ones = _mm256_set1_epi16(1);
    let (per_lane, longer) = (g.blocks / LANES, g.blocks % LANES);
    let mut p = 0; // the block's position in the group
    let mut acc = [[[_mm256_setzero_ps(); LANES]; H]; R];
    #[allow(clippy::needless_range_loop)] // `l` picks both the blocks and the accumulators
    for l in 0..LANES {
        let mut lane = [[_mm256_setzero_ps(); H]; R];
        for j in 0..per_lane + usize::from(l < longer) {
            let b = l + j * LANES;
            let src = g.qs.add(p * Q6_BLOCK_BYTES);
            let d = g.d.add(b / SUPER * PACK);
            if r0 == 0 && g.ahead && !S {
                let ahead = src.wrapping_add(AHEAD);
                for line in 0..Q6_BLOCK_BYTES.div_ceil(64) {
                    _mm_prefetch(ahead.wrapping_add(64 * line).cast(), _MM_HINT_T0);
                }
            }
            // plain loops, not closures: a closure does not inherit this function's target
            // features, and its intrinsics would become calls
            for half in 0..2 {
                let mut sums = [[_mm256_setzero_si256(); H]; R];
                for two in 0..2 {
                    let mut pairs = [[_mm256_setzero_si256(); H]; R];
                    for u in 0..2 {
                        let t = 4 * half + 2 * two + u;
                        let mut w = [_mm256_setzero_si256(); H];
                        for (h, w) in w.iter_mut().enumerate() {
                            *w = if S {
                                (*g.split.add(p)).quads[t]
                            } else {
                                quad(src.add(32 * (g.half / GROUP + h)), t, nibble, top)
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
                    for i in 0..R {
                        for h in 0..H {
                            let wide = _mm256_madd_epi16(pairs[i][h], ones);
                            sums[i][h] = _mm256_add_epi32(sums[i][h], wide);
                        }
                    }
                }
                let half_sums = if half == 0 { a.lo } else { a.hi };
                for i in 0..R {
                    let q_sum = _mm256_set1_ps(*half_sums.as_ptr().add(row[i] + b));
                    let row_d = _mm256_set1_ps(*a.d.as_ptr().add(row[i] + b));
                    for h in 0..H {
                        let isum = _mm256_fmadd_ps(low, q_sum, _mm256_cvtepi32_ps(sums[i][h]));
                        let s = if S {
                            (*g.split.add(p)).scale[half]
                        } else {
                            scale(src, d, half, g.half / GROUP + h)
                        };
                        lane[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, row_d), isum, lane[i][h]);
                    }
                }
            }
            p += 1;
        }
        for i in 0..R {
            for h in 0..H {
                acc[i][h][l] = lane[i][h];
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (h, acc) in acc.iter().enumerate() {
            store_row(acc, y, (r0 + i) * n + c0 + GROUP * h);
        }
    }
}

/// Quad `t` (`u = q + 32` of weights `4t..4t + 4`) of eight columns of a packed q6 block, from
/// `src`: the block's bytes at those columns' half of each vector (`crate::packed`'s layout).
#[inline(always)]
unsafe fn quad(src: *const u8, t: usize, nibble: __m256i, top: __m256i) -> __m256i {
    let l = _mm256_loadu_si256(src.add(64 * (t % 4)).cast());
    let low = if t < 4 { l } else { _mm256_srli_epi16::<4>(l) };
    // bits 2m, 2m + 1 of the top-bits vector `t % 2` are quad `t % 2 + 2m`'s: moved to 4, 5
    let h = _mm256_loadu_si256(src.add(256 + 64 * (t % 2)).cast());
    let high = match t / 2 {
        0 => _mm256_slli_epi16::<4>(h),
        1 => _mm256_slli_epi16::<2>(h),
        2 => h,
        _ => _mm256_srli_epi16::<2>(h),
    };
    _mm256_or_si256(_mm256_and_si256(low, nibble), _mm256_and_si256(high, top))
}

/// Half `half` (weights 0..16 or 16..32) of eight columns' scales, `d * sc`: the int8 `sc` of
/// the block at `src` for the eight columns `8 part..`, the columns' `d` at `d`.
#[inline(always)]
unsafe fn scale(src: *const u8, d: *const f32, half: usize, part: usize) -> __m256 {
    let sc = _mm_loadl_epi64(src.add(384 + 16 * half + 8 * part).cast());
    let d = _mm256_loadu_ps(d.add(8 * part));
    _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)))
}
