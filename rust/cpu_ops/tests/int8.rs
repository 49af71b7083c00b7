//! The int8 products: every kernel this CPU runs gives the plain kernel's bits (awkward values
//! included), a row's result never depends on the other rows or the thread count, and shapes
//! are checked. Run with `KVPARK_CPU_ISA=avx2` or `plain` to test with fewer kernels.

mod support;

use kvpark_cpu_ops::{
    matmul_i8, matmul_q4_i8, matmul_q6_i8, matmul_q8_i8, set_threads, I8Kernel, I8Scratch,
    Q4Weights, Q8Weights, Weights, BLOCK,
};
use proptest::prelude::*;
use support::{activations, matrix, same, Kind, KINDS, STYLES};

fn product(
    x: &[f32],
    rows: usize,
    w: Weights<'_>,
    kernel: I8Kernel,
    s: &mut I8Scratch,
) -> Vec<f32> {
    let mut y = vec![f32::NAN; rows * w.n()];
    matmul_i8(x, rows, w, &mut y, kernel, s).unwrap();
    y
}

#[test]
fn the_kernels_this_cpu_runs() {
    let kernels = I8Kernel::available();
    println!("int8 kernels here: {kernels:?}");
    assert_eq!(kernels[0], I8Kernel::Plain);
    assert_eq!(*kernels.last().unwrap(), I8Kernel::best());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Each kernel (and its quantiser) gives the plain bits, on one scratch reused across shapes.
    #[test]
    fn every_kernel_gives_the_plain_bits(
        rows in 1usize..18, n in 1usize..40, blocks in 1usize..80, kind in 0usize..KINDS.len(),
        threads in 1usize..4, seed: u64,
    ) {
        let k = blocks * BLOCK;
        let mut s = seed;
        let m = matrix(KINDS[kind], n, k, &mut s);
        let x = activations(rows, k, STYLES, &mut s);
        set_threads(threads);
        let mut scratch = I8Scratch::new();
        // an earlier, wider call leaves other values in the scratch's buffers
        scratch.quantise(&activations(rows + 1, k + 9 * BLOCK, STYLES, &mut s), rows + 1,
                         k + 9 * BLOCK, I8Kernel::Plain).unwrap();
        let plain = product(&x, rows, m.view(), I8Kernel::Plain, &mut scratch);
        let q_plain: Vec<_> = (0..rows).map(|r| {
            let row = scratch.row(r);
            (row.q.to_vec(), row.d.to_vec(), row.sum.to_vec())
        }).collect();
        // one row: the one-row kernel and the column kernel
        let paths = if rows == 1 { &[true, false][..] } else { &[true][..] };
        for (kernel, &one_row) in I8Kernel::available().into_iter().flat_map(|k| paths.iter().map(move |p| (k, p))) {
            scratch.set_one_row(one_row);
            let y = product(&x, rows, m.view(), kernel, &mut scratch);
            for (i, (a, b)) in y.iter().zip(&plain).enumerate() {
                prop_assert!(same(*a, *b), "{kernel:?} (one-row kernel {one_row}) output {i}: {a} vs plain {b}");
            }
            for (r, (q, d, sum)) in q_plain.iter().enumerate() {
                let row = scratch.row(r);
                prop_assert_eq!(&row.q, &&q[..]);
                prop_assert!(row.d.iter().zip(d).all(|(a, b)| same(*a, *b)));
                prop_assert_eq!(&row.sum, &&sum[..]);
            }
        }
    }

    /// A row's result is the same bits alone or among other rows, at any thread count.
    #[test]
    fn a_row_gives_the_same_bits_alone_or_among_others(
        rows in 2usize..20, pick in 0usize..20, kind in 0usize..KINDS.len(), threads in 1usize..4, seed: u64,
    ) {
        let (n, k) = (300, 9 * BLOCK); // big enough to use the worker threads
        let mut s = seed;
        let m = matrix(KINDS[kind], n, k, &mut s);
        let x = activations(rows, k, STYLES, &mut s);
        let r = pick % rows;
        for kernel in I8Kernel::available() {
            set_threads(threads);
            let all = product(&x, rows, m.view(), kernel, &mut I8Scratch::new());
            set_threads(1);
            let alone = product(&x[r * k..(r + 1) * k], 1, m.view(), kernel, &mut I8Scratch::new());
            for c in 0..n {
                prop_assert!(same(all[r * n + c], alone[c]), "{kernel:?} column {c}");
            }
        }
    }
}

