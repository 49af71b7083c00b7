//! RMSNorm of f32 rows: `out = x / sqrt(mean(x^2) + eps) * weight`, one pass to reduce and one
//! to scale per row. torch's CPU `rms_norm` runs as six separate ops (pow, mean, add, rsqrt, two
//! muls); at a decode step's few rows that dispatch, not the arithmetic, is its cost.

use crate::row_split::{for_rows, SharedRows};
use crate::shape::ShapeError;

/// Normalises each `weight.len()`-long row of `x` into `out` (a prompt's rows split over the
/// kernel threads: `row_split.rs`).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), ShapeError> {
    let d = weight.len();
    if d == 0 || !x.len().is_multiple_of(d) || out.len() != x.len() {
        return Err(ShapeError(format!(
            "rows of {d}: x has {} values and out {}",
            x.len(),
            out.len()
        )));
    }
    let shared = SharedRows::new(out, d);
    for_rows(x.len() / d, d, &|rows| {
        // SAFETY: for_rows hands each range of rows to one thread.
        let out = unsafe { shared.rows(rows.clone()) };
        norm_rows(&x[rows.start * d..rows.end * d], weight, eps, out);
    });
    Ok(())
}

/// Each row of `x` (rows of `weight.len()`) normed into `out`.
fn norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mut lanes = [0.0f32; 8];
        let chunks = row.chunks_exact(8);
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        for c in chunks {
            for i in 0..8 {
                lanes[i] += c[i] * c[i];
            }
        }
        let mean = (lanes.iter().sum::<f32>() + tail) / d as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * inv * w;
        }
    }
}
