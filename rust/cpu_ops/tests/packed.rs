//! 4-bit, q6 and q5 matrices packed at load (`kvpark_cpu_ops::packed`, `packed_q5`,
//! `packed_q5_blocks`): the layout is
//! the documented one,
//! and every product (each int8 kernel this CPU runs, for one row and many, on one thread and
//! several; the f32 path, SIMD and portable) gives the row layout's bits from it.

mod support;

use kvpark_cpu_ops::{
    matmul_i8, matmul_q4, matmul_q4_plain, matmul_q6, matmul_q8, pack_q4, pack_q5, pack_q5_blocks,
    pack_q6, q5_packed_lengths, q5b_packed_lengths, q6_packed_lengths, set_threads, I8Kernel,
    I8Scratch, Q4Weights, Q6Weights, Q8Packing, Q8Weights, Weights, BLOCK, PACK,
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
        rows in 1usize..18, groups in 1usize..5, blocks in 1usize..70, kind in 0usize..6,
        threads in 1usize..4, seed: u64,
    ) {
        let (n, k) = (groups * PACK, blocks * BLOCK);
        let mut s = seed;
        let kind = [Kind::Q4, Kind::Q4Signed, Kind::Q6K, Kind::Q5K, Kind::Q5, Kind::Q5Offset][kind];
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
                (Weights::Q8(w), _) => matmul_q8(&finite, rows, w, &mut y).unwrap(),
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
    let (n, blocks) = (32, 11); // two runs of SUPER blocks, the second short
    let mut seed = 9;
    let m = matrix(Kind::Q6K, n, blocks * BLOCK, &mut seed);
    let p = m.packed();
    let (qs_len, d_len) = q6_packed_lengths(n, blocks * BLOCK);
    assert_eq!((p.qs.len(), p.scale.len()), (qs_len, d_len));
    assert_eq!((qs_len, d_len), (n * blocks * 26, n * 2));
    // 11 blocks: lanes 0-2 hold two each (b, b + 8), lanes 3-7 one
    let position = |b: usize| {
        if b < 8 {
            2 * b.min(3) + b.saturating_sub(3)
        } else {
            2 * (b - 8) + 1
        }
    };
    for c in 0..n {
        let (g, i) = (c / PACK, c % PACK);
        for b in 0..blocks {
            let at = (g * blocks + position(b)) * 26 * PACK;
            for w in 0..BLOCK {
                let (t, e) = (w / 4, w % 4);
                let u = i32::from(m.qs[(c * blocks + b) * BLOCK + w] as i8) + 32;
                let low = p.qs[at + 64 * (t % 4) + 4 * i + e] >> (4 * (t / 4)) & 0x0f;
                let high = p.qs[at + 256 + 64 * (t % 2) + 4 * i + e] >> (2 * (t / 2)) & 3;
                assert_eq!(
                    i32::from(low | high << 4),
                    u,
                    "column {c} block {b} weight {w}"
                );
            }
            let d = p.scale[(g * 2 + b / 8) * PACK + i];
            for h in 0..2 {
                let sc = p.qs[at + 384 + 16 * h + i] as i8;
                let scale = m.scale[(c * blocks + b) * 2 + h];
                assert_eq!(
                    (d * f32::from(sc)).to_bits(),
                    scale.to_bits(),
                    "column {c} block {b}"
                );
            }
        }
    }
}

#[test]
fn q6_packing_refuses_what_it_cannot_hold() {
    let mut seed = 4;
    let m = matrix(Kind::Q6K, 16, 64, &mut seed);
    let (q, d) = q6_packed_lengths(16, 64);
    let pack = |qs: &[u8], scale: &[f32]| {
        let w = Q6Weights {
            // SAFETY: u8 and i8 have the same size and alignment, every bit pattern valid.
            qs: unsafe { std::slice::from_raw_parts(qs.as_ptr().cast(), qs.len()) },
            scale,
            n: 16,
            k: 64,
            low: None,
            packed: false,
        };
        pack_q6(w, &mut vec![0; q], &mut vec![0.0; d])
    };
    assert!(pack(&m.qs, &m.scale).is_ok());
    // a quant outside -32..32 (Q6 from no K-quant)
    let mut qs = m.qs.clone();
    qs[5] = 32;
    assert!(pack(&qs, &m.scale).unwrap_err().0.contains("-32..32"));
    // scales that no one f32 times int8s give
    let mut scale = m.scale.clone();
    scale[..4].copy_from_slice(&[1.0, 0.1, 0.3, 1e-3]);
    assert!(pack(&m.qs, &scale).unwrap_err().0.contains("int8"));
}

