//! The int8 path's accuracy: the activation rule (`|x - d q| <= ρ d`, `q` in [-127, 127]) and
//! the derived bound on `|y - x @ W.T|` against a float64 reference of the dequantised weights
//! times the unquantised `x` (the derivation is the "Error bound" section of `kvpark_cpu_ops::int8`).

mod support;

use kvpark_cpu_ops::{matmul_i8, I8Kernel, I8Scratch, BLOCK};
use proptest::prelude::*;
use support::{activations, matrix, Matrix, FINITE_STYLES, KINDS, STYLES};

/// The unit roundoff of f32.
const U: f64 = 1.0 / (1u64 << 24) as f64;
/// `|x - d q| <= RHO d`.
const RHO: f64 = 0.5 + 1.0 / 65536.0;

/// A block's `d` by the rule (0 where the block is too small to quantise), and its largest `|x|`.
fn block_scale(xb: &[f32]) -> (f32, f32) {
    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    (if d < f32::MIN_POSITIVE { 0.0 } else { d }, amax)
}

/// The bound of `kvpark_cpu_ops::int8` for row `xr` against column `c`, and the f64 reference.
fn bound(xr: &[f32], m: &Matrix, c: usize) -> (f64, f64) {
    let (k, blocks) = (m.k, m.k / BLOCK);
    let lane_updates = blocks.div_ceil(8) * if m.two_updates() { 2 } else { 1 };
    let n = (lane_updates + 4) as f64;
    let gamma = n * U / (1.0 - n * U);
    let (mut target, mut quantisation, mut magnitude, mut reference_error) = (0.0, 0.0, 0.0, 0.0);
    for b in 0..blocks {
        let xb = &xr[b * BLOCK..(b + 1) * BLOCK];
        let (d, amax) = block_scale(xb);
        let e = if d == 0.0 {
            f64::from(amax)
        } else {
            RHO * f64::from(d)
        };
        for (j, x) in xb.iter().enumerate() {
            let (s, q, o) = m.parts(c, b * BLOCK + j);
            let (w, x) = (s * q + o, f64::from(*x));
            target += w * x;
            quantisation += e * w.abs();
            magnitude += ((s * q).abs() + o.abs()) * (x.abs() + e);
            reference_error += w.abs() * x.abs();
        }
    }
    let floor =
        2f64.powi(-149) * (blocks as f64 * 32.0 * 128.0 * 128.0 + 8.0 * lane_updates as f64 + 8.0);
    // the reference's own rounding (the f64 weight, the products and the sum)
    let reference = 2.0 * (k + 2) as f64 * f64::EPSILON * reference_error;
    (target, quantisation + gamma * magnitude + floor + reference)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_error_is_within_the_derived_bound(
        rows in 1usize..10, n in 1usize..24, blocks in 1usize..40, kind in 0usize..KINDS.len(), seed: u64,
    ) {
        let k = blocks * BLOCK;
        let mut s = seed;
        let m = matrix(KINDS[kind], n, k, &mut s);
        let x = activations(rows, k, FINITE_STYLES, &mut s);
        let mut y = vec![0.0; rows * n];
        matmul_i8(&x, rows, m.view(), &mut y, I8Kernel::best(), &mut I8Scratch::new()).unwrap();
        for r in 0..rows {
            for c in 0..n {
                let (want, bound) = bound(&x[r * k..(r + 1) * k], &m, c);
                let got = f64::from(y[r * n + c]);
                prop_assert!((got - want).abs() <= bound, "{got} vs {want}: bound {bound}");
            }
        }
    }

    #[test]
    fn quantisation_keeps_each_value_within_half_a_step(
        rows in 1usize..6, blocks in 1usize..30, seed: u64,
    ) {
        let k = blocks * BLOCK;
        let mut s = seed;
        let x = activations(rows, k, STYLES, &mut s);
        for kernel in I8Kernel::available() {
            let mut scratch = I8Scratch::new();
            scratch.quantise(&x, rows, k, kernel).unwrap();
            for r in 0..rows {
                let row = scratch.row(r);
                for b in 0..blocks {
                    let xb = &x[r * k + b * BLOCK..r * k + (b + 1) * BLOCK];
                    let qb = &row.q[b * BLOCK..(b + 1) * BLOCK];
                    let (d, _) = block_scale(xb);
                    prop_assert_eq!(row.d[b].to_bits(), d.to_bits());
                    let sum: i32 = qb.iter().map(|q| i32::from(*q)).sum();
                    prop_assert_eq!(row.sum[b], sum as f32);
                    for (xi, qi) in xb.iter().zip(qb) {
                        prop_assert!((-127..=127).contains(qi));
                        let err = (f64::from(*xi) - f64::from(d) * f64::from(*qi)).abs();
                        // a block set to 0 is below 127 * 2^-126 in every value
                        let allowed = if d == 0.0 { 127.0 * f64::from(f32::MIN_POSITIVE) } else {
                            RHO * f64::from(d)
                        };
                        prop_assert!(err <= allowed, "{xi} as {qi} * {d}");
                    }
                }
            }
        }
    }
}

/// Ties go to even, a block's largest value to ±127, and an inf or NaN block to `d = NaN`.
#[test]
fn the_rounding_rule_at_its_edges() {
    let mut x = vec![0.0f32; 3 * BLOCK];
    // d = 127 / 127 = 1 and 1 / d = 1: each value is its own quotient
    x[..6].copy_from_slice(&[127.0, 2.5, 3.5, -2.5, -0.5, 0.49999997]);
    x[BLOCK] = -1e-37; // too small: d would be subnormal
    x[2 * BLOCK] = f32::INFINITY;
    x[2 * BLOCK + 1] = 5.0;
    for kernel in I8Kernel::available() {
        let mut scratch = I8Scratch::new();
        scratch.quantise(&x, 1, 3 * BLOCK, kernel).unwrap();
        let row = scratch.row(0);
        assert_eq!(&row.q[..6], &[127, 2, 4, -2, 0, 0], "{kernel:?}");
        assert_eq!((row.d[0], row.sum[0]), (1.0, 131.0));
        assert_eq!((row.d[1], row.q[BLOCK], row.sum[1]), (0.0, 0, 0.0));
        assert!(row.d[2].is_nan() && row.q[2 * BLOCK..].iter().all(|q| *q == 0));
        let flat: Vec<f32> = (0..3 * BLOCK)
            .map(|i| if i < BLOCK { -200.0 } else { 0.0 })
            .collect();
        scratch.quantise(&flat, 1, 3 * BLOCK, kernel).unwrap();
        assert!(scratch.row(0).q[..BLOCK].iter().all(|q| *q == -127));
    }
}
