//! 4-bit and q6 matrices packed at load (`kvpark_cpu_ops::packed`): the layout is the documented one,
//! and every product (each int8 kernel this CPU runs, for one row and many, on one thread and
//! several; the f32 path, SIMD and portable) gives the row layout's bits from it.

mod support;

use kvpark_cpu_ops::{
    matmul_i8, matmul_q4, matmul_q4_plain, matmul_q6, pack_q4, set_threads, I8Kernel, I8Scratch,
    Q4Weights, Weights, BLOCK, PACK,
};
use proptest::prelude::*;
use support::{activations, matrix, same, Kind, STYLES};

fn int8(x: &[f32], rows: usize, w: Weights<'_>, kernel: I8Kernel) -> Vec<f32> {
    let mut y = vec![f32::NAN; rows * w.n()];
    matmul_i8(x, rows, w, &mut y, kernel, &mut I8Scratch::new()).unwrap();
    y
}

fn q4(w: Weights<'_>) -> Q4Weights<'_> {
    match w {
        Weights::Q4(w) => w,
        _ => unreachable!("a 4-bit matrix"),
    }
}

#[test]
fn the_layout_is_the_documented_one() {
    let (n, blocks) = (48, 3);
    let m = matrix(Kind::Q4, n, blocks * BLOCK, &mut 5);
    let p = m.packed();
    for c in 0..n {
        for b in 0..blocks {
            let (g, i) = (c / PACK, c % PACK);
            for q in 0..4 {
                let at = (((g * blocks + b) * 4 + q) * PACK + i) * 4;
                let from = (c * blocks + b) * 16 + 4 * q;
                assert_eq!(
                    p.qs[at..at + 4],
                    m.qs[from..from + 4],
                    "column {c} block {b}"
                );
            }
            let v = (g * blocks + b) * PACK + i;
            assert_eq!(p.scale[v], m.scale[c * blocks + b]);
            assert_eq!(
                p.offset.as_ref().unwrap()[v],
                m.offset.as_ref().unwrap()[c * blocks + b]
            );
        }
    }
}

#[test]
fn packing_refuses_what_it_cannot_pack() {
    let m = matrix(Kind::Q4, 24, 64, &mut 3);
    let (mut qs, mut v, mut o) = (vec![0; m.qs.len()], vec![0.0; 48], vec![0.0; 48]);
    // 24 columns: not whole groups of sixteen
    assert!(pack_q4(q4(m.view()), &mut qs, &mut v, &mut o).is_err());
    let m = matrix(Kind::Q4, 32, 64, &mut 3);
    let p = m.packed();
    let (mut qs, mut v, mut o) = (vec![0; m.qs.len()], vec![0.0; 64], vec![0.0; 64]);
    assert!(
        pack_q4(q4(p.view()), &mut qs, &mut v, &mut o).is_err(),
        "packed twice"
    );
    assert!(
        pack_q4(q4(m.view()), &mut qs[1..], &mut v, &mut o).is_err(),
        "a short output"
    );
    // a packed matrix of 24 columns is refused by the products
    let w = Q4Weights {
        n: 24,
        qs: &p.qs[..24 * 32],
        scale: &p.scale[..48],
        offset: &p.offset.as_ref().unwrap()[..48],
        ..q4(p.view())
    };
    let x = vec![0.5; 64];
    let mut y = vec![0.0; 24];
    let err = matmul_i8(
        &x,
        1,
        w.into(),
        &mut y,
        I8Kernel::Plain,
        &mut I8Scratch::new(),
    );
    assert!(err.unwrap_err().0.contains("multiple of 16"));
    assert!(matmul_q4(&x, 1, w, &mut y).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Each int8 kernel on the packed matrix gives the row layout's plain bits; so does the f32
    /// path (SIMD and portable) give its own row-layout bits.
    #[test]
    fn every_product_of_a_packed_matrix_gives_the_row_layouts_bits(
        rows in 1usize..18, groups in 1usize..5, blocks in 1usize..70, kind in 0usize..4,
        threads in 1usize..4, seed: u64,
    ) {
        let (n, k) = (groups * PACK, blocks * BLOCK);
        let mut s = seed;
        let kind = [Kind::Q4, Kind::Q4Signed, Kind::Q6, Kind::Q6Narrow][kind];
        let m = matrix(kind, n, k, &mut s);
        let p = m.packed();
        let x = activations(rows, k, STYLES, &mut s);
        set_threads(threads);
        let plain = int8(&x, rows, m.view(), I8Kernel::Plain);
        for kernel in I8Kernel::available() {
            let y = int8(&x, rows, p.view(), kernel);
            for (i, (a, b)) in y.iter().zip(&plain).enumerate() {
                prop_assert!(same(*a, *b), "{kind:?} {kernel:?} output {i}: {a} vs plain {b}");
            }
        }
        let finite: Vec<f32> = x.iter().map(|v| if v.is_finite() { *v } else { 0.0 }).collect();
        let f32_path = |w: Weights<'_>, simd: bool| {
            let mut y = vec![f32::NAN; rows * n];
            match (w, simd) {
                (Weights::Q4(w), true) => matmul_q4(&finite, rows, w, &mut y).unwrap(),
                (Weights::Q4(w), false) => matmul_q4_plain(&finite, rows, w, &mut y).unwrap(),
                (Weights::Q6(w), _) => matmul_q6(&finite, rows, w, &mut y).unwrap(),
                _ => unreachable!(),
            }
            y
        };
        for simd in [true, false] {
            let want = f32_path(m.view(), simd);
            let y = f32_path(p.view(), simd);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                prop_assert!(same(*a, *b), "{kind:?} f32 path (simd {simd}) output {i}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn the_q6_layout_is_the_documented_one() {
    let (n, blocks) = (32, 3);
    let m = matrix(Kind::Q6, n, blocks * BLOCK, &mut 9);
    let p = m.packed();
    for c in 0..n {
        for b in 0..blocks {
            let (g, i) = (c / PACK, c % PACK);
            // three blocks: lanes 0, 1, 2 hold one each, so position = block
            for q in 0..8 {
                let at = (((g * blocks + b) * 8 + q) * PACK + i) * 4;
                let from = (c * blocks + b) * 32 + 4 * q;
                assert_eq!(
                    p.qs[at..at + 4],
                    m.qs[from..from + 4],
                    "column {c} block {b}"
                );
            }
            for h in 0..2 {
                assert_eq!(
                    p.scale[((g * blocks + b) * 2 + h) * PACK + i],
                    m.scale[(c * blocks + b) * 2 + h]
                );
            }
        }
    }
}
