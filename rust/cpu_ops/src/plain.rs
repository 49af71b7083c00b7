//! The portable path: the same arithmetic as `avx2.rs`, in the same order, lane by lane, so both
//! give the same bits (`f32::mul_add` is a fused multiply-add, as `_mm256_fmadd_ps` is).

use crate::tiling::ROW_TILE;
use crate::weights::{Weights, BLOCK, Q6_GROUP};

/// Expands block `b` of column `c`: the 32 f32 weights, bitwise the dequantised ones.
pub(crate) fn expand(w: Weights<'_>, c: usize, b: usize, out: &mut [f32; BLOCK]) {
    match w {
        Weights::Q4(w) => {
            let blocks = w.k / BLOCK;
            let at = c * blocks + b;
            let (s, o) = (w.scale[at], w.offset[at]);
            let qs = &w.qs[at * BLOCK / 2..(at + 1) * BLOCK / 2];
            for (i, q) in qs.iter().enumerate() {
                out[i] = s.mul_add(f32::from(q & 0x0F), o);
                out[i + BLOCK / 2] = s.mul_add(f32::from(q >> 4), o);
            }
        }
        Weights::Q8(w) => {
            let blocks = w.k / BLOCK;
            let at = c * blocks + b;
            let (s, o) = (w.scale[at], w.offset.map_or(0.0, |o| o[at]));
            let qs = &w.qs[at * BLOCK..(at + 1) * BLOCK];
            for (i, q) in qs.iter().enumerate() {
                out[i] = s.mul_add(f32::from(*q), o);
            }
        }
        Weights::Q6(w) => {
            let at = c * w.k / BLOCK + b;
            let qs = &w.qs[at * BLOCK..(at + 1) * BLOCK];
            for (i, q) in qs.iter().enumerate() {
                // a plain multiply, as `gguf` dequantises: exact, so no FMA is needed
                out[i] = w.scale[2 * at + i / Q6_GROUP] * f32::from(*q);
            }
        }
        Weights::Iq4(_) => unreachable!("expanded into q8 blocks first (iq4.rs)"),
        Weights::Dense(_) => unreachable!("dense matrices have their own product (dense/)"),
    }
}

/// Sums eight lanes in `avx2::hsum`'s tree: (l0+l4, l1+l5, l2+l6, l3+l7), then pairs, then one.
pub(crate) fn hsum(l: &[f32; 8]) -> f32 {
    let a = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let b = [a[0] + a[2], a[1] + a[3]];
    b[0] + b[1]
}

/// `out[r] = x[r] . W[c]` for the `tile` rows of `x` (`[tile, k]`).
pub(crate) fn column(
    x: &[f32],
    tile: usize,
    k: usize,
    w: Weights<'_>,
    c: usize,
    out: &mut [f32; ROW_TILE],
) {
    let mut acc = [[0.0f32; 8]; ROW_TILE];
    let mut wb = [0.0f32; BLOCK];
    for b in 0..k / BLOCK {
        expand(w, c, b, &mut wb);
        for (r, lanes) in acc.iter_mut().enumerate().take(tile) {
            let xb = &x[r * k + b * BLOCK..r * k + (b + 1) * BLOCK];
            // four 8-lane vectors per block, in order, each lane accumulating with an FMA
            for v in 0..BLOCK / 8 {
                for (l, lane) in lanes.iter_mut().enumerate() {
                    *lane = wb[v * 8 + l].mul_add(xb[v * 8 + l], *lane);
                }
            }
        }
    }
    for r in 0..tile {
        out[r] = hsum(&acc[r]);
    }
}
