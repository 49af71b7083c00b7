//! `gelu_tanh(gate) * up` over a row of the MLP: Gemma's GeGLU, with gelu in its tanh form
//! (`0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`, torch's `gelu(approximate="tanh")`).
//!
//! tanh through the decoder's own exp ([`crate::exp::exp`]): `tanh(y) = 1 - 2 / (e^{2y} + 1)`,
//! exact in the limits (e^{2y} clamps at e^{±88}, giving ±1 to the last bit) and within a few
//! ulps elsewhere, the same bits on every CPU. Scalar: Gemma's MLPs are the only users, and at
//! one row a step this is a few microseconds beside the matmuls.

use crate::exp::exp;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const CUBIC: f32 = 0.044_715;

#[inline(always)]
pub(crate) fn tanh(y: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * y) + 1.0)
}

/// `out[i] = gelu_tanh(gate[i]) * up[i]`.
pub(crate) fn gelu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let inner = SQRT_2_OVER_PI * (g + CUBIC * g * g * g);
        *o = 0.5 * g * (1.0 + tanh(inner)) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_is_close_to_the_float64_formula() {
        let mut x = -12.0f32;
        let up = 1.25f32;
        while x < 12.0 {
            let (mut o, g) = ([0.0f32], f64::from(x));
            gelu_mul(&[x], &[up], &mut o);
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
            let want = 0.5 * g * (1.0 + inner.tanh()) * f64::from(up);
            // a few roundings of 2^-24 relative to the terms, which peak near |g| * up
            assert!(
                (f64::from(o[0]) - want).abs() <= 1e-6 * (g.abs() * 1.25 + 1e-3),
                "gelu({x}) = {} vs {want}",
                o[0]
            );
            x += 0.0173;
        }
    }

    #[test]
    fn tanh_saturates_exactly() {
        assert_eq!(tanh(50.0), 1.0);
        assert_eq!(tanh(-50.0), -1.0);
        assert_eq!(tanh(0.0), 0.0);
    }
}
