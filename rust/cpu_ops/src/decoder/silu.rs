//! `silu(gate) * up` over a row of the MLP, with an exp of our own so that the AVX2 path and the
//! portable one give the same bits (libm's `expf` is scalar: at 8 rows a decode step computes
//! ~370,000 of them, ~2 ms, as much as the attention).
//!
//! exp(x): `n = round(x · log2 e)` (ties to even), `r = x − n·ln2` in two FMAs (Cody-Waite with
//! ln2 split into a high part exact in f32 and a low part), `e^r` by the degree-6 Taylor
//! polynomial in Horner form (six FMAs; |r| ≤ ln2/2 so the truncation is below 2^-23 relative),
//! then scaled by `2^n` through the exponent bits. `x` is clamped to [-87, 88] first, so `n` stays
//! in the normal range; below −87 the result is ~1.6e-38 instead of smaller, which leaves
//! `silu(g) = g / (1 + e^{−g})` unchanged for g > 87 (1 + e^{−g} rounds to 1 either way) and gives
//! −0 … −1e-36 for g < −88 where the true value is just as negligible. Both paths do exactly these
//! operations in this order (`f32::mul_add` and `_mm256_fmadd_ps` are both one rounding; division
//! is correctly rounded in both), so they agree bitwise; `tests` checks it.

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
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `out[i] = silu(gate[i]) * up[i]` on the portable path.
pub(crate) fn silu_mul_plain(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = *g / (1.0 + exp(-*g)) * *u;
    }
}

/// `out[i] = silu(gate[i]) * up[i]`, AVX2 where [`crate::isa::avx2`] allows it.
pub(crate) fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    if crate::isa::avx2() {
        // SAFETY: AVX2 and FMA are present (isa::avx2).
        unsafe { silu_mul_avx2(gate, up, out) };
        return;
    }
    silu_mul_plain(gate, up, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let whole = gate.len() / 8 * 8;
    let one = _mm256_set1_ps(1.0);
    for i in (0..whole).step_by(8) {
        let g = _mm256_loadu_ps(gate.as_ptr().add(i));
        let u = _mm256_loadu_ps(up.as_ptr().add(i));
        let e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
        let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
    }
    silu_mul_plain(&gate[whole..], &up[whole..], &mut out[whole..]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_avx2(x: __m256) -> __m256 {
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
    fn both_paths_give_the_same_bits() {
        let mut s = 12345u64;
        let mut values = vec![
            0.0f32, -0.0, 1e-30, -1e-30, 87.5, -87.5, 100.0, -100.0, 88.7, -103.0,
        ];
        for _ in 0..4000 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            values.push(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 60.0);
        }
        let up: Vec<f32> = values.iter().map(|v| 1.5 - v * 0.25).collect();
        let (mut a, mut b) = (vec![0.0; values.len()], vec![0.0; values.len()]);
        silu_mul(&values, &up, &mut a);
        silu_mul_plain(&values, &up, &mut b);
        for i in 0..values.len() {
            assert_eq!(
                a[i].to_bits(),
                b[i].to_bits(),
                "silu({}) differs",
                values[i]
            );
            let g = f64::from(values[i]);
            let want = g / (1.0 + (-g).exp()) * f64::from(up[i]);
            assert!(
                (f64::from(a[i]) - want).abs() <= 2e-6 * want.abs() + 1e-30,
                "{} vs {want}",
                a[i]
            );
        }
    }
}
