//! The dense products (f32, f16 and bf16 weights): every kernel against the plain one bit for
//! bit, each row's bits independent of the other rows and the threads, the result within the
//! derived bound of a float64 product, and every f16 and bf16 value widened exactly.

mod support;

use kvpark_cpu_ops::decoder::{bf16_bits, f16_bits};
use kvpark_cpu_ops::{
    matmul_dense, matmul_i8, set_threads, DenseKernel, DenseValues, DenseWeights, I8Kernel,
    I8Scratch,
};
use proptest::prelude::*;
use support::{lcg, unit};

/// A dense matrix in one of the three formats, owning its values.
enum Values {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Bf16(Vec<u16>),
}

struct Dense {
    values: Values,
    n: usize,
    k: usize,
}

impl Dense {
    fn view(&self) -> DenseWeights<'_> {
        let values = match &self.values {
            Values::F32(v) => DenseValues::F32(v),
            Values::F16(v) => DenseValues::F16(v),
            Values::Bf16(v) => DenseValues::Bf16(v),
        };
        DenseWeights {
            values,
            n: self.n,
            k: self.k,
        }
    }

    /// Weight `i` of column `c`, as a float64.
    fn weight(&self, c: usize, i: usize) -> f64 {
        let at = c * self.k + i;
        match &self.values {
            Values::F32(v) => f64::from(v[at]),
            Values::F16(v) => f16_value(v[at]),
            Values::Bf16(v) => f64::from(f32::from_bits(u32::from(v[at]) << 16)),
        }
    }
}

/// An f16's value from its fields, independently of the crate's conversion.
fn f16_value(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((h >> 10) & 0x1f), f64::from(h & 0x3ff));
    match e {
        0 => sign * m * 2f64.powi(-24),
        31 if m == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN,
        _ => sign * (1024.0 + m) * 2f64.powi(e - 25),
    }
}

/// Random weights of `format` (0 f32, 1 f16, 2 bf16), spread over several binades.
fn dense(format: u8, n: usize, k: usize, seed: &mut u64) -> Dense {
    let raw: Vec<f32> = (0..n * k)
        .map(|_| unit(seed) * 2f32.powi((lcg(seed) % 8) as i32 - 4))
        .collect();
    let values = match format {
        0 => Values::F32(raw),
        1 => Values::F16(raw.iter().map(|v| f16_bits(*v)).collect()),
        _ => Values::Bf16(raw.iter().map(|v| bf16_bits(*v)).collect()),
    };
    Dense { values, n, k }
}

fn xs(rows: usize, k: usize, seed: &mut u64) -> Vec<f32> {
    (0..rows * k).map(|_| unit(seed) * 4.0).collect()
}

fn product(x: &[f32], rows: usize, w: &Dense, kernel: DenseKernel) -> Vec<f32> {
    let mut y = vec![f32::NAN; rows * w.n];
    matmul_dense(x, rows, w.view(), &mut y, kernel).expect("shapes fit");
    y
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

/// `γ_{m+4} Σ|w_i x_i| + (k + 15) 2^-149`, `m = ⌈k / 16⌉` (the dense module's bound).
fn bound(x: &[f32], w: &Dense, c: usize) -> f64 {
    let u = 2f64.powi(-24);
    let n = (w.k.div_ceil(16) + 4) as f64;
    let gamma = n * u / (1.0 - n * u);
    let abs: f64 = (0..w.k)
        .map(|i| (w.weight(c, i) * f64::from(x[i])).abs())
        .sum();
    gamma * abs + (w.k + 15) as f64 * 2f64.powi(-149)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_kernel_gives_the_plain_bits_within_the_bound(
        format in 0u8..3,
        n in 1usize..14,
        k in 1usize..150,
        rows in 1usize..12,
        seed in any::<u64>(),
    ) {
        let mut seed = seed;
        let w = dense(format, n, k, &mut seed);
        let x = xs(rows, k, &mut seed);
        let plain = product(&x, rows, &w, DenseKernel::Plain);
        for kernel in DenseKernel::available() {
            prop_assert_eq!(bits(&product(&x, rows, &w, kernel)), bits(&plain), "{}", kernel.name());
        }
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            for c in 0..n {
                let exact: f64 = (0..k).map(|i| w.weight(c, i) * f64::from(xr[i])).sum();
                let err = (f64::from(plain[r * n + c]) - exact).abs();
                prop_assert!(err <= bound(xr, &w, c), "row {r} column {c}: {err}");
            }
        }
    }
}

