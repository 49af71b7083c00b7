//! A fused matrix multiplied as its parts in one split (`matmul_i8_parts`): each part's columns
//! bit for bit what the part alone gives, whatever the kinds mixed, the rows (one, a tile, past
//! a chunk), the kernel or the threads; and the shapes it refuses.

mod support;

use kvpark_cpu_ops::{
    matmul_i8, matmul_i8_parts, set_threads, DenseValues, DenseWeights, I8Kernel, I8Scratch,
    Weights, BLOCK,
};
use support::{activations, matrix, same, Kind, STYLES};

/// `parts` one at a time, each row's columns placed after the parts before.
fn one_by_one(x: &[f32], rows: usize, parts: &[Weights<'_>], kernel: I8Kernel) -> Vec<f32> {
    let width: usize = parts.iter().map(|w| w.n()).sum();
    let mut y = vec![f32::NAN; rows * width];
    let mut col = 0;
    for w in parts {
        let n = w.n();
        let mut part = vec![f32::NAN; rows * n];
        matmul_i8(x, rows, *w, &mut part, kernel, &mut I8Scratch::new()).unwrap();
        for r in 0..rows {
            y[r * width + col..r * width + col + n].copy_from_slice(&part[r * n..(r + 1) * n]);
        }
        col += n;
    }
    y
}

#[test]
fn parts_in_one_split_give_each_part_s_bits() {
    let mut s = 41;
    // k = 8192: 64 rows a chunk, so 65 rows take two
    for (k, row_counts) in [(18 * BLOCK, &[1, 2, 5, 8][..]), (256 * BLOCK, &[8, 65][..])] {
        // Q, K and V of a Q4_K_M file (packed 4-bit, narrow q8, q6), then gate and up of kinds
        // a part of any width may take: 16 (one chunk), 40 (a short last chunk), 48
        let shapes = [
            (Kind::Q4, 32, true),
            (Kind::Q5, 16, true),
            (Kind::Q6K, 48, true),
            (Kind::Q8, 40, false),
            (Kind::Q6, 16, false),
            (Kind::Q4Signed, 48, false),
        ];
        let matrices: Vec<_> = shapes
            .iter()
            .map(|&(kind, n, packed)| {
                let m = matrix(kind, n, k, &mut s);
                if packed {
                    m.packed()
                } else {
                    m
                }
            })
            .collect();
        let parts: Vec<Weights<'_>> = matrices.iter().map(|m| m.view()).collect();
        let width: usize = parts.iter().map(|w| w.n()).sum();
        for &rows in row_counts {
            let x = activations(rows, k, STYLES, &mut s);
            for kernel in I8Kernel::available() {
                let want = one_by_one(&x, rows, &parts, kernel);
                for threads in [1, 2] {
                    set_threads(threads);
                    let (mut scratch, mut buf) = (I8Scratch::new(), Vec::new());
                    let mut y = vec![f32::NAN; rows * width];
                    matmul_i8_parts(&x, rows, &parts, &mut y, kernel, &mut scratch, &mut buf)
                        .unwrap();
                    for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                        let at = (k, rows, kernel, threads);
                        assert!(same(*a, *b), "{at:?} output {i}: {a} vs {b}");
                    }
                }
            }
        }
    }
    set_threads(1);
}

#[test]
fn parts_that_cannot_share_rows_are_refused() {
    let mut s = 43;
    let k = 4 * BLOCK;
    let (a, b) = (
        matrix(Kind::Q8, 16, k, &mut s),
        matrix(Kind::Q4, 16, 2 * k, &mut s),
    );
    let x = vec![0.5f32; 2 * k];
    let go = |parts: &[Weights<'_>], y: &mut [f32]| {
        let (mut scratch, mut buf) = (I8Scratch::new(), Vec::new());
        matmul_i8_parts(&x, 2, parts, y, I8Kernel::Plain, &mut scratch, &mut buf)
    };
    let err = go(&[a.view(), b.view()], &mut [0.0; 64]).unwrap_err();
    assert!(err.0.contains("inputs"), "{}", err.0);
    let err = go(&[a.view()], &mut [0.0; 31]).unwrap_err();
    assert!(err.0.contains("outputs"), "{}", err.0);
    let values = vec![0.0f32; 16 * k];
    let dense = Weights::Dense(DenseWeights {
        values: DenseValues::F32(&values),
        n: 16,
        k,
    });
    let err = go(&[a.view(), dense], &mut [0.0; 64]).unwrap_err();
    assert!(err.0.contains("dense"), "{}", err.0);
    assert!(go(&[], &mut []).is_err());
    // the same parts and shapes multiply
    let mut y = [f32::NAN; 64];
    go(&[a.view(), a.view()], &mut y).unwrap();
    assert!(y.iter().all(|v| v.is_finite()));
}
