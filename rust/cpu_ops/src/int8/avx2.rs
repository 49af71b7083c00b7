//! The AVX2 int8 kernel: `vpmaddubsw` multiplies u8 by i8 and adds pairs to i16 (saturating,
//! which the operands' ranges never reach: see `int8`), `vpmaddwd` by ones adds pairs to i32.

use std::arch::x86_64::*;

use super::one_row;
use super::side_by_side::{self, Quads};
use super::side_by_side_packed;
use super::simd::{self, Dot};
use super::Activations;
use crate::threads::Output;
use crate::weights::{Iq4Weights, Q4Weights, Weights};

struct Maddubs;

impl Dot for Maddubs {
    #[inline(always)]
    unsafe fn dot(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// Both `vpmaddubsw` added in i16, then one `vpmaddwd`: each i16 lane holds four products of
    /// a nibble and an activation, at most 4 * 15 * 127 = 7620 (only 4-bit weights come here:
    /// `one_row.rs`).
    #[inline(always)]
    unsafe fn pair(u1: __m256i, s1: __m256i, u2: __m256i, s2: __m256i) -> __m256i {
        let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2));
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }
}

impl Quads for Maddubs {
    /// Eight `vpmaddubsw` summed in i16 (each lane then holds 16 products of a nibble and an
    /// activation: at most 16 * 15 * 127 = 30480 < 32767 in magnitude), one `vpmaddwd` to i32.
    #[inline(always)]
    unsafe fn first(u: __m256i, s: __m256i) -> __m256i {
        _mm256_maddubs_epi16(u, s)
    }

    #[inline(always)]
    unsafe fn add(sums: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi16(sums, _mm256_maddubs_epi16(u, s))
    }

    #[inline(always)]
    unsafe fn finish(sums: __m256i) -> __m256i {
        _mm256_madd_epi16(sums, _mm256_set1_epi16(1))
    }
}

/// See `side_by_side::group`.
///
/// # Safety
/// The CPU has AVX2 and FMA; as `side_by_side::group` requires.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Q4Weights<'_>, c0: usize, y: &Output) {
    side_by_side::group::<Maddubs>(a, w, c0, y)
}

/// See `side_by_side_packed::group`.
///
/// # Safety
/// The CPU has AVX2 and FMA; as `side_by_side_packed::group` requires.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn packed_group(a: &Activations<'_>, w: Q4Weights<'_>, c0: usize, y: &Output) {
    side_by_side_packed::group::<Maddubs>(a, w, c0, y)
}

/// See `side_by_side_packed::one_row`.
///
/// # Safety
/// The CPU has AVX2 and FMA; as `side_by_side_packed::one_row` requires.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn packed_one_row(a: &Activations<'_>, w: Q4Weights<'_>, c0: usize, y: &Output) {
    side_by_side_packed::one_row::<Maddubs>(a, w, c0, y)
}

/// See `simd::columns`.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn columns(
    a: &Activations<'_>,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    simd::columns::<Maddubs>(a, w, cols, y)
}

/// See `one_row::columns`.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn one_row(
    a: &Activations<'_>,
    w: Q4Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    one_row::columns::<Maddubs>(a, w, cols, y)
}

/// See `one_row::columns_iq4`.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn one_row_iq4(
    a: &Activations<'_>,
    w: Iq4Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    one_row::columns_iq4::<Maddubs>(a, w, cols, y)
}
