//! The f32 product of Q6 weights (GGUF's Q6_K unpacked: int8 `q - 32`, a scale per 16): within
//! the derived bound of a float64 product of the dequantised weights, the SIMD path bitwise the
//! plain one, a row's bits independent of the other rows and the threads, and the expanded
//! weights bitwise `scale * q`. The int8 path's Q6 checks are in `int8.rs` and `int8_bound.rs`
//! (`support::Kind::Q6` is one of their kinds).

mod support;

use kvpark_cpu_ops::{matmul_q6, matmul_q6_plain, set_threads, Q6Weights, BLOCK, Q6_GROUP};
use proptest::prelude::*;
use support::{lcg, unit};

/// A Q6_K-like matrix: quants in [-32, 31], each scale `d * sc` with `d` an f16 value (11
/// significant bits) and `sc` in [-128, 127], so every `scale * q` is exact in f32 as in a file.
struct Q6 {
    qs: Vec<i8>,
    scale: Vec<f32>,
    n: usize,
    k: usize,
}

impl Q6 {
    fn view(&self) -> Q6Weights<'_> {
        Q6Weights {
            qs: &self.qs,
            scale: &self.scale,
            n: self.n,
            k: self.k,
            low: None,
            packed: false,
        }
    }

    fn weight(&self, c: usize, i: usize) -> f64 {
        let at = c * self.k + i;
        f64::from(self.scale[at / Q6_GROUP]) * f64::from(self.qs[at])
    }
}

fn q6(n: usize, k: usize, seed: &mut u64) -> Q6 {
    let scale = (0..n * k / Q6_GROUP)
        .map(|_| {
            // an f16's significand and a small exponent, times a signed 8-bit scale
            let d = (1024 + lcg(seed) % 1024) as f32 * 2f32.powi(-((lcg(seed) % 8) as i32) - 20);
            d * f32::from(lcg(seed) as u8 as i8)
        })
        .collect();
    Q6 {
        qs: (0..n * k).map(|_| (lcg(seed) % 64) as i8 - 32).collect(),
        scale,
        n,
        k,
    }
}

fn xs(rows: usize, k: usize, seed: &mut u64) -> Vec<f32> {
    (0..rows * k).map(|_| unit(seed) * 4.0).collect()
}

fn product(x: &[f32], rows: usize, w: &Q6, plain: bool) -> Vec<f32> {
    let mut y = vec![f32::NAN; rows * w.n];
    let f = if plain { matmul_q6_plain } else { matmul_q6 };
    f(x, rows, w.view(), &mut y).expect("shapes fit");
    y
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

/// The f32 path's bound: each weight is exact, each lane of the eight takes `k / 8` FMAs (four
/// per block) and the tree three adds, so a term meets at most `k / 8 + 3` roundings:
/// `γ_{k/8+3} Σ|w_i x_i|`, plus `(k + 7) 2^-149` for roundings in the subnormal range, plus the
/// float64 reference's own rounding (`2 (k + 1) ε64 Σ|w_i x_i|`).
fn bound(x: &[f32], w: &Q6, c: usize) -> f64 {
    let u = 2f64.powi(-24);
    let n = (w.k / 8 + 3) as f64;
    let gamma = n * u / (1.0 - n * u);
    let abs: f64 = (0..w.k)
        .map(|i| (w.weight(c, i) * f64::from(x[i])).abs())
        .sum();
    let reference = 2.0 * (w.k + 1) as f64 * f64::EPSILON * abs;
    gamma * abs + (w.k + 7) as f64 * 2f64.powi(-149) + reference
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn q6_is_within_the_bound_and_the_plain_bits(
        rows in 1usize..20, n in 1usize..70, blocks in 1usize..12, threads in 1usize..4, seed: u64,
    ) {
        let k = blocks * BLOCK;
        let mut s = seed;
        let w = q6(n, k, &mut s);
        let x = xs(rows, k, &mut s);
        set_threads(threads);
        let y = product(&x, rows, &w, false);
        let plain = product(&x, rows, &w, true);
        prop_assert_eq!(bits(&y), bits(&plain));
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            for c in 0..n {
                let exact: f64 = (0..k).map(|i| w.weight(c, i) * f64::from(xr[i])).sum();
                let err = (f64::from(y[r * n + c]) - exact).abs();
                prop_assert!(err <= bound(xr, &w, c), "row {r} column {c}: {err}");
            }
        }
    }

    /// A row's result is the same bits whatever rows come with it and however many threads run.
    #[test]
    fn q6_rows_are_independent(rows in 2usize..20, pick in 0usize..20, threads in 1usize..4, seed: u64) {
        let (n, k) = (300, 5 * BLOCK); // big enough to use the worker threads
        let mut s = seed;
        let w = q6(n, k, &mut s);
        let x = xs(rows, k, &mut s);
        let r = pick % rows;
        set_threads(threads);
        let all = product(&x, rows, &w, false);
        set_threads(1);
        let alone = product(&x[r * k..(r + 1) * k], 1, &w, false);
        prop_assert_eq!(bits(&all[r * n..(r + 1) * n]), bits(&alone));
    }
}

/// One-hot rows of `x` read back the expanded weights: bitwise `scale * q` (a zero weight's sign
/// included, as `gguf`'s dequantisation gives it), on both paths.
#[test]
fn one_hot_rows_read_back_the_dequantised_weights() {
    let (n, k) = (5, 3 * BLOCK);
    let mut s = 11;
    let w = q6(n, k, &mut s);
    let mut x = vec![0.0f32; k * k];
    for i in 0..k {
        x[i * k + i] = 1.0;
    }
    for plain in [false, true] {
        let y = product(&x, k, &w, plain);
        for c in 0..n {
            for i in 0..k {
                let at = c * k + i;
                let want = w.scale[at / Q6_GROUP] * f32::from(w.qs[at]);
                // x = 1 times the weight, plus +0 lanes: -0.0 comes back as +0.0
                let got = y[i * n + c];
                assert!(
                    got == want,
                    "plain {plain} column {c} weight {i}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn q6_shapes_are_checked() {
    let mut s = 1;
    let w = q6(4, 64, &mut s);
    let x = vec![0.0; 64];
    let mut y = vec![0.0; 4];
    let short = Q6Weights {
        scale: &w.scale[1..],
        ..w.view()
    };
    let err = matmul_q6(&x, 1, short, &mut y).unwrap_err();
    assert!(err.0.contains("scale has 15"), "{err}");
    let bad = Q6Weights { k: 48, ..w.view() };
    assert!(matmul_q6(&x, 1, bad, &mut y)
        .unwrap_err()
        .0
        .contains("multiple of 32"));
}
