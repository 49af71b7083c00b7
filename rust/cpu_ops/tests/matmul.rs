//! The block products against a float64 reference, and the SIMD path against the plain one bit
//! for bit, over random shapes, row counts and thread counts.

use kvpark_cpu_ops::{
    matmul_q4, matmul_q4_plain, matmul_q8, matmul_q8_plain, set_threads, Q4Weights, Q8Packing,
    Q8Weights, BLOCK,
};
use proptest::prelude::*;

struct Q4 {
    qs: Vec<u8>,
    scale: Vec<f32>,
    offset: Vec<f32>,
    n: usize,
    k: usize,
}

impl Q4 {
    fn view(&self) -> Q4Weights<'_> {
        Q4Weights {
            qs: &self.qs,
            scale: &self.scale,
            offset: &self.offset,
            n: self.n,
            k: self.k,
            packed: false,
        }
    }

    fn weight(&self, c: usize, i: usize) -> f64 {
        let (b, j) = (i / BLOCK, i % BLOCK);
        let at = c * self.k / BLOCK + b;
        let byte = self.qs[at * 16 + j % 16];
        let q = if j < 16 { byte & 0x0F } else { byte >> 4 };
        f64::from(self.scale[at]) * f64::from(q) + f64::from(self.offset[at])
    }
}

fn lcg(seed: &mut u64) -> u32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*seed >> 33) as u32
}

fn unit(seed: &mut u64) -> f32 {
    lcg(seed) as f32 / (1u64 << 31) as f32 * 2.0 - 1.0
}

fn q4(n: usize, k: usize, seed: &mut u64) -> Q4 {
    let blocks = n * k / BLOCK;
    Q4 {
        qs: (0..n * k / 2).map(|_| lcg(seed) as u8).collect(),
        scale: (0..blocks).map(|_| unit(seed) / 16.0).collect(),
        offset: (0..blocks).map(|_| unit(seed)).collect(),
        n,
        k,
    }
}

fn xs(rows: usize, k: usize, seed: &mut u64) -> Vec<f32> {
    (0..rows * k).map(|_| unit(seed)).collect()
}

/// A float32 sum of `n` products, in any order, is within `n * 2^-24 * sum |term|` of the exact sum
/// (the classic gamma bound; one more rounding for the dequantised weight itself); a fixed
/// tolerance fails on an unlucky cancellation.
fn within_rounding(got: f32, terms: &[f64]) -> bool {
    let want: f64 = terms.iter().sum();
    let magnitude: f64 = terms.iter().map(|t| t.abs()).sum();
    (f64::from(got) - want).abs()
        <= (terms.len() + 2) as f64 * f64::from(f32::EPSILON) / 2.0 * magnitude
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn q4_matches_reference_and_plain(
        rows in 1usize..20, n in 1usize..70, blocks in 1usize..6, threads in 1usize..4, seed: u64,
    ) {
        let k = blocks * BLOCK;
        let mut s = seed;
        let w = q4(n, k, &mut s);
        let x = xs(rows, k, &mut s);
        set_threads(threads);
        let mut y = vec![f32::NAN; rows * n];
        matmul_q4(&x, rows, w.view(), &mut y).unwrap();
        let mut plain = vec![f32::NAN; rows * n];
        matmul_q4_plain(&x, rows, w.view(), &mut plain).unwrap();
        for r in 0..rows {
            for c in 0..n {
                let terms: Vec<f64> = (0..k).map(|i| f64::from(x[r * k + i]) * w.weight(c, i)).collect();
                let got = y[r * n + c];
                prop_assert!(within_rounding(got, &terms), "{got} vs {:?}", terms.iter().sum::<f64>());
                prop_assert_eq!(got.to_bits(), plain[r * n + c].to_bits());
            }
        }
    }

    #[test]
    fn q8_matches_reference_and_plain(
        rows in 1usize..20, n in 1usize..70, blocks in 1usize..6, with_offset: bool, seed: u64,
    ) {
        let k = blocks * BLOCK;
        let mut s = seed;
        let qs: Vec<i8> = (0..n * k).map(|_| lcg(&mut s) as i8).collect();
        let scale: Vec<f32> = (0..n * k / BLOCK).map(|_| unit(&mut s) / 64.0).collect();
        let offset: Vec<f32> = (0..n * k / BLOCK).map(|_| unit(&mut s)).collect();
        let x = xs(rows, k, &mut s);
        let offset = with_offset.then_some(&offset[..]);
        let w = Q8Weights { qs: &qs, scale: &scale, offset, n, k, low: None, packed: Q8Packing::Rows };
        let mut y = vec![f32::NAN; rows * n];
        matmul_q8(&x, rows, w, &mut y).unwrap();
        let mut plain = vec![f32::NAN; rows * n];
        matmul_q8_plain(&x, rows, w, &mut plain).unwrap();
        for r in 0..rows {
            for c in 0..n {
                let terms: Vec<f64> = (0..k)
                    .map(|i| {
                        let at = c * k / BLOCK + i / BLOCK;
                        let o = offset.map_or(0.0, |o| f64::from(o[at]));
                        f64::from(x[r * k + i]) * (f64::from(scale[at]) * f64::from(qs[c * k + i]) + o)
                    })
                    .collect();
                let got = y[r * n + c];
                prop_assert!(within_rounding(got, &terms));
                prop_assert_eq!(got.to_bits(), plain[r * n + c].to_bits());
            }
        }
    }

    /// A row's result is the same bits whatever rows come with it and however many threads run.
    #[test]
    fn rows_are_independent(rows in 2usize..20, pick in 0usize..20, threads in 1usize..4, seed: u64) {
        let (n, k) = (300, 4 * BLOCK); // big enough to use the worker threads
        let mut s = seed;
        let w = q4(n, k, &mut s);
        let x = xs(rows, k, &mut s);
        let r = pick % rows;
        set_threads(threads);
        let mut all = vec![0.0; rows * n];
        matmul_q4(&x, rows, w.view(), &mut all).unwrap();
        set_threads(1);
        let mut alone = vec![0.0; n];
        matmul_q4(&x[r * k..(r + 1) * k], 1, w.view(), &mut alone).unwrap();
        for c in 0..n {
            prop_assert_eq!(all[r * n + c].to_bits(), alone[c].to_bits());
        }
    }
}

