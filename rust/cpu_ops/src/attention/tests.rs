//! The f16 widening against a float64 reference over every bit pattern, F16C (8 and 16 at a
//! time) against the plain conversion, and the kernel's SIMD path against its plain path for every kind of pool.

use super::kv_values::{f16_to_f32, widen_f16c, F16cRows, Rows};
use super::{run, run_at, DecodeAttention, KvValues, Level, Scores};

/// An f16's value computed from its fields in f64 (sign * 1.frac * 2^(exp - 15), or
/// sign * frac * 2^-24 when subnormal), then rounded to f32, which is exact.
fn reference(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let (exp, frac) = (i32::from((h >> 10) & 0x1f), f64::from(h & 0x3ff));
    let value = match exp {
        0 => sign * frac * 2f64.powi(-24),
        31 if frac == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN,
        _ => sign * (1.0 + frac / 1024.0) * 2f64.powi(exp - 15),
    };
    value as f32
}

#[test]
fn f16_widening_is_exact_for_every_bit_pattern() {
    let mut subnormals = 0;
    for h in 0..=u16::MAX {
        let (got, want) = (f16_to_f32(h), reference(h));
        if want.is_nan() {
            // a NaN keeps its sign and payload and comes out quiet, as vcvtph2ps makes it
            let payload = u32::from(h & 0x3ff) << 13;
            let quiet = 0x7fc0_0000 | (u32::from(h & 0x8000) << 16);
            assert!(got.is_nan(), "{h:#06x}");
            assert_eq!(got.to_bits(), quiet | payload, "{h:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}: {got} vs {want}");
        }
        subnormals += usize::from(h & 0x7c00 == 0 && h & 0x3ff != 0);
    }
    assert_eq!(subnormals, 2 * 1023);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
    assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
}

#[test]
fn f16c_widens_every_bit_pattern_as_the_plain_conversion_does() {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let want: Vec<f32> = all.iter().map(|&h| f16_to_f32(h)).collect();
    if F16cRows::new(&all).is_none() {
        // no F16C here (or KVPARK_CPU_ISA=plain): every f16 pool is read by f16_to_f32
        assert!(!crate::isa::effective().f16c);
        return;
    }
    // rows of 61: vcvtph2ps for whole eights, the plain conversion for each row's tail of 5
    let mut got = vec![f32::NAN; all.len()];
    for (src, dst) in all.chunks(61).zip(got.chunks_mut(61)) {
        // SAFETY: the CPU has F16C (F16cRows::new says so).
        unsafe { widen_f16c(src, dst) };
    }
    let same = |got: &[f32]| {
        got.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    };
    assert!(same(&got), "F16C and f16_to_f32 disagree");
    // and as the kernel reads a row (sixteen at a time under AVX-512: 3 of them, then an eight
    // and the tail of 5)
    let rows = F16cRows::new(&all).expect("F16C, as above");
    let mut buf = vec![f32::NAN; 61];
    got.fill(f32::NAN);
    for (at, dst) in (0..all.len()).step_by(61).zip(got.chunks_mut(61)) {
        let len = dst.len();
        dst.copy_from_slice(rows.row(at, len, &mut buf));
    }
    assert!(same(&got), "F16cRows and f16_to_f32 disagree");
}

