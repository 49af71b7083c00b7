//! Paged decode attention against a float64 softmax over the same cells, over random pools,
//! cell orders, contexts, head groupings and thread counts; and its argument checks.

use kvpark_cpu_ops::{decode_attention, set_threads, DecodeAttention, KvValues};
use proptest::prelude::*;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A finite f16's value from its fields (sign * 1.frac * 2^(exp - 15); subnormal: frac * 2^-24).
fn f16_value(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let (exp, frac) = (i32::from((h >> 10) & 0x1f), f64::from(h & 0x3ff));
    assert!(exp < 31, "finite values only");
    let magnitude = if exp == 0 {
        frac * 2f64.powi(-24)
    } else {
        (1.0 + frac / 1024.0) * 2f64.powi(exp - 15)
    };
    (sign * magnitude) as f32
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn matches_a_float64_softmax(
        seqs in 1usize..6, kv in 1usize..4, group in 1usize..4, d in prop::sample::select(vec![4usize, 8, 12, 64]),
        max_ctx in 1usize..40, threads in 1usize..4, seed: u64,
    ) {
        let mut s = seed;
        let heads = kv * group;
        let n_cells = seqs * max_ctx + 3;
        let k: Vec<f32> = (0..n_cells * kv * d).map(|_| lcg(&mut s)).collect();
        let v: Vec<f32> = (0..n_cells * kv * d).map(|_| lcg(&mut s)).collect();
        // each sequence owns a shuffled run of cells; rows in reverse order of sequences
        let mut all: Vec<i64> = (0..n_cells as i64).collect();
        for i in (1..all.len()).rev() {
            let j = ((lcg(&mut s) + 1.0) / 2.0 * i as f32) as usize % (i + 1);
            all.swap(i, j);
        }
        let cells: Vec<i64> = all[..seqs * max_ctx].to_vec();
        let context: Vec<i64> = (0..seqs).map(|b| 1 + ((b as u64 * 7 + seed % 1000) % max_ctx as u64) as i64).collect();
        let rows: Vec<i64> = (0..seqs as i64).rev().collect();
        let q: Vec<f32> = (0..seqs * heads * d).map(|_| lcg(&mut s)).collect();
        set_threads(threads);
        let mut out = vec![f32::NAN; q.len()];
        let a = DecodeAttention { q: &q, k: KvValues::F32(&k), v: KvValues::F32(&v), cells: &cells, stride: max_ctx, context: &context, rows: &rows, heads, kv_heads: kv, head_dim: d };
        decode_attention(a, &mut out).unwrap();
        for b in 0..seqs {
            let row = rows[b] as usize;
            for h in 0..heads {
                let g = h / group;
                let qv = &q[(row * heads + h) * d..][..d];
                let list = &cells[b * max_ctx..b * max_ctx + context[b] as usize];
                let sc: Vec<f64> = list.iter().map(|&c| {
                    let kv_ = &k[(c as usize * kv + g) * d..][..d];
                    qv.iter().zip(kv_).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum::<f64>() / (d as f64).sqrt()
                }).collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..d {
                    let want: f64 = list.iter().zip(&e).map(|(&c, p)| p / z * f64::from(v[(c as usize * kv + g) * d + i])).sum();
                    let got = out[(row * heads + h) * d + i];
                    prop_assert!((f64::from(got) - want).abs() < 1e-5, "{got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn a_16_bit_pool_gives_the_bits_of_its_values_widened(
        seqs in 1usize..5, kv in 1usize..3, group in 1usize..3, max_ctx in 1usize..30,
        threads in 1usize..3, seed: u64, f16 in any::<bool>(),
    ) {
        let (d, heads, mut s) = (64usize, kv * group, seed);
        let n_cells = seqs * max_ctx + 1;
        // bf16: an f32's upper half; f16: magnitudes below 4, subnormals and zeros among them
        let half = |s: &mut u64| if f16 {
            let r = lcg(s).to_bits();
            (r as u16 & 0x83ff) | (((r >> 10) % 17) as u16) << 10
        } else {
            (lcg(s).to_bits() >> 16) as u16
        };
        let k16: Vec<u16> = (0..n_cells * kv * d).map(|_| half(&mut s)).collect();
        let v16: Vec<u16> = (0..n_cells * kv * d).map(|_| half(&mut s)).collect();
        let widen = |x: &Vec<u16>| x.iter().map(|&b| if f16 { f16_value(b) } else { f32::from_bits((b as u32) << 16) }).collect::<Vec<f32>>();
        let (k32, v32) = (widen(&k16), widen(&v16));
        let cells: Vec<i64> = (0..(seqs * max_ctx) as i64).rev().collect();
        let context: Vec<i64> = (0..seqs).map(|b| 1 + ((b + seed as usize) % max_ctx) as i64).collect();
        let rows: Vec<i64> = (0..seqs as i64).collect();
        let q: Vec<f32> = (0..seqs * heads * d).map(|_| lcg(&mut s)).collect();
        set_threads(threads);
        let run = |k: KvValues<'_>, v: KvValues<'_>| {
            let mut out = vec![0.0f32; q.len()];
            let a = DecodeAttention { q: &q, k, v, cells: &cells, stride: max_ctx, context: &context, rows: &rows, heads, kv_heads: kv, head_dim: d };
            decode_attention(a, &mut out).unwrap();
            out
        };
        let narrow = if f16 {
            run(KvValues::F16(&k16), KvValues::F16(&v16))
        } else {
            run(KvValues::Bf16(&k16), KvValues::Bf16(&v16))
        };
        let wide = run(KvValues::F32(&k32), KvValues::F32(&v32));
        prop_assert!(narrow.iter().all(|x| x.is_finite()));
        prop_assert!(narrow.iter().zip(&wide).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn bad_arguments_are_refused() {
    let (q, k, v) = (vec![0.0; 8], vec![0.0; 16], vec![0.0; 16]);
    let base = DecodeAttention {
        q: &q,
        k: KvValues::F32(&k),
        v: KvValues::F32(&v),
        cells: &[0, 1],
        stride: 2,
        context: &[2],
        rows: &[0],
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
    };
    let mut out = vec![0.0; 8];
    assert!(decode_attention(base, &mut out).is_ok());
    let (k16, v16) = (vec![0u16; 16], vec![0u16; 16]);
    let f16 = DecodeAttention {
        k: KvValues::F16(&k16),
        v: KvValues::F16(&v16),
        ..base
    };
    assert!(decode_attention(f16, &mut out).is_ok());
    let cases = [
        DecodeAttention {
            cells: &[0, 9],
            ..base
        },
        DecodeAttention {
            context: &[3],
            ..base
        },
        DecodeAttention { rows: &[1], ..base },
        DecodeAttention { heads: 3, ..base },
        DecodeAttention {
            v: KvValues::Bf16(&v16),
            ..f16
        },
        DecodeAttention {
            context: &[0],
            ..base
        },
    ];
    for case in cases {
        assert!(decode_attention(case, &mut out).is_err(), "{case:?}");
    }
}
