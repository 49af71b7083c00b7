//! The AVX2 int8 kernel: `vpmaddubsw` multiplies u8 by i8 and adds pairs to i16 (saturating,
//! which the operands' ranges never reach: see `int8`), `vpmaddwd` by ones adds pairs to i32.

use std::arch::x86_64::*;

use super::simd::{self, Dot};
use super::Activations;
use crate::threads::Output;
use crate::Weights;

struct Maddubs;

impl Dot for Maddubs {
    #[inline(always)]
    unsafe fn dot(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }
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