fn lcg(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

/// Random f16 bit patterns of magnitude below 4, subnormals and zeros among them.
fn f16_bits(n: usize, seed: &mut u64) -> Vec<u16> {
    (0..n)
        .map(|_| {
            let r = lcg(seed);
            let exp = (r % 17) as u16; // 0 (subnormal or zero) ..= 16 (values in [2, 4))
            ((r >> 8) as u16 & 0x8000) | (exp << 10) | ((r >> 20) as u16 & 0x3ff)
        })
        .collect()
}

#[test]
fn the_simd_path_gives_the_plain_paths_bits_for_every_pool_kind() {
    let mut seed = 7;
    for (d, kv, group, seqs, ctx) in [(64, 3, 3, 4, 37), (12, 2, 2, 3, 9), (8, 1, 4, 2, 70)] {
        let (heads, n_cells) = (kv * group, seqs * ctx + 5);
        let n = n_cells * kv * d;
        let (k16, v16) = (f16_bits(n, &mut seed), f16_bits(n, &mut seed));
        let k32: Vec<f32> = k16.iter().map(|&h| f16_to_f32(h)).collect();
        let v32: Vec<f32> = v16.iter().map(|&h| f16_to_f32(h)).collect();
        let cells: Vec<i64> = (0..(seqs * ctx) as i64)
            .map(|c| (c * 7) % n_cells as i64)
            .collect();
        let context: Vec<i64> = (0..seqs as i64).map(|b| ctx as i64 - 3 * b).collect();
        let rows: Vec<i64> = (0..seqs as i64).rev().collect();
        let q: Vec<f32> = (0..seqs * heads * d)
            .map(|_| lcg(&mut seed) as f32 / (1u64 << 30) as f32 - 1.0)
            .collect();
        let attend = |k: KvValues<'_>, v: KvValues<'_>, level: Level| {
            let mut out = vec![f32::NAN; q.len()];
            let a = DecodeAttention {
                q: &q,
                k,
                v,
                cells: &cells,
                stride: ctx,
                context: &context,
                rows: &rows,
                heads,
                kv_heads: kv,
                head_dim: d,
            };
            run_at(a, Scores::standard(a.head_dim), &mut out, level).unwrap();
            out
        };
        let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
        let pools = [
            (KvValues::F32(&k32), KvValues::F32(&v32)),
            (KvValues::Bf16(&k16), KvValues::Bf16(&v16)),
            (KvValues::F16(&k16), KvValues::F16(&v16)),
        ];
        let wide = bits(attend(pools[0].0, pools[0].1, Level::Plain));
        assert!(wide.iter().all(|&b| !f32::from_bits(b).is_nan()));
        for (k, v) in pools {
            let plain = bits(attend(k, v, Level::Plain));
            for level in Level::available() {
                assert_eq!(plain, bits(attend(k, v, level)), "{k:?} {level:?}");
            }
            if matches!(k, KvValues::F16(_)) {
                assert_eq!(plain, wide, "an f16 pool reads as its values widened");
            }
        }
    }
}

/// A prompt chunk's rows: consecutive positions of one sequence (with and without a sliding
/// window), beside a decode row of another. Blocked (`runs.rs`) or each alone, on one thread or
/// three, plain or SIMD, with or without a soft-cap, every row gets the same bits.
#[test]
fn a_prompt_chunks_rows_in_blocks_give_each_rows_bits_alone() {
    // 40: two runs of 16 values and a tail of 8; 56: three and a tail; 64: four, no tail. The
    // query heads of a KV head go up to four at a time (`dot::HEADS`): 2, 3, 4 and 5 (four,
    // then one) take every count
    for (d, group) in [(40, 3), (56, 3), (64, 3), (64, 4), (40, 5), (56, 2)] {
        rows_in_blocks_give_each_rows_bits_alone(d, group, 20);
    }
    // a row alone past `block::stream_v_values` (cells of a 64-value head: half this machine's
    // L2 in f32, and 100 more) reads its V rows from the pool; in a block, from their widened
    // copy
    rows_in_blocks_give_each_rows_bits_alone(64, 3, super::block::stream_v_values() / 64 + 100);
}

fn rows_in_blocks_give_each_rows_bits_alone(d: usize, group: usize, p0: usize) {
    let kv = 2;
    let heads = kv * group;
    let n_cells = if p0 > 100 { p0 + 201 } else { 300 };
    let mut seed = 11;
    let n = n_cells * kv * d;
    let (k16, v16) = (f16_bits(n, &mut seed), f16_bits(n, &mut seed));
    // the sequence's cells, scattered over the pool as pages would be
    let list: Vec<i64> = (0..p0 as i64 + 40)
        .map(|c| (c * 37 + 5) % n_cells as i64)
        .collect();
    for window in [0usize, 9] {
        // rows at positions p0..p0 + 17 (blocks of 8, 8 and 1), then another sequence's
        let positions: Vec<usize> = (p0..p0 + 17).collect();
        let first = |p: usize| {
            if window == 0 {
                0
            } else {
                (p + 1).saturating_sub(window)
            }
        };
        let stride = p0 + 20;
        let (mut cells, mut context) = (Vec::new(), Vec::new());
        for &p in &positions {
            let mine = &list[first(p)..=p];
            cells.extend_from_slice(mine);
            cells.resize(cells.len() + stride - mine.len(), 0);
            context.push(mine.len() as i64);
        }
        let other: Vec<i64> = (0..25i64).map(|c| (c * 11 + 3) % n_cells as i64).collect();
        cells.extend_from_slice(&other);
        cells.resize(cells.len() + stride - other.len(), 0);
        context.push(other.len() as i64);
        let entries = context.len();
        let rows: Vec<i64> = (0..entries as i64).collect();
        let q: Vec<f32> = (0..entries * heads * d)
            .map(|_| lcg(&mut seed) as f32 / (1u64 << 30) as f32 - 1.0)
            .collect();
        let a = DecodeAttention {
            q: &q,
            k: KvValues::F16(&k16),
            v: KvValues::F16(&v16),
            cells: &cells,
            stride,
            context: &context,
            rows: &rows,
            heads,
            kv_heads: kv,
            head_dim: d,
        };
        let blocks = super::runs::blocks(&a);
        assert_eq!(
            blocks.len(),
            4,
            "17 continuing rows in blocks of 8, then one more"
        );
        for scores in [
            Scores::standard(d),
            Scores {
                scale: 0.3,
                softcap: Some(5.0),
            },
        ] {
            let mut alone = vec![f32::NAN; q.len()];
            for b in 0..entries {
                let one = DecodeAttention {
                    cells: &cells[b * stride..(b + 1) * stride],
                    context: &context[b..b + 1],
                    rows: &rows[b..b + 1],
                    ..a
                };
                run(one, scores, &mut alone, false).unwrap();
            }
            assert!(alone.iter().all(|x| x.is_finite()));
            for level in Level::available() {
                for threads in [1, 3] {
                    crate::set_threads(threads);
                    let mut out = vec![f32::NAN; q.len()];
                    run_at(a, scores, &mut out, level).unwrap();
                    let same = out
                        .iter()
                        .zip(&alone)
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "d {d}, group {group}, window {window}, {level:?}, threads {threads}, \
                         {scores:?}"
                    );
                }
            }
        }
    }
    crate::set_threads(1);
}
