//! e^x with an arithmetic of our own, so that a SIMD path and the portable one give the same
//! bits (libm's `expf` is scalar and is not the same function everywhere): silu and gelu
//! (decoder/silu.rs, decoder/gelu.rs) and attention's softmax (attention/block.rs) use it.
//!
//! exp(x): `n = round(x · log2 e)` (ties to even), `r = x − n·ln2` in two FMAs (Cody-Waite with
//! ln2 split into a high part exact in f32 and a low part), `e^r` by the degree-6 Taylor
//! polynomial in Horner form (six FMAs; |r| ≤ ln2/2 so the truncation is below 2^-23 relative),
//! then scaled by `2^n` through the exponent bits. `x` is clamped to [-87, 88] first, so `n` stays
//! in the normal range; below −87 the result is ~1.6e-38 instead of smaller. [`exp`] and
//! [`exp_avx2`] do exactly these operations in this order (`f32::mul_add` and `_mm256_fmadd_ps`
//! are both one rounding), so they agree bitwise for every x but a NaN (decoder/silu.rs's tests
//! check it); code that calls [`exp`] and is compiled with SIMD enabled vectorises it without
//! changing an operation.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 = LN2_HI + LN2_LO: LN2_HI has 15 significant bits, so n · LN2_HI is exact for |n| < 2^9
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
const C: [f32; 7] = [
    1.0,
    1.0,
    0.5,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
];
const LO: f32 = -87.0;
const HI: f32 = 88.0;

/// e^x as described in the module doc.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(LO, HI);
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p = C[6];
    for c in C[..6].iter().rev() {
        p = p.mul_add(r, *c);
    }
    p * two_to(n)
}

/// 2^n for a whole `n` in -126..=127 (what [`exp`]'s clamp leaves), from `n`'s bits: `n + 1.5 ·
/// 2^23` is exact and holds `n` in its low mantissa bits, so no float-to-int conversion is made.
/// Why: `n as i32` saturates (and maps NaN to 0), which the compiler cannot vectorise; each of
/// sixteen lanes then went through a scalar convert, two compares and two moves, in the softmax
/// of every attention task. For a NaN `n` the scale is garbage, but `p` is NaN then too and the
/// product keeps `p`'s NaN, as before.
#[inline(always)]
fn two_to(n: f32) -> f32 {
    const SHIFTER: f32 = 12_582_912.0; // 1.5 * 2^23
    let low = (n + SHIFTER).to_bits().wrapping_sub(SHIFTER.to_bits());
    f32::from_bits(low.wrapping_add(127) << 23)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn exp_avx2(x: __m256) -> __m256 {
    // max then min, as f32::clamp: the same result for every non-NaN x
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let neg_n = _mm256_sub_ps(_mm256_setzero_ps(), n);
    let r = _mm256_fmadd_ps(
        neg_n,
        _mm256_set1_ps(LN2_LO),
        _mm256_fmadd_ps(neg_n, _mm256_set1_ps(LN2_HI), x),
    );
    let mut p = _mm256_set1_ps(C[6]);
    for c in C[..6].iter().rev() {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_close_to_libm() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = f64::from(x).exp();
            let rel = ((f64::from(exp(x)) - want) / want).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        // Taylor truncation < 2^-23 plus ~8 roundings of 2^-24 each
        assert!(worst < 6e-7, "worst relative error {worst}");
    }

    #[test]
    fn two_to_is_the_exponent_for_every_whole_n_exp_makes() {
        for n in -126..=127 {
            let want = f32::from_bits(((n + 127) as u32) << 23);
            assert_eq!(two_to(n as f32).to_bits(), want.to_bits(), "n = {n}");
        }
        assert!(exp(f32::NAN).is_nan());
    }
}
