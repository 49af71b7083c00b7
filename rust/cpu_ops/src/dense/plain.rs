//! The portable kernel: the lane sums of `mod.rs`'s order, lane by lane (`f32::mul_add` is one
//! rounding, as `vfmadd` is), so the SIMD kernels give the same bits.

use super::format::Format;
use super::{Lanes, LANES};

/// `lanes[g][r]`: the lane sums of row `r` of `x` (`[tile, k]`) against column `g` of `w`
/// (`[cols, k]`) over the whole chunks of 16 inputs.
pub(super) fn lanes<F: Format>(
    x: &[f32],
    tile: usize,
    k: usize,
    w: &[F::Raw],
    cols: usize,
    lanes: &mut Lanes,
) {
    let whole = k - k % LANES;
    for (g, per_row) in lanes.iter_mut().enumerate().take(cols) {
        let wc = &w[g * k..g * k + whole];
        for (r, acc) in per_row.iter_mut().enumerate().take(tile) {
            let xr = &x[r * k..r * k + whole];
            *acc = [0.0; LANES];
            for (wch, xch) in wc.chunks_exact(LANES).zip(xr.chunks_exact(LANES)) {
                for (l, a) in acc.iter_mut().enumerate() {
                    *a = F::widen(wch[l]).mul_add(xch[l], *a);
                }
            }
        }
    }
}