#[test]
fn the_q5_layout_is_the_documented_one() {
    let (n, blocks) = (32, 11); // two runs of eight blocks, the second short
    let m = matrix(Kind::Q5K, n, blocks * BLOCK, &mut 12);
    let p = m.packed();
    let (qs_len, d_len) = q5_packed_lengths(n, blocks * BLOCK);
    assert_eq!((p.qs.len(), p.scale.len()), (qs_len, d_len));
    assert_eq!((qs_len, d_len), (n * blocks * 22, n * 2));
    let offset = (m.offset.as_ref().unwrap(), p.offset.as_ref().unwrap());
    // 11 blocks: lanes 0-2 hold two each (b, b + 8), lanes 3-7 one
    let position = |b: usize| {
        if b < 8 {
            2 * b.min(3) + b.saturating_sub(3)
        } else {
            2 * (b - 8) + 1
        }
    };
    for c in 0..n {
        let (g, i) = (c / PACK, c % PACK);
        for b in 0..blocks {
            let at = (g * blocks + position(b)) * 22 * PACK;
            for w in 0..BLOCK {
                let (t, e) = (w / 4, w % 4);
                let q = m.qs[(c * blocks + b) * BLOCK + w];
                let low = p.qs[at + 64 * (t % 4) + 4 * i + e] >> (4 * (t / 4)) & 0x0f;
                let high = p.qs[at + 256 + 4 * i + e] >> t & 1;
                assert_eq!(low | high << 4, q, "column {c} block {b} weight {w}");
            }
            let v = (g * 2 + b / 8) * PACK + i;
            let sc = f32::from(p.qs[at + 320 + i] as i8);
            let min = f32::from(p.qs[at + 336 + i] as i8);
            assert_eq!(
                (p.scale[v] * sc).to_bits(),
                m.scale[c * blocks + b].to_bits()
            );
            assert_eq!(
                (offset.1[v] * min).to_bits(),
                offset.0[c * blocks + b].to_bits()
            );
        }
    }
}

#[test]
fn q5_packing_refuses_what_it_cannot_hold() {
    let m = matrix(Kind::Q5K, 16, 64, &mut 4);
    let (q, d) = q5_packed_lengths(16, 64);
    let pack = |qs: &[u8], scale: &[f32], offset: Option<&[f32]>| {
        let w = Q8Weights {
            // SAFETY: u8 and i8 have the same size and alignment, every bit pattern valid.
            qs: unsafe { std::slice::from_raw_parts(qs.as_ptr().cast(), qs.len()) },
            scale,
            offset,
            n: 16,
            k: 64,
            low: None,
            packed: Q8Packing::Rows,
        };
        pack_q5(w, &mut vec![0; q], &mut vec![0.0; d], &mut vec![0.0; d])
    };
    let offset = m.offset.as_deref();
    assert!(pack(&m.qs, &m.scale, offset).is_ok());
    // no offsets (Q8_0, Q5_0), a quant outside 0..32, offsets no one f32 times int8s give
    assert!(pack(&m.qs, &m.scale, None)
        .unwrap_err()
        .0
        .contains("offsets"));
    let mut qs = m.qs.clone();
    qs[3] = 32;
    assert!(pack(&qs, &m.scale, offset).unwrap_err().0.contains("0..32"));
    let mut odd = m.offset.clone().unwrap();
    odd[..3].copy_from_slice(&[1.0, 0.1, 1e-3]);
    assert!(pack(&m.qs, &m.scale, Some(&odd))
        .unwrap_err()
        .0
        .contains("int8"));
}