#[test]
fn shapes_are_checked() {
    let mut s = 1;
    let w = q4(4, 64, &mut s);
    let x = vec![0.0; 64];
    let mut y = vec![0.0; 3];
    assert!(matmul_q4(&x, 1, w.view(), &mut y)
        .unwrap_err()
        .0
        .contains("y has 3"));
    let mut y = vec![0.0; 4];
    assert!(matmul_q4(&x[..32], 1, w.view(), &mut y).is_err());
    let bad = Q4Weights { k: 48, ..w.view() };
    assert!(matmul_q4(&x, 1, bad, &mut y)
        .unwrap_err()
        .0
        .contains("multiple of 32"));
}

/// The f32 path multiplies by exactly the dequantised weights, `fma(scale, q, offset)` in f32:
/// one-hot rows of `x` read them back.
#[test]
fn one_hot_rows_read_back_the_dequantised_weights() {
    let (n, k) = (5, 3 * BLOCK);
    let mut s = 7;
    let mut x = vec![0.0f32; k * k];
    for i in 0..k {
        x[i * k + i] = 1.0;
    }
    let w4 = q4(n, k, &mut s);
    let qs: Vec<i8> = (0..n * k).map(|_| lcg(&mut s) as i8).collect();
    let scale: Vec<f32> = (0..n * k / BLOCK).map(|_| unit(&mut s) / 64.0).collect();
    let offset: Vec<f32> = (0..n * k / BLOCK).map(|_| unit(&mut s)).collect();
    for with_offset in [false, true] {
        let offset = with_offset.then_some(&offset[..]);
        let w8 = Q8Weights {
            qs: &qs,
            scale: &scale,
            offset,
            n,
            k,
            low: None,
            packed: Q8Packing::Rows,
        };
        let (mut y4, mut y8) = (vec![0.0; k * n], vec![0.0; k * n]);
        let (mut p4, mut p8) = (vec![0.0; k * n], vec![0.0; k * n]);
        matmul_q4(&x, k, w4.view(), &mut y4).unwrap();
        matmul_q4_plain(&x, k, w4.view(), &mut p4).unwrap();
        matmul_q8(&x, k, w8, &mut y8).unwrap();
        matmul_q8_plain(&x, k, w8, &mut p8).unwrap();
        for c in 0..n {
            for i in 0..k {
                let at = c * k / BLOCK + i / BLOCK;
                let byte = w4.qs[at * 16 + i % 16];
                let nibble = if i % BLOCK < 16 {
                    byte & 0x0F
                } else {
                    byte >> 4
                };
                let want4 = w4.scale[at].mul_add(f32::from(nibble), w4.offset[at]);
                let o = offset.map_or(0.0, |o| o[at]);
                let want8 = scale[at].mul_add(f32::from(qs[c * k + i]), o);
                assert_eq!((y4[i * n + c], p4[i * n + c]), (want4, want4));
                assert_eq!((y8[i * n + c], p8[i * n + c]), (want8, want8));
            }
        }
    }
}
