//! `silu(gate) * up` over a row of the MLP, through the crate's own exp (`crate::exp`), so
//! that the AVX2 path and the portable one give the same bits (libm's `expf` is scalar: at 8
//! rows a decode step computes ~370,000 of them, ~2 ms, as much as the attention). Both paths do
//! the same operations in the same order (division is correctly rounded in both).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::exp::exp;
#[cfg(target_arch = "x86_64")]
use crate::exp::exp_avx2;

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

#[cfg(test)]
mod tests {
    use super::*;

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
