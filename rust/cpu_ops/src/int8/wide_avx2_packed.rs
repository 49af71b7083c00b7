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

use super::side_by_side::{store_row, GROUP};
use super::{Activations, LANES};
use crate::packed::{quads_at, value_at, PACK};
use crate::threads::Output;
use crate::weights::{Q6Weights, BLOCK};

/// Rows multiplied together against each block's operand vectors (as `wide_avx2.rs`).
const TILE: usize = 4;

/// Bytes ahead of the block being read whose lines the first tile asks for.
const AHEAD: usize = 4096;

/// A q6 block's bytes in a packed group: eight quads of sixteen columns.
const BLOCK_BYTES: usize = 8 * 4 * PACK;

/// Whether the kernels here read `w` (packed, and narrow: its quants span fewer than 64 values).
pub(super) fn takes(w: &Q6Weights<'_>) -> bool {
    w.packed && w.low.is_some()
}

/// Output columns `c0..c0 + GROUP` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX2 and FMA; [`takes`] holds, `c0` is a multiple of [`GROUP`] and `c0 + GROUP
/// <= w.n`; `a` was quantised for `w`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Q6Weights<'_>, c0: usize, y: &Output) {
    let g = Packed::new(a, &w, c0, GROUP);
    let mut r0 = 0;
    while r0 < a.rows {
        let left = a.rows - r0;
        match left {
            1 => tile::<1, 1>(a, &g, r0, y, w.n, c0),
            2 => tile::<2, 1>(a, &g, r0, y, w.n, c0),
            3 => tile::<3, 1>(a, &g, r0, y, w.n, c0),
            _ => tile::<TILE, 1>(a, &g, r0, y, w.n, c0),
        }
        r0 += left.min(TILE);
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
    tile::<1, 2>(a, &g, 0, y, w.n, c0)
}

/// Columns `c0..` of a packed group: their quants (quad `q` of the block at position `p` at
/// `qs + p * BLOCK_BYTES + q * 64`, the second half of a group 32 bytes on), their scales (the
/// block's two at `scale + 32 p` and `+ 16`, each sixteen columns'), and the shift to u8.
struct Packed {
    qs: *const u8,
    scale: *const f32,
    blocks: usize,
    low: i8,
    /// Whether this tile's first rows ask for the lines ahead (a second half finds them in
    /// cache, read by the first).
    ahead: bool,
}

impl Packed {
    /// Checks the call and finds columns `c0..c0 + width` of `w`.
    #[inline(always)]
    unsafe fn new(a: &Activations<'_>, w: &Q6Weights<'_>, c0: usize, width: usize) -> Packed {
        let blocks = a.k / BLOCK;
        assert!(takes(w) && c0.is_multiple_of(GROUP) && c0 + width <= w.n && a.k == w.k);
        assert!(w.qs.len() == w.n * blocks * BLOCK && w.scale.len() == w.n * blocks * 2);
        assert!(a.padded.is_multiple_of(LANES) && a.q.len() == a.rows * a.k);
        assert!(a.d.len().min(a.lo.len()).min(a.hi.len()) == a.rows * a.padded);
        let (start, half) = (c0 - c0 % PACK, c0 % PACK);
        Packed {
            qs: w
                .qs
                .as_ptr()
                .cast::<u8>()
                .add(quads_at(blocks, start, 0, 8) + 4 * half),
            scale: w
                .scale
                .as_ptr()
                .add(value_at(blocks, start, 0, 2, 0) + half),
            blocks,
            low: w.low.unwrap_or(0),
            ahead: half == 0,
        }
    }
}

/// Rows `r0..r0 + R` against `H` halves of the group `g` (eight columns each), lane by lane of
/// `int8`'s combine: per half block (weights 0..16, then 16..32) two i16 sums of two
/// `vpmaddubsw` widened by `vpmaddwd` and added, corrected by `low` times the activations' half
/// sum, then combined with its scale, as `wide_avx2::tile` does for the narrow q6 kind.
#[inline(always)]
unsafe fn tile<const R: usize, const H: usize>(
    a: &Activations<'_>,
    g: &Packed,
    r0: usize,
    y: &Output,
    n: usize,
    c0: usize,
) {
    let xq: [*const i8; R] = std::array::from_fn(|i| a.q.as_ptr().add((r0 + i) * a.k));
    let row: [usize; R] = std::array::from_fn(|i| (r0 + i) * a.padded);
    let (low8, low) = (_mm256_set1_epi8(g.low), _mm256_set1_ps(f32::from(g.low)));
    let ones = _mm256_set1_epi16(1);
    let (per_lane, longer) = (g.blocks / LANES, g.blocks % LANES);
    let mut p = 0; // the block's position in the group
    let mut acc = [[[_mm256_setzero_ps(); LANES]; H]; R];
    #[allow(clippy::needless_range_loop)] // `l` picks both the blocks and the accumulators
    for l in 0..LANES {
        let mut lane = [[_mm256_setzero_ps(); H]; R];
        for j in 0..per_lane + usize::from(l < longer) {
            let b = l + j * LANES;
            let src = g.qs.add(p * BLOCK_BYTES);
            let scales = g.scale.add(p * 2 * PACK);
            if r0 == 0 && g.ahead {
                let ahead = src.wrapping_add(AHEAD);
                for line in 0..8 {
                    _mm_prefetch(ahead.wrapping_add(64 * line).cast(), _MM_HINT_T0);
                }
                _mm_prefetch(scales.wrapping_add(AHEAD / 4).cast(), _MM_HINT_T0);
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
                            let v = _mm256_loadu_si256(src.add(64 * t + 32 * h).cast());
                            *w = _mm256_sub_epi8(v, low8);
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
                    let d = _mm256_set1_ps(*a.d.as_ptr().add(row[i] + b));
                    for h in 0..H {
                        let isum = _mm256_fmadd_ps(low, q_sum, _mm256_cvtepi32_ps(sums[i][h]));
                        let s = _mm256_loadu_ps(scales.add(half * PACK + GROUP * h));
                        lane[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, d), isum, lane[i][h]);
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
