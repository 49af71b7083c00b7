//! The eight-column 4-bit kernel of `side_by_side.rs` (AVX2, or AVX-512 VNNI on 256-bit vectors)
//! for a matrix packed at load (`crate::packed`), for any number of rows: each tile reads its
//! half of the packed group in place.
//!
//! Why: as for `wide_packed.rs` on AVX-512. From the row layout every call transposed each
//! block of a group of eight columns into a buffer (sixteen 16-byte loads and inserts, eight
//! unpacks, sixteen scalar loads for the scales and offsets), in a phase that also waited on
//! the weights' read; packed, a block's operand vectors are four 32-byte loads (the group's
//! eight-column half of each 64-byte vector), its scales and offsets one load each, and the
//! blocks lie in the order the tiles walk them, so the first tile streams them while it
//! multiplies; one row ([`one_row`]) takes a whole group of sixteen at once, faster than the
//! row layout's one-row kernel. Calls of many rows (`wide_packed::SPLIT_ROWS`) split each block
//! once into `side_by_side.rs`'s buffer instead. The integer sums are exact and the float
//! operations `side_by_side.rs`'s in its order (a padding block skipped: it adds +0 to a lane
//! that is never -0), so the bits are `plain.rs`'s (the tests check it). On the
//! Llama-1B-shaped Q4_K_M under `KVPARK_CPU_ISA=avx2`, packed against the row layout: eight
//! chats 67.6-71.6 → 74.5-79.5 tok/s, one chat 31.0-31.1 → 32.0, a 448-token prefill even.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::side_by_side::{combine, store_row, Quads, GROUP};
use super::{Activations, LANES};
use crate::packed::{quads_at, value_at, PACK};
use crate::threads::Output;
use crate::weights::{Q4Weights, BLOCK};

/// Rows multiplied together against each block's operand vectors.
const TILE: usize = 4;

/// Bytes ahead of the block being read whose lines the first tile asks for.
const AHEAD: usize = 4096;

/// Output columns `c0..c0 + GROUP` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX2, FMA and what `D` uses; `w` is packed, `c0` a multiple of [`GROUP`] and
/// `c0 + GROUP <= w.n`; `a` was quantised for `w`.
#[inline(always)]
pub(super) unsafe fn group<D: Quads>(a: &Activations<'_>, w: Q4Weights<'_>, c0: usize, y: &Output) {
    let blocks = a.k / BLOCK;
    assert!(w.packed && c0.is_multiple_of(GROUP) && c0 + GROUP <= w.n && a.k == w.k);
    assert!(w.qs.len() == w.n * blocks * 16 && w.scale.len().min(w.offset.len()) == w.n * blocks);
    assert!(a.padded.is_multiple_of(LANES) && a.q.len() == a.rows * a.k);
    assert!(a.d.len().min(a.sum.len()) == a.rows * a.padded);
    // this half's bytes and values within its packed group of sixteen
    let (start, half) = (c0 - c0 % PACK, c0 % PACK);
    let at = value_at(blocks, start, 0, 1, 0) + half;
    let g = Half {
        qs: w.qs.as_ptr().add(quads_at(blocks, start, 0, 4) + 4 * half),
        scale: w.scale.as_ptr().add(at),
        offset: w.offset.as_ptr().add(at),
        blocks,
        // the second half finds the lines the first read in cache: only the first asks ahead
        ahead: half == 0,
    };
    let mut r0 = 0;
    while r0 < a.rows {
        let left = a.rows - r0;
        match left {
            1 => tile::<D, 1>(a, &g, r0, y, w.n, c0),
            2 => tile::<D, 2>(a, &g, r0, y, w.n, c0),
            3 => tile::<D, 3>(a, &g, r0, y, w.n, c0),
            _ => tile::<D, TILE>(a, &g, r0, y, w.n, c0),
        }
        r0 += left.min(TILE);
    }
}