/// Sixteen columns side by side (AVX-512 VNNI's `wide.rs`, from two rows) and eight (AVX2's
/// `wide_avx2.rs`: Q6 and narrow Q8 from two rows, Q8 from five; `side_by_side.rs` for Q4):
/// every kind, whole groups beside a tail of columns, tiles of four rows beside a remainder, a
/// block count that leaves the eight lanes uneven, a longer row after a shorter one (the
/// per-thread transposed group grows) and a shorter after it, and rows of 8192 (a 1B model's
/// down projection, past the 2048 AVX2's Q4 kernel once held): the plain bits, on one thread and
/// on three.
#[test]
fn sixteen_columns_side_by_side_give_the_plain_bits() {
    let mut s = 11;
    for kind in KINDS {
        for (rows, n, blocks) in [
            (2, 16, 1),
            (5, 53, 13),
            (7, 48, 65),
            (3, 33, 18),
            (9, 16, 7),
            (17, 29, 9),
            (16, 8, 48),
            (6, 16, 256),
        ] {
            let k = blocks * BLOCK;
            let m = matrix(kind, n, k, &mut s);
            let x = activations(rows, k, STYLES, &mut s);
            let mut scratch = I8Scratch::new();
            let plain = product(&x, rows, m.view(), I8Kernel::Plain, &mut scratch);
            for threads in [1, 3] {
                set_threads(threads);
                for kernel in I8Kernel::available() {
                    let y = product(&x, rows, m.view(), kernel, &mut scratch);
                    for (i, (a, b)) in y.iter().zip(&plain).enumerate() {
                        assert!(same(*a, *b), "{kind:?} {kernel:?} rows {rows} n {n} blocks {blocks} output {i}: {a} vs {b}");
                    }
                }
            }
        }
    }
}

/// A prompt whose activations pass `matmul_i8`'s row chunk (512 KiB: 64 rows at k = 8192) is
/// multiplied a chunk of rows at a time, the last here a single row: each row's plain bits as a
/// call of that row alone gives them, for every kind in the row layout and, where one exists,
/// packed, on one thread and on two.
#[test]
fn rows_past_a_chunk_give_the_plain_bits() {
    let mut s = 23;
    let (rows, n, k) = (65, 20, 256 * BLOCK);
    let x = activations(rows, k, STYLES, &mut s);
    let mut matrices = vec![];
    for kind in KINDS.into_iter().chain([Kind::Q6K, Kind::Q5K]) {
        let m = matrix(kind, n, k, &mut s);
        if !matches!(kind, Kind::Q8 | Kind::Q8Offset | Kind::Q6 | Kind::Q6Narrow) {
            let packed = matrix(kind, 32, k, &mut s).packed();
            matrices.push(packed);
        }
        matrices.push(m);
    }
    for m in &matrices {
        let mut scratch = I8Scratch::new();
        // the reference row by row: a call of one row is never chunked
        let plain: Vec<f32> = (0..rows)
            .flat_map(|r| {
                let row = &x[r * k..(r + 1) * k];
                product(row, 1, m.view(), I8Kernel::Plain, &mut scratch)
            })
            .collect();
        for threads in [1, 2] {
            set_threads(threads);
            for kernel in I8Kernel::available() {
                let y = product(&x, rows, m.view(), kernel, &mut scratch);
                for (i, (a, b)) in y.iter().zip(&plain).enumerate() {
                    let kind = (m.kind, m.packed);
                    assert!(same(*a, *b), "{kind:?} {kernel:?} output {i}: {a} vs {b}");
                }
            }
        }
    }
}

