//! The x86-64 int8 kernel for [`Q6Weights`] (both SIMD paths, through their [`Dot`]): a block's
//! integer dot is two sums, one per scale, so it keeps the halves `simd::reduce` would add.
//!
//! Per (column, row), eight blocks at a time: each block's 32 int8 weights are loaded once as
//! `|w|` and its signs (as the Q8 format of `simd.rs`: `|w| * (x * sign(w)) = w * x`, the
//! activations in [-127, 127] and `|w| <= 128`, so `vpmaddubsw`'s i16 pairs stay within 32,512),
//! the eight dots reduced to two vectors of eight half sums (weights 0..16 of each block, then
//! 16..32), the scales de-interleaved to match, and two FMAs add the group into the row's lanes:
//! the first half then the second, the order `int8::plain::dot_q6` follows lane by lane.
//!
//! Rows go in tiles of [`ROW_TILE`]: a group's blocks are unpacked and its scales de-interleaved
//! once for the tile (as `simd.rs` unpacks a chunk), which at eight rows made the head's
//! product ~1.2x faster than unpacking per row (docs/cpu-kernels.md); a lone row loads each
//! block straight into registers. Neither the tile nor the group changes any row's order of
//! operations.

use std::arch::x86_64::*;

use super::simd::{halves, load_lanes, Dot};
use super::{Activations, LANES, PREFETCH_BLOCKS};
use crate::threads::Output;
use crate::tiling::ROW_TILE;
use crate::weights::{Q6Weights, BLOCK};

/// Output columns `cols` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX2, FMA and what `D` uses.
#[inline(always)]
pub(super) unsafe fn columns<D: Dot>(
    a: &Activations<'_>,
    w: Q6Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    let blocks = a.k / BLOCK;
    assert!(cols.end <= w.n && a.k == w.k && a.padded >= blocks);
    assert!(a.padded.is_multiple_of(LANES));
    assert!(w.qs.len() == w.n * a.k && w.scale.len() == w.n * blocks * 2);
    assert!(a.q.len() == a.rows * a.k && a.d.len() == a.rows * a.padded);
    let mut out = [0.0f32; ROW_TILE];
    for c in cols {
        for r0 in (0..a.rows).step_by(ROW_TILE) {
            let rows = r0..a.rows.min(r0 + ROW_TILE);
            // one row takes each block once: loaded straight into registers, not via the stack
            if rows.len() == 1 {
                column::<D, true>(a, rows.clone(), w, c * blocks, &mut out);
            } else {
                column::<D, false>(a, rows.clone(), w, c * blocks, &mut out);
            }
            for (r, v) in rows.zip(out) {
                y.set(r * w.n + c, v);
            }
        }
    }
}

/// `out[r - rows.start]` for the rows of the tile against the column whose first block is
/// `base`. Each group of eight blocks is unpacked and its scales put in lane order once, then
/// taken by every row of the tile in turn.
#[inline(always)]
unsafe fn column<D: Dot, const SINGLE: bool>(
    a: &Activations<'_>,
    rows: std::ops::Range<usize>,
    w: Q6Weights<'_>,
    base: usize,
    out: &mut [f32; ROW_TILE],
) {
    let blocks = a.k / BLOCK;
    let (qs, scale) = (w.qs.as_ptr(), w.scale.as_ptr());
    let mut acc = [_mm256_setzero_ps(); ROW_TILE];
    let (mut u, mut signs) = (
        [_mm256_setzero_si256(); LANES],
        [_mm256_setzero_si256(); LANES],
    );
    for g in (0..blocks).step_by(LANES) {
        let m = LANES.min(blocks - g);
        let at = base + g;
        for j in 0..m {
            // streams the weights ahead of use (never faults)
            let ahead = qs.wrapping_add((at + j + PREFETCH_BLOCKS) * BLOCK);
            _mm_prefetch(ahead, _MM_HINT_T0);
            if !SINGLE {
                signs[j] = _mm256_loadu_si256(qs.add((at + j) * BLOCK) as *const __m256i);
                u[j] = _mm256_abs_epi8(signs[j]);
            }
        }
        let ahead = scale.wrapping_add(2 * (at + PREFETCH_BLOCKS));
        _mm_prefetch(ahead as *const i8, _MM_HINT_T0);
        let (s_first, s_second) = scales(scale.add(2 * at), m);
        for (r, acc) in rows.clone().zip(acc.iter_mut()) {
            let xq = a.q.as_ptr().add(r * a.k + g * BLOCK);
            let mut sums = [_mm256_setzero_si256(); LANES];
            for (j, s) in sums.iter_mut().enumerate().take(m) {
                let (uj, wj) = if SINGLE {
                    let wv = _mm256_loadu_si256(qs.add((at + j) * BLOCK) as *const __m256i);
                    (_mm256_abs_epi8(wv), wv)
                } else {
                    (u[j], signs[j])
                };
                let xv = _mm256_loadu_si256(xq.add(j * BLOCK) as *const __m256i);
                *s = D::dot(uj, _mm256_sign_epi8(xv, wj));
            }
            let (first, second) = halves(&sums);
            let d = _mm256_loadu_ps(a.d.as_ptr().add(r * a.padded + g));
            *acc = _mm256_fmadd_ps(_mm256_mul_ps(s_first, d), _mm256_cvtepi32_ps(first), *acc);
            *acc = _mm256_fmadd_ps(_mm256_mul_ps(s_second, d), _mm256_cvtepi32_ps(second), *acc);
        }
    }
    for (o, acc) in out.iter_mut().zip(&acc).take(rows.len()) {
        *o = crate::avx2::hsum(*acc);
    }
}

/// The `2 m` scales from `p` (`m` blocks, each its two in turn) as the blocks' first scales and
/// their second ones, one lane per block, +0 in the lanes past `m` (never read past them).
#[inline(always)]
unsafe fn scales(p: *const f32, m: usize) -> (__m256, __m256) {
    let a = load_lanes(p, (2 * m).min(LANES)); // blocks 0..4: [f0 s0 f1 s1 | f2 s2 f3 s3]
    let b = if m > LANES / 2 {
        load_lanes(p.add(LANES), 2 * m - LANES) // blocks 4..8
    } else {
        _mm256_setzero_ps()
    };
    // per 128-bit half: [f0 f1 f4 f5 | f2 f3 f6 f7], then the 64-bit pairs put in order
    let first = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
    let second = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
    let order =
        |v: __m256| _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)));
    (order(first), order(second))
}
