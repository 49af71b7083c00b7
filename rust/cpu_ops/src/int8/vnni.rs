//! The AVX-512 VNNI int8 kernel: `vpdpbusd` multiplies u8 by i8 and adds quads into i32 lanes in
//! one instruction (no intermediate i16, so nothing can saturate). On 256-bit vectors (AVX-512 VL),
//! so it shares `simd.rs` with the AVX2 kernel and gives the same integer sums by construction.

use std::arch::x86_64::*;

use super::one_row;
use super::side_by_side::{self, Quads};
use super::side_by_side_packed;
use super::simd::{self, Dot};
use super::Activations;
use crate::threads::Output;
use crate::weights::{Iq4Weights, Q4Weights, Weights};

struct Dpbusd;

impl Dot for Dpbusd {
    #[inline(always)]
    unsafe fn dot(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }

    #[inline(always)]
    unsafe fn pair(u1: __m256i, s1: __m256i, u2: __m256i, s2: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(Self::dot(u1, s1), u2, s2)
    }
}

impl Quads for Dpbusd {
    /// Eight `vpdpbusd` into one i32 accumulator.
    #[inline(always)]
    unsafe fn first(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }

    #[inline(always)]
    unsafe fn add(sums: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(sums, u, s)
    }

    #[inline(always)]
    unsafe fn finish(sums: __m256i) -> __m256i {
        sums
    }
}

/// See `side_by_side::group`.
///
/// # Safety
/// The CPU has AVX2, FMA and AVX-512 F, BW, VL and VNNI; as `side_by_side::group` requires.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Q4Weights<'_>, c0: usize, y: &Output) {
    side_by_side::group::<Dpbusd>(a, w, c0, y)
}

/// See `side_by_side_packed::group`.
///
/// # Safety
/// The CPU has AVX2, FMA and AVX-512 F, BW, VL and VNNI; as `side_by_side_packed::group` requires.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn packed_group(a: &Activations<'_>, w: Q4Weights<'_>, c0: usize, y: &Output) {
    side_by_side_packed::group::<Dpbusd>(a, w, c0, y)
}

/// See `side_by_side_packed::one_row`.
///
/// # Safety
/// The CPU has AVX2, FMA and AVX-512 F, BW, VL and VNNI; as `side_by_side_packed::one_row` requires.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn packed_one_row(a: &Activations<'_>, w: Q4Weights<'_>, c0: usize, y: &Output) {
    side_by_side_packed::one_row::<Dpbusd>(a, w, c0, y)
}

/// See `simd::columns`.
///
/// # Safety
/// The CPU has AVX2, FMA and AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn columns(
    a: &Activations<'_>,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    simd::columns::<Dpbusd>(a, w, cols, y)
}

/// See `one_row::columns`.
///
/// # Safety
/// The CPU has AVX2, FMA and AVX-512 F, BW, VL and VNNI; as `one_row::columns` requires.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn one_row(
    a: &Activations<'_>,
    w: Q4Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    one_row::columns::<Dpbusd>(a, w, cols, y)
}

/// See `one_row::columns_iq4`.
///
/// # Safety
/// The CPU has AVX2, FMA and AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn one_row_iq4(
    a: &Activations<'_>,
    w: Iq4Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    one_row::columns_iq4::<Dpbusd>(a, w, cols, y)
}
