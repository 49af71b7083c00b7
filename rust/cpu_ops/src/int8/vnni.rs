//! The AVX-512 VNNI int8 kernel: `vpdpbusd` multiplies u8 by i8 and adds quads into i32 lanes in
//! one instruction (no intermediate i16, so nothing can saturate). On 256-bit vectors (AVX-512 VL),
//! so it shares `simd.rs` with the AVX2 kernel and gives the same integer sums by construction.

use std::arch::x86_64::*;

use super::simd::{self, Dot};
use super::Activations;
use crate::threads::Output;
use crate::Weights;

struct Dpbusd;

impl Dot for Dpbusd {
    #[inline(always)]
    unsafe fn dot(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }
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
