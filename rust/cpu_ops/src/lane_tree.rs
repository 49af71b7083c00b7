//! The fold of sixteen f32 lane sums into one value that the dense products and attention's
//! dot products share (their lane `i % 16` takes input `i`):
//!
//! ```text
//! a_j = lane_j + lane_(j+8)                     (j < 8)
//! y   = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
//! ```
//!
//! [`fold`] is the portable one; [`reduce16`] folds sixteen outputs' lane vectors at once with
//! the same additions (`a_j`, then `b_j = a_j + a_(j+4)`, then `(b0 + b2) + (b1 + b3)`), a few
//! shuffles an output instead of a horizontal sum each.

use crate::plain::hsum;

/// One output's sixteen lanes folded.
#[inline(always)]
pub(crate) fn fold(lanes: &[f32; 16]) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|j| lanes[j] + lanes[j + 8]);
    hsum(&a)
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Sixteen outputs' lane vectors `v[o]` folded as [`fold`] folds one: lane `4 (o % 4) + o / 4`
/// of the result is output `o` (for `o = 4 g + r`, column `g` and row `r` of a dense tile,
/// lane `4 r + g`).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn reduce16(v: [__m512; 16]) -> __m512 {
    // 16 -> 8: halves of outputs 2i and 2i + 1 side by side, a_j of each in one half
    let s1: [__m512; 8] = std::array::from_fn(|i| {
        let (p, q) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(p, q),
            _mm512_shuffle_f32x4::<0xEE>(p, q),
        )
    });
    // 8 -> 4: b_j of outputs 4m .. 4m + 3, one per 128-bit lane
    let s2: [__m512; 4] = std::array::from_fn(|m| {
        let (p, q) = (s1[2 * m], s1[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(p, q),
            _mm512_shuffle_f32x4::<0xDD>(p, q),
        )
    });
    // 4 -> 2: (b0 + b2, b1 + b3) of two outputs in each 128-bit lane
    let s3: [__m512; 2] = std::array::from_fn(|t| {
        let (p, q) = (s2[2 * t], s2[2 * t + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(p, q),
            _mm512_shuffle_ps::<0xEE>(p, q),
        )
    });
    // 2 -> 1: c0 + c1 of four outputs in each 128-bit lane
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(s3[0], s3[1]),
        _mm512_shuffle_ps::<0xDD>(s3[0], s3[1]),
    )
}

/// Eight outputs' `a` vectors (`a_j = lane_j + lane_(j+8)` of output `o` in `a[o]`) folded as
/// [`fold`] folds one, on AVX2: lane `o` of the result is output `o`. Fifteen shuffles and seven
/// additions for the eight, where a horizontal sum each takes three and three.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn fold8(a: [__m256; 8]) -> __m256 {
    // b_j = a_j + a_(j+4): outputs 2i and 2i + 1 in the two halves
    let b: [__m256; 4] = std::array::from_fn(|i| {
        let (p, q) = (a[2 * i], a[2 * i + 1]);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(p, q),
            _mm256_permute2f128_ps::<0x31>(p, q),
        )
    });
    // (b0 + b2, b1 + b3): outputs 4m, 4m + 2 in the low half, 4m + 1, 4m + 3 in the high
    let c: [__m256; 2] = std::array::from_fn(|m| {
        let (p, q) = (b[2 * m], b[2 * m + 1]);
        _mm256_add_ps(
            _mm256_shuffle_ps::<0x44>(p, q),
            _mm256_shuffle_ps::<0xEE>(p, q),
        )
    });
    // c0 + c1: outputs 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high; then in order
    let r = _mm256_add_ps(
        _mm256_shuffle_ps::<0x88>(c[0], c[1]),
        _mm256_shuffle_ps::<0xDD>(c[0], c[1]),
    );
    _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}
