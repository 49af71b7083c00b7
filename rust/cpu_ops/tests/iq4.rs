//! IQ4 weights (nibbles into the sixteen-value table) multiply bitwise as the q8 blocks they
//! equal, on every int8 kernel this CPU runs and on the f32 block path, at decode and prompt
//! row counts, column counts that leave a partial chunk, and any thread count.

mod support;

use kvpark_cpu_ops::{
    matmul_i8, matmul_iq4, matmul_q8, set_threads, I8Kernel, I8Scratch, Iq4Weights, Q8Packing,
    Q8Weights, Weights, BLOCK, IQ4_TABLE,
};
use proptest::prelude::*;
use support::{activations, same, STYLES};

/// Random nibbles and scales, and the q8 quants they stand for.
fn iq4(n: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<f32>, Vec<i8>) {
    let mut s = seed | 1;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as u32
    };
    let nibbles: Vec<u8> = (0..n * k / 2).map(|_| next() as u8).collect();
    let scale: Vec<f32> = (0..n * k / BLOCK)
        .map(|_| (next() % 2000) as f32 / 1e5 - 0.01)
        .collect();
    let mut q = vec![0i8; n * k];
    for (b, block) in nibbles.chunks_exact(BLOCK / 2).enumerate() {
        for (j, &byte) in block.iter().enumerate() {
            q[b * BLOCK + j] = IQ4_TABLE[usize::from(byte & 15)];
            q[b * BLOCK + j + 16] = IQ4_TABLE[usize::from(byte >> 4)];
        }
    }
    (nibbles, scale, q)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn iq4_products_are_the_q8_products_bit_for_bit(
        rows in prop::sample::select(vec![1usize, 2, 5, 8, 17, 64]),
        n in 1usize..70,
        blocks in 1usize..12,
        threads in 1usize..4,
        seed: u64,
    ) {
        set_threads(threads);
        let k = blocks * BLOCK;
        let (nibbles, scale, q) = iq4(n, k, seed);
        let w = Iq4Weights { qs: &nibbles, scale: &scale, n, k };
        let q8 = Q8Weights { qs: &q, scale: &scale, offset: None, n, k, low: None, packed: Q8Packing::Rows };
        let mut seed2 = seed;
        let x = activations(rows, k, STYLES, &mut seed2);
        let mut scratch = I8Scratch::new();
        for kernel in I8Kernel::available() {
            let mut got = vec![f32::NAN; rows * n];
            let mut want = vec![f32::NAN; rows * n];
            matmul_i8(&x, rows, Weights::Iq4(w), &mut got, kernel, &mut scratch).unwrap();
            matmul_i8(&x, rows, Weights::Q8(q8), &mut want, kernel, &mut scratch).unwrap();
            prop_assert!(got.iter().zip(&want).all(|(a, b)| same(*a, *b)), "{:?}", kernel);
        }
        let mut got = vec![f32::NAN; rows * n];
        let mut want = vec![f32::NAN; rows * n];
        matmul_iq4(&x, rows, w, &mut got).unwrap();
        matmul_q8(&x, rows, q8, &mut want).unwrap();
        prop_assert!(got.iter().zip(&want).all(|(a, b)| same(*a, *b)), "f32 path");
    }
}

#[test]
fn iq4_shapes_are_checked() {
    let (nibbles, scale, _) = iq4(4, 64, 3);
    let w = Iq4Weights {
        qs: &nibbles[..nibbles.len() - 1],
        scale: &scale,
        n: 4,
        k: 64,
    };
    let mut y = vec![0.0; 4];
    assert!(matmul_iq4(&[0.0; 64], 1, w, &mut y).is_err());
}