/// Rows of whole chunks of 16 (no tail): the SIMD kernels reduce each group's lanes in
/// registers there, the plain kernel in scalar code; the same bits, every tile and group size.
#[test]
fn inputs_without_a_tail_give_the_plain_bits() {
    let mut seed = 3;
    for (n, k, rows) in [(9, 16, 1), (13, 64, 5), (40, 576, 8), (7, 160, 11)] {
        let x = xs(rows, k, &mut seed);
        for format in 0..3 {
            let w = dense(format, n, k, &mut seed);
            let plain = product(&x, rows, &w, DenseKernel::Plain);
            for kernel in DenseKernel::available() {
                assert_eq!(
                    bits(&product(&x, rows, &w, kernel)),
                    bits(&plain),
                    "{}",
                    kernel.name()
                );
            }
        }
    }
}

/// SIMD products of inputs without a tail read their rows aligned (in place, or copied once a
/// call), and prompt-sized ones (from 16 rows) pack each block of columns into aligned f32 first
/// (`dense/packed.rs`): the same bits as the plain kernel, and each row's bits those it has
/// alone (one row is never packed), across decode tiles (1 to 8 rows), packed tiles, groups of
/// fewer than four columns, blocks (576 inputs: 112 columns a block), thread splits, and rows
/// aligned in place or copied.
#[test]
fn aligned_and_packed_rows_give_the_plain_bits_and_each_rows_bits_alone() {
    let mut seed = 11;
    let decode = [(70, 576, 1), (9, 64, 3), (70, 576, 8), (66, 1536, 5)];
    let prompt = [(13, 64, 16), (6, 16, 23), (130, 576, 37), (230, 576, 17)];
    for (n, k, rows) in decode.into_iter().chain(prompt) {
        let x = xs(rows, k, &mut seed);
        for format in 0..3 {
            let w = dense(format, n, k, &mut seed);
            let plain = product(&x, rows, &w, DenseKernel::Plain);
            // the rows on a 64-byte boundary (read in place) and 4 bytes past one (copied)
            let mut buf = vec![0.0f32; x.len() + 32];
            let aligned = (16 - (buf.as_ptr() as usize / 4) % 16) % 16;
            for at in [aligned, aligned + 1] {
                buf[at..at + x.len()].copy_from_slice(&x);
                for kernel in DenseKernel::available() {
                    let y = product(&buf[at..at + x.len()], rows, &w, kernel);
                    assert_eq!(bits(&y), bits(&plain), "{} at {at}", kernel.name());
                }
            }
            for kernel in DenseKernel::available() {
                for threads in [1, 2] {
                    set_threads(threads);
                    let all = product(&x, rows, &w, kernel);
                    assert_eq!(bits(&all), bits(&plain), "{} {n}x{k}", kernel.name());
                }
                set_threads(1);
                for r in [0, rows / 2, rows - 1] {
                    let alone = product(&x[r * k..(r + 1) * k], 1, &w, kernel);
                    assert_eq!(bits(&alone), bits(&plain[r * n..(r + 1) * n]), "row {r}");
                }
            }
        }
    }
}

