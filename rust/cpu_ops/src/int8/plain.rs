//! The portable int8 kernel: the combine of [`crate::int8`] written out lane by lane. The SIMD
//! kernels are checked against it bit for bit.

use super::{Activations, LANES};
use crate::threads::Output;
use crate::weights::{Q6Weights, Weights, BLOCK, Q6_GROUP};

/// Output columns `cols` of every row of `a` into `y` (`[rows, n]`).
pub(super) fn columns(
    a: &Activations<'_>,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    let n = w.n();
    for c in cols {
        for r in 0..a.rows {
            y.set(r * n + c, dot(a, r, w, c));
        }
    }
}

/// Row `r` of the activations against column `c` of the weights.
fn dot(a: &Activations<'_>, r: usize, w: Weights<'_>, c: usize) -> f32 {
    if let Weights::Q6(w) = w {
        return dot_q6(a, r, w, c);
    }
    let blocks = a.k / BLOCK;
    let has_offset =
        matches!(w, Weights::Q4(_)) || matches!(w, Weights::Q8(w) if w.offset.is_some());
    let mut lanes = [0.0f32; LANES];
    for b in 0..a.padded {
        // a padding block is empty: scale, offset and isum 0 (and d and sum are 0 there)
        let (scale, offset, isum) = if b < blocks {
            let xq = &a.q[r * a.k + b * BLOCK..r * a.k + (b + 1) * BLOCK];
            block(w, c * blocks + b, xq)
        } else {
            (0.0, 0.0, 0)
        };
        let (d, sum) = (a.d[r * a.padded + b], a.sum[r * a.padded + b]);
        let lane = &mut lanes[b % LANES];
        *lane = (scale * d).mul_add(isum as f32, *lane);
        if has_offset {
            *lane = (offset * d).mul_add(sum, *lane);
        }
    }
    crate::plain::hsum(&lanes)
}

/// Block `at` (`column * blocks + b`) of the weights against one block of int8 activations:
/// `(scale, offset, Σ quant * q)`, the offset 0 where there is none.
fn block(w: Weights<'_>, at: usize, xq: &[i8]) -> (f32, f32, i32) {
    match w {
        Weights::Q4(w) => {
            let qs = &w.qs[at * BLOCK / 2..(at + 1) * BLOCK / 2];
            let (lo, hi) = xq.split_at(BLOCK / 2);
            let isum = qs
                .iter()
                .zip(lo.iter().zip(hi))
                .map(|(byte, (l, h))| {
                    i32::from(byte & 0x0f) * i32::from(*l) + i32::from(byte >> 4) * i32::from(*h)
                })
                .sum();
            (w.scale[at], w.offset[at], isum)
        }
        Weights::Q8(w) => {
            let qs = &w.qs[at * BLOCK..(at + 1) * BLOCK];
            let isum = qs
                .iter()
                .zip(xq)
                .map(|(q, x)| i32::from(*q) * i32::from(*x))
                .sum();
            (w.scale[at], w.offset.map_or(0.0, |o| o[at]), isum)
        }
        Weights::Q6(_) => unreachable!("Q6 blocks have two sums each: dot_q6"),
        Weights::Iq4(_) => unreachable!("expanded into q8 blocks first (iq4.rs)"),
        Weights::Dense(_) => unreachable!("matmul_i8 refuses dense matrices"),
    }
}

/// [`dot`] for Q6 weights: each block's two halves, `Σ w_i q_i` over weights 0..16 and 16..32,
/// each with its own scale, both into the block's lane, first half first (the combine of
/// `int8` with the half sums where the offset term would be).
fn dot_q6(a: &Activations<'_>, r: usize, w: Q6Weights<'_>, c: usize) -> f32 {
    let blocks = a.k / BLOCK;
    let mut lanes = [0.0f32; LANES];
    for b in 0..a.padded {
        let d = a.d[r * a.padded + b];
        let lane = &mut lanes[b % LANES];
        for h in 0..2 {
            // a padding block is empty: scales and sums 0 (and d is 0 there)
            let (scale, isum) = if b < blocks {
                let at = (c * blocks + b) * BLOCK + h * Q6_GROUP;
                let xq = &a.q[r * a.k + b * BLOCK + h * Q6_GROUP..][..Q6_GROUP];
                let isum: i32 = w.qs[at..at + Q6_GROUP]
                    .iter()
                    .zip(xq)
                    .map(|(q, x)| i32::from(*q) * i32::from(*x))
                    .sum();
                (w.scale[2 * (c * blocks + b) + h], isum)
            } else {
                (0.0, 0)
            };
            *lane = (scale * d).mul_add(isum as f32, *lane);
        }
    }
    crate::plain::hsum(&lanes)
}