#[test]
fn the_q5_blocks_layout_is_the_documented_one() {
    let (n, blocks) = (32, 11);
    for (kind, seed) in [(Kind::Q5, 21), (Kind::Q5Offset, 22)] {
        let m = matrix(kind, n, blocks * BLOCK, &mut { seed });
        let p = m.packed();
        let low = i32::from(m.low.expect("a narrow kind"));
        let (qs_len, values) = q5b_packed_lengths(n, blocks * BLOCK);
        assert_eq!((p.qs.len(), p.scale.len()), (qs_len, values));
        assert_eq!((qs_len, values), (n * blocks * 20, n * blocks));
        assert_eq!(p.offset.is_some(), m.offset.is_some());
        // 11 blocks: lanes 0-2 hold two each (b, b + 8), lanes 3-7 one
        let position = |b: usize| {
            if b < 8 {
                2 * b.min(3) + b.saturating_sub(3)
            } else {
                2 * (b - 8) + 1
            }
        };
        for c in 0..n {
            let (g, i) = (c / PACK, c % PACK);
            for b in 0..blocks {
                let at = (g * blocks + position(b)) * 20 * PACK;
                for w in 0..BLOCK {
                    let (t, e) = (w / 4, w % 4);
                    let q = i32::from(m.qs[(c * blocks + b) * BLOCK + w] as i8);
                    let nibble = p.qs[at + 64 * (t % 4) + 4 * i + e] >> (4 * (t / 4)) & 0x0f;
                    let high = p.qs[at + 256 + 4 * i + e] >> t & 1;
                    let u = i32::from(nibble | high << 4);
                    assert_eq!(u, q - low, "{kind:?} column {c} block {b} weight {w}");
                }
                let v = (g * blocks + position(b)) * PACK + i;
                assert_eq!(p.scale[v].to_bits(), m.scale[c * blocks + b].to_bits());
                if let (Some(want), Some(got)) = (&m.offset, &p.offset) {
                    assert_eq!(got[v].to_bits(), want[c * blocks + b].to_bits());
                }
            }
        }
    }
}

#[test]
fn q5_blocks_packing_refuses_what_it_cannot_hold() {
    let m = matrix(Kind::Q5Offset, 16, 64, &mut 6);
    let (q, values) = q5b_packed_lengths(16, 64);
    let pack = |qs: &[u8], low: Option<i8>, with_offset: bool| {
        let w = Q8Weights {
            // SAFETY: u8 and i8 have the same size and alignment, every bit pattern valid.
            qs: unsafe { std::slice::from_raw_parts(qs.as_ptr().cast(), qs.len()) },
            scale: &m.scale,
            offset: m.offset.as_deref(),
            n: 16,
            k: 64,
            low,
            packed: Q8Packing::Rows,
        };
        let mut offset = vec![0.0; values];
        let offset = with_offset.then_some(&mut offset[..]);
        pack_q5_blocks(w, &mut vec![0; q], &mut vec![0.0; values], offset)
    };
    assert!(pack(&m.qs, m.low, true).is_ok());
    // no low (quants of the full range: Q8_0's), offsets asked for where none are kept, a quant
    // outside the window
    assert!(pack(&m.qs, None, true).unwrap_err().0.contains("low"));
    assert!(pack(&m.qs, m.low, false).unwrap_err().0.contains("offsets"));
    let low = m.low.unwrap();
    let mut qs = m.qs.clone();
    qs[7] = low.wrapping_add(32) as u8;
    if i16::from(low) + 32 <= 127 {
        assert!(pack(&qs, m.low, true).unwrap_err().0.contains("only"));
    }
    qs[7] = low.wrapping_sub(1) as u8;
    if low > i8::MIN {
        assert!(pack(&qs, m.low, true).unwrap_err().0.contains("only"));
    }
}

#[test]
fn every_kind_at_each_row_count_that_picks_a_path_gives_the_row_layouts_bits() {
    // one row (a whole group), a tile and a half, and the rows from which a call splits
    for kind in [
        Kind::Q4,
        Kind::Q4Signed,
        Kind::Q6K,
        Kind::Q5K,
        Kind::Q5,
        Kind::Q5Offset,
    ] {
        // rows of 19 blocks and of 70 (AVX2's q5 prompt chunks take other tiles past 64)
        for (rows, blocks) in [(1, 19), (6, 19), (16, 19), (17, 19), (17, 70)] {
            let mut seed = 40 + rows as u64;
            let (n, k) = (2 * PACK, blocks * BLOCK);
            let m = matrix(kind, n, k, &mut seed);
            let p = m.packed();
            let x = activations(rows, k, STYLES, &mut seed);
            let plain = int8(&x, rows, m.view(), I8Kernel::Plain);
            for kernel in I8Kernel::available() {
                let y = int8(&x, rows, p.view(), kernel);
                for (i, (a, b)) in y.iter().zip(&plain).enumerate() {
                    assert!(same(*a, *b), "{kind:?} {kernel:?} {rows} rows, output {i}");
                }
            }
        }
    }
}