#[test]
fn the_short_forms_are_the_best_kernel() {
    let mut s = 3;
    for kind in KINDS {
        let m = matrix(kind, 70, 18 * BLOCK, &mut s);
        let x = activations(3, 18 * BLOCK, STYLES, &mut s);
        let want = product(&x, 3, m.view(), I8Kernel::best(), &mut I8Scratch::new());
        let mut y = vec![0.0; 3 * 70];
        match m.view() {
            Weights::Q4(w) => matmul_q4_i8(&x, 3, w, &mut y).unwrap(),
            Weights::Q8(w) => matmul_q8_i8(&x, 3, w, &mut y).unwrap(),
            Weights::Q6(w) => matmul_q6_i8(&x, 3, w, &mut y).unwrap(),
            Weights::Iq4(_) | Weights::Dense(_) => unreachable!("support::matrix makes neither"),
        }
        assert!(y.iter().zip(&want).all(|(a, b)| same(*a, *b)), "{kind:?}");
    }
}

/// An inf or NaN makes its own row NaN, and leaves the others alone.
#[test]
fn a_non_finite_activation_poisons_only_its_row() {
    let (n, k) = (20, 4 * BLOCK);
    let mut s = 5;
    for kind in KINDS {
        let m = matrix(kind, n, k, &mut s);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = activations(3, k, 1, &mut s);
            let clean = product(&x, 3, m.view(), I8Kernel::Plain, &mut I8Scratch::new());
            x[k + 77] = bad; // row 1
            for kernel in I8Kernel::available() {
                let y = product(&x, 3, m.view(), kernel, &mut I8Scratch::new());
                assert!(
                    y[n..2 * n].iter().all(|v| v.is_nan()),
                    "{kind:?} {kernel:?}"
                );
                for i in (0..n).chain(2 * n..3 * n) {
                    assert_eq!(y[i].to_bits(), clean[i].to_bits());
                }
            }
        }
    }
}

#[test]
fn shapes_are_checked() {
    let mut s = 1;
    let m = matrix(Kind::Q4, 4, 64, &mut s);
    let x = vec![0.0; 64];
    let Weights::Q4(w) = m.view() else {
        unreachable!()
    };
    let mut y = vec![0.0; 3];
    let err = matmul_q4_i8(&x, 1, w, &mut y).unwrap_err();
    assert!(err.0.contains("y has 3"), "{err}");
    let mut y = vec![0.0; 4];
    assert!(matmul_q4_i8(&x[..32], 1, w, &mut y).is_err());
    let bad = Q4Weights { k: 48, ..w };
    assert!(matmul_q4_i8(&x, 1, bad, &mut y)
        .unwrap_err()
        .0
        .contains("multiple of 32"));
    let m8 = matrix(Kind::Q8Offset, 4, 64, &mut s);
    let Weights::Q8(w8) = m8.view() else {
        unreachable!()
    };
    let offset = &w8.offset.unwrap()[1..];
    let short = Q8Weights {
        offset: Some(offset),
        ..w8
    };
    assert!(matmul_q8_i8(&x, 1, short, &mut y)
        .unwrap_err()
        .0
        .contains("offset has 7"));
    let mut scratch = I8Scratch::new();
    assert!(scratch.quantise(&x, 3, 32, I8Kernel::Plain).is_err());
    // a matrix of no output columns: nothing to write, for one row or a prompt's chunks
    let none = matrix(Kind::Q8, 0, 8192, &mut s);
    for rows in [1, 100] {
        let x = vec![0.5; rows * 8192];
        for kernel in I8Kernel::available() {
            assert!(matmul_i8(&x, rows, none.view(), &mut [], kernel, &mut scratch).is_ok());
        }
    }
}