#[test]
fn a_rows_bits_depend_on_neither_the_other_rows_nor_the_threads() {
    let mut seed = 7;
    // columns enough for several chunks per thread, k with a tail of 5 past whole chunks of 16
    let (n, k, rows) = (300, 261, 11);
    let x = xs(rows, k, &mut seed);
    for format in 0..3 {
        let w = dense(format, n, k, &mut seed);
        for kernel in DenseKernel::available() {
            set_threads(1);
            let whole = product(&x, rows, &w, kernel);
            for threads in [2, 3] {
                set_threads(threads);
                assert_eq!(bits(&product(&x, rows, &w, kernel)), bits(&whole));
            }
            set_threads(1);
            for r in 0..rows {
                let alone = product(&x[r * k..(r + 1) * k], 1, &w, kernel);
                assert_eq!(bits(&alone), bits(&whole[r * n..(r + 1) * n]), "row {r}");
            }
            // the same rows inside a differently sized batch
            let tail = product(&x[3 * k..], rows - 3, &w, kernel);
            assert_eq!(bits(&tail), bits(&whole[3 * n..]));
        }
    }
}

/// Every 16-bit pattern as one weight of its own column (the others 0), times 1: the product is
/// the widened weight itself, so it checks each kernel's widening of every value.
fn every_pattern_widens_exactly(bf16: bool) {
    let k = 16;
    let n = 1 << 16;
    let mut v = vec![0u16; n * k];
    for c in 0..n {
        v[c * k + c % k] = c as u16;
    }
    let values = if bf16 {
        Values::Bf16(v)
    } else {
        Values::F16(v)
    };
    let w = Dense { values, n, k };
    for kernel in DenseKernel::available() {
        // one row per position: row j is the unit vector e_j
        let mut x = vec![0.0f32; k * k];
        (0..k).for_each(|j| x[j * k + j] = 1.0);
        let y = product(&x, k, &w, kernel);
        for c in 0..n {
            let got = y[(c % k) * n + c];
            let want = if bf16 {
                f64::from(f32::from_bits((c as u32) << 16))
            } else {
                f16_value(c as u16)
            };
            if want.is_nan() {
                assert!(got.is_nan(), "{} {c:#06x}", kernel.name());
            } else {
                // -0 comes out +0: the lanes start at +0
                assert_eq!(f64::from(got), want, "{} {c:#06x}", kernel.name());
                assert!(got != 0.0 || got.is_sign_positive());
            }
        }
    }
}

#[test]
fn every_f16_widens_exactly_subnormals_and_infinities_included() {
    every_pattern_widens_exactly(false);
    // and the f16 edges meet the products as their values: the smallest subnormal, the largest
    // finite, an infinity
    let w = Dense {
        values: Values::F16(vec![0x0001, 0x7BFF, 0x7C00, 0x0000]),
        n: 4,
        k: 1,
    };
    let y = product(&[2.0], 1, &w, DenseKernel::best());
    assert_eq!(y, [2f32.powi(-23), 131008.0, f32::INFINITY, 0.0]);
}

#[test]
fn every_bf16_widens_exactly() {
    every_pattern_widens_exactly(true);
}

#[test]
fn int8_activations_refuse_a_dense_matrix_and_shapes_are_checked() {
    let w = Dense {
        values: Values::F32(vec![1.0; 6]),
        n: 2,
        k: 3,
    };
    let x = [1.0f32; 3];
    let mut y = [0.0f32; 2];
    let kernel = I8Kernel::best();
    let refused = matmul_i8(
        &x,
        1,
        w.view().into(),
        &mut y,
        kernel,
        &mut I8Scratch::new(),
    );
    assert!(refused.unwrap_err().0.contains("dense"));
    assert!(matmul_dense(&x, 1, w.view(), &mut y, DenseKernel::Plain).is_ok());
    assert_eq!(y, [3.0, 3.0]);
    assert!(matmul_dense(&x[..2], 1, w.view(), &mut y, DenseKernel::Plain).is_err());
    let short = DenseWeights {
        values: DenseValues::F32(&[1.0; 5]),
        n: 2,
        k: 3,
    };
    assert!(matmul_dense(&x, 1, short, &mut y, DenseKernel::Plain).is_err());
}
