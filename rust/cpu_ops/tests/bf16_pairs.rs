//! BF16 matrices by bf16 activations (`dense/bf16_pairs.rs`): the activations' rounding, the
//! CPU's `vdpbf16ps` against the definition bit for bit (where the CPU has it, subnormal inputs
//! and results included), each row's bits independent of the other rows and the threads, and
//! the result within the derived bound of a float64 product of the rounded activations.

mod support;

use kvpark_cpu_ops::decoder::bf16_bits;
use kvpark_cpu_ops::{
    matmul_bf16_pairs, round_bf16, set_threads, DenseValues, DenseWeights, PairKernel,
};
use proptest::prelude::*;
use support::{lcg, unit};

fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// `n` columns of `k` bf16 weights over several binades (times `scale`).
fn weights(n: usize, k: usize, scale: f32, seed: &mut u64) -> Vec<u16> {
    (0..n * k)
        .map(|_| bf16_bits(unit(seed) * scale * 2f32.powi((lcg(seed) % 8) as i32 - 4)))
        .collect()
}

fn xs(rows: usize, k: usize, scale: f32, seed: &mut u64) -> Vec<f32> {
    (0..rows * k).map(|_| unit(seed) * 4.0 * scale).collect()
}

fn product(x: &[f32], rows: usize, w: &[u16], n: usize, k: usize, kernel: PairKernel) -> Vec<f32> {
    let view = DenseWeights {
        values: DenseValues::Bf16(w),
        n,
        k,
    };
    let mut y = vec![f32::NAN; rows * n];
    matmul_bf16_pairs(x, rows, view, &mut y, kernel).expect("shapes fit");
    y
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn an_activation_rounds_to_the_nearest_bf16_ties_to_even() {
    let mut seed = 5;
    for _ in 0..200_000 {
        let x = f32::from_bits(lcg(&mut seed) ^ (lcg(&mut seed) << 16));
        let r = round_bf16(x);
        if x.is_nan() {
            assert!(widen(r).is_nan(), "{x:e}");
        } else if x.is_subnormal() || x == 0.0 {
            assert_eq!(widen(r).to_bits(), 0.0f32.copysign(x).to_bits(), "{x:e}");
        } else {
            // the two bf16 values either side of x, and which of them is nearer (ties: even)
            let down = (x.to_bits() >> 16) as u16;
            // past the largest bf16, the next value is 2^128 as if the exponents went on
            let next = |b: u16| match f64::from(widen(b)) {
                v if v.is_infinite() => v.signum() * 2f64.powi(128),
                v => v,
            };
            let (lo, hi) = (f64::from(widen(down)), next(down + 1));
            let (d_lo, d_hi) = ((f64::from(x) - lo).abs(), (hi - f64::from(x)).abs());
            let nearest = if d_lo < d_hi || (d_lo == d_hi && down.is_multiple_of(2)) {
                down
            } else {
                down + 1
            };
            assert_eq!(r, nearest, "{x:e}");
            if widen(r).is_finite() {
                let rel = (f64::from(widen(r)) - f64::from(x)).abs() / f64::from(x).abs();
                assert!(rel <= 2f64.powi(-8), "{x:e}: {rel}");
            }
        }
    }
    assert_eq!(round_bf16(f32::INFINITY), 0x7f80);
    assert_eq!(round_bf16(f32::MAX), 0x7f80); // past the largest bf16: infinity
}

/// Where the CPU runs `vdpbf16ps`, its products are the plain definition's bits: at the scales
/// of a model, and where the products and the lane sums fall among the subnormals (which the
/// instruction reads as zero and flushes), every tile of rows and group of columns.
#[test]
fn every_kernel_gives_the_plain_bits_subnormals_included() {
    let mut seed = 17;
    for (wscale, xscale) in [
        (1.0, 1.0),
        (2f32.powi(-60), 2f32.powi(-66)),
        (2f32.powi(-124), 1.0),
    ] {
        for (n, k, rows) in [
            (9, 32, 1),
            (13, 64, 3),
            (70, 576, 8),
            (66, 1536, 5),
            (130, 576, 37),
        ] {
            let w = weights(n, k, wscale, &mut seed);
            let x = xs(rows, k, xscale, &mut seed);
            let plain = product(&x, rows, &w, n, k, PairKernel::Plain);
            for kernel in PairKernel::available() {
                let y = product(&x, rows, &w, n, k, kernel);
                assert_eq!(bits(&y), bits(&plain), "{kernel:?} {n}x{k}, {rows} rows");
            }
        }
    }
}

#[test]
fn a_rows_bits_depend_on_neither_the_other_rows_nor_the_threads() {
    let mut seed = 23;
    let (n, k, rows) = (300, 576, 19);
    let w = weights(n, k, 1.0, &mut seed);
    let x = xs(rows, k, 1.0, &mut seed);
    for kernel in PairKernel::available() {
        set_threads(1);
        let one = product(&x, rows, &w, n, k, kernel);
        set_threads(2);
        let two = product(&x, rows, &w, n, k, kernel);
        set_threads(1);
        assert_eq!(bits(&one), bits(&two), "{kernel:?}");
        for r in [0, 7, 8, rows - 1] {
            let alone = product(&x[r * k..(r + 1) * k], 1, &w, n, k, kernel);
            assert_eq!(
                bits(&alone),
                bits(&one[r * n..(r + 1) * n]),
                "{kernel:?} row {r}"
            );
        }
    }
}

#[test]
fn other_matrices_and_shapes_are_refused() {
    let x = vec![1.0f32; 48];
    let mut y = vec![0.0f32; 2];
    let f32s = vec![0.5f32; 96];
    let dense = DenseWeights {
        values: DenseValues::F32(&f32s),
        n: 2,
        k: 48,
    };
    assert!(matmul_bf16_pairs(&x, 1, dense, &mut y, PairKernel::Plain).is_err());
    let tail = vec![bf16_bits(0.5); 96];
    let short = DenseWeights {
        values: DenseValues::Bf16(&tail),
        n: 2,
        k: 48,
    };
    let err = matmul_bf16_pairs(&x, 1, short, &mut y, PairKernel::Plain).unwrap_err();
    assert!(err.0.contains("multiple of 32"), "{}", err.0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// `γ_{m+4} Σ|w_i x̃_i| + (k + 15) 2^-126` about the float64 product of the rounded
    /// activations `x̃` (`m = k / 16` updates a lane; a flushed subnormal loses under `2^-126`).
    #[test]
    fn the_product_is_within_the_bound_of_the_rounded_activations(
        n in 1usize..10,
        chunks in 1usize..8,
        rows in 1usize..12,
        seed in any::<u64>(),
    ) {
        let mut seed = seed;
        let k = 32 * chunks;
        let w = weights(n, k, 1.0, &mut seed);
        let x = xs(rows, k, 1.0, &mut seed);
        let y = product(&x, rows, &w, n, k, PairKernel::best());
        let u = 2f64.powi(-24);
        let m = (k / 16 + 4) as f64;
        let gamma = m * u / (1.0 - m * u);
        for r in 0..rows {
            let xr: Vec<f64> = x[r * k..(r + 1) * k]
                .iter()
                .map(|v| f64::from(widen(round_bf16(*v))))
                .collect();
            for c in 0..n {
                let terms = (0..k).map(|i| f64::from(widen(w[c * k + i])) * xr[i]);
                let (exact, abs) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                let err = (f64::from(y[r * n + c]) - exact).abs();
                let bound = gamma * abs + (k + 15) as f64 * 2f64.powi(-126);
                prop_assert!(err <= bound, "row {r} column {c}: {err} > {bound}");
            }
        }
    }
}