/// A packed group's half: its quants (quad `q` of the block at position `p` at `qs + (4 p + q)
/// * 64`), scales and offsets (at `+ 16 p`).
struct Half {
    qs: *const u8,
    scale: *const f32,
    offset: *const f32,
    blocks: usize,
    ahead: bool,
}

/// Rows `r0..r0 + R` against the half `g`, lane by lane as `side_by_side::tile` walks them.
#[inline(always)]
unsafe fn tile<D: Quads, const R: usize>(
    a: &Activations<'_>,
    g: &Half,
    r0: usize,
    y: &Output,
    n: usize,
    c0: usize,
) {
    let xq: [*const i8; R] = std::array::from_fn(|i| a.q.as_ptr().add((r0 + i) * a.k));
    let d: [*const f32; R] = std::array::from_fn(|i| a.d.as_ptr().add((r0 + i) * a.padded));
    let sum: [*const f32; R] = std::array::from_fn(|i| a.sum.as_ptr().add((r0 + i) * a.padded));
    let mask = _mm256_set1_epi8(0x0f);
    let (per_lane, longer) = (g.blocks / LANES, g.blocks % LANES);
    let mut p = 0; // the block's position in the group
                   // every lane is written below before it is read (zeroed first, it was a `memset` a tile)
    let mut acc = [[MaybeUninit::<__m256>::uninit(); LANES]; R];
    #[allow(clippy::needless_range_loop)] // `l` picks both the blocks and each row's accumulator
    for l in 0..LANES {
        let mut lane = [_mm256_setzero_ps(); R];
        for j in 0..per_lane + usize::from(l < longer) {
            let b = l + j * LANES;
            let src = g.qs.add(p * 4 * 4 * PACK);
            if r0 == 0 && g.ahead {
                let ahead = src.wrapping_add(AHEAD);
                for line in 0..4 {
                    _mm_prefetch(ahead.wrapping_add(64 * line).cast(), _MM_HINT_T0);
                }
                for v in [g.scale, g.offset] {
                    _mm_prefetch(v.wrapping_add(p * PACK + AHEAD / 4).cast(), _MM_HINT_T0);
                }
            }
            // plain loops, not closures: a closure does not inherit the caller's target
            // features, and its intrinsics would become calls
            let mut u = [_mm256_setzero_si256(); 8];
            for q in 0..4 {
                let t = _mm256_loadu_si256(src.add(q * 4 * PACK).cast());
                u[q] = _mm256_and_si256(t, mask); // weights 4q..4q + 4
                u[4 + q] = _mm256_and_si256(_mm256_srli_epi16::<4>(t), mask); // 16 + 4q..
            }
            let scale = _mm256_loadu_ps(g.scale.add(p * PACK));
            let offset = _mm256_loadu_ps(g.offset.add(p * PACK));
            let mut sums = [_mm256_setzero_si256(); R];
            for (q, u) in u.iter().enumerate() {
                let at = b * BLOCK + if q < 4 { 4 * q } else { 16 + 4 * (q - 4) };
                for i in 0..R {
                    let s = _mm256_set1_epi32((xq[i].add(at) as *const i32).read_unaligned());
                    sums[i] = if q == 0 {
                        D::first(*u, s)
                    } else {
                        D::add(sums[i], *u, s)
                    };
                }
            }
            for i in 0..R {
                let isum = _mm256_cvtepi32_ps(D::finish(sums[i]));
                combine(
                    &mut lane[i],
                    isum,
                    scale,
                    Some(offset),
                    *d[i].add(b),
                    *sum[i].add(b),
                );
            }
            p += 1;
        }
        for i in 0..R {
            acc[i][l] = MaybeUninit::new(lane[i]);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        // SAFETY: the loop above wrote lane `l` of every row for each `l`.
        store_row(&acc.map(|v| v.assume_init()), y, (r0 + i) * n + c0);
    }
}

/// One row against a whole packed group of sixteen columns, both halves at once: each block's
/// activation quads are broadcast once for both, and the group is read front to back. (Eight
/// columns at a time, a row paid a broadcast per quad for each half and read each group twice:
/// one chat ran 1.5-3.5 % slower than on the row layout's one-row kernel.)
///
/// # Safety
/// As [`group`], with `a.rows == 1`, `c0` a multiple of [`PACK`] and `c0 + PACK <= w.n`.
#[inline(always)]
pub(super) unsafe fn one_row<D: Quads>(
    a: &Activations<'_>,
    w: Q4Weights<'_>,
    c0: usize,
    y: &Output,
) {
    let blocks = a.k / BLOCK;
    assert!(w.packed && a.rows == 1 && c0.is_multiple_of(PACK) && c0 + PACK <= w.n);
    assert!(w.qs.len() == w.n * blocks * 16 && w.scale.len().min(w.offset.len()) == w.n * blocks);
    assert!(a.k == w.k && a.padded.is_multiple_of(LANES) && a.q.len() == a.k);
    assert!(a.d.len().min(a.sum.len()) == a.padded);
    let qs = w.qs.as_ptr().add(quads_at(blocks, c0, 0, 4));
    let at = value_at(blocks, c0, 0, 1, 0);
    let (scale, offset) = (w.scale.as_ptr().add(at), w.offset.as_ptr().add(at));
    let (xq, d, sum) = (a.q.as_ptr(), a.d.as_ptr(), a.sum.as_ptr());
    let mask = _mm256_set1_epi8(0x0f);
    let (per_lane, longer) = (blocks / LANES, blocks % LANES);
    let mut p = 0; // the block's position in the group
    let mut acc = [[MaybeUninit::<__m256>::uninit(); LANES]; 2]; // as in `tile`
    #[allow(clippy::needless_range_loop)] // `l` picks both the blocks and each half's accumulator
    for l in 0..LANES {
        let mut lane = [_mm256_setzero_ps(); 2];
        for j in 0..per_lane + usize::from(l < longer) {
            let b = l + j * LANES;
            let src = qs.add(p * 4 * 4 * PACK);
            let ahead = src.wrapping_add(AHEAD);
            for line in 0..4 {
                _mm_prefetch(ahead.wrapping_add(64 * line).cast(), _MM_HINT_T0);
            }
            for v in [scale, offset] {
                _mm_prefetch(v.wrapping_add(p * PACK + AHEAD / 4).cast(), _MM_HINT_T0);
            }
            // exact integer sums in any order of the quads (see `int8`): both halves per quad
            let x = xq.add(b * BLOCK);
            let mut sums = [_mm256_setzero_si256(); 2];
            for q in 0..4 {
                let lo = _mm256_set1_epi32((x.add(4 * q) as *const i32).read_unaligned());
                let hi = _mm256_set1_epi32((x.add(16 + 4 * q) as *const i32).read_unaligned());
                for (h, sums) in sums.iter_mut().enumerate() {
                    let t = _mm256_loadu_si256(src.add(q * 4 * PACK + 32 * h).cast());
                    let u_lo = _mm256_and_si256(t, mask);
                    let u_hi = _mm256_and_si256(_mm256_srli_epi16::<4>(t), mask);
                    *sums = if q == 0 {
                        D::first(u_lo, lo)
                    } else {
                        D::add(*sums, u_lo, lo)
                    };
                    *sums = D::add(*sums, u_hi, hi);
                }
            }
            for (h, lane) in lane.iter_mut().enumerate() {
                let isum = _mm256_cvtepi32_ps(D::finish(sums[h]));
                let s = _mm256_loadu_ps(scale.add(p * PACK + GROUP * h));
                let o = _mm256_loadu_ps(offset.add(p * PACK + GROUP * h));
                combine(lane, isum, s, Some(o), *d.add(b), *sum.add(b));
            }
            p += 1;
        }
        for h in 0..2 {
            acc[h][l] = MaybeUninit::new(lane[h]);
        }
    }
    // SAFETY: the loop above wrote lane `l` of both halves for each `l`.
    let acc = acc.map(|h| h.map(|v| v.assume_init()));
    store_row(&acc[0], y, c0);
    store_row(&acc[1], y, c0 + GROUP);
}
