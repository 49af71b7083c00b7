//! `y = x @ [W_1; W_2; ...].T` for a fused matrix held as its parts (a Q4_K_M file's Q and K
//! beside its V of another kind, or gate beside up): the rows quantised once, and every part's
//! columns in one split over the threads.
//!
//! Why: a part at a time quantised the same rows again for each part and ran one split per part,
//! each ending with one thread waiting on the other's last piece. (A file whose parts share one
//! kind has them fused at load and never comes here.) The work saved is small against a step:
//! eight chats of the Q4_K_M default model in process under `KVPARK_CPU_ISA=avx2` moved by less
//! than the VM's run-to-run noise (±2-3 %). Each output value is its part's product on the same
//! activations by the same kernel ([`super::some_columns`]), so the bits are those of the parts
//! multiplied one by one (`tests/int8_parts.rs`).

use super::{chunk_rows, some_columns, I8Kernel, I8Scratch, COLUMN_CHUNK};
use crate::shape::ShapeError;
use crate::threads::{self, Output};
use crate::weights::Weights;

/// The product of `rows` rows of `x` with every part of `parts` (block weights of one `k`),
/// part `p`'s columns after those of the parts before it in each row of `y` (`[rows, Σ n]`).
/// `buf` holds the parts' products between the split and their copy into `y`.
///
/// # Panics
/// If this CPU cannot run `kernel` (as [`super::matmul_i8`]).
pub fn matmul_i8_parts(
    x: &[f32],
    rows: usize,
    parts: &[Weights<'_>],
    y: &mut [f32],
    kernel: I8Kernel,
    scratch: &mut I8Scratch,
    buf: &mut Vec<f32>,
) -> Result<(), ShapeError> {
    let Some(first) = parts.first() else {
        return Err(ShapeError("a product of no parts".into()));
    };
    let k = first.k();
    let width: usize = parts.iter().map(|w| w.n()).sum();
    for w in parts {
        if let Weights::Dense(_) = w {
            return Err(ShapeError(
                "int8 activations are defined only against block weights, not a dense matrix"
                    .into(),
            ));
        }
        if w.k() != k {
            return Err(ShapeError(format!("parts of {} and {k} inputs", w.k())));
        }
    }
    if y.len() != rows * width {
        return Err(ShapeError(format!(
            "{} outputs for {rows} rows of {width}",
            y.len()
        )));
    }
    // each part checked on its own slice of the buffer: its shape against x's
    if buf.len() < rows * width {
        buf.resize(rows * width, 0.0); // only grown: every value is written before it is read
    }
    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(parts.len());
    let mut rest = &mut buf[..rows * width];
    for w in parts {
        let (mine, more) = rest.split_at_mut(rows * w.n());
        w.check(x, mine, rows)?;
        outs.push(mine);
        rest = more;
    }
    kernel.assert_runs_here();
    scratch.quantise(x, rows, k, kernel)?;
    let all = scratch.activations();
    // each part's first task in the one numbering of every part's column chunks
    let starts: Vec<usize> = parts
        .iter()
        .scan(0, |at, w| {
            let first = *at;
            *at += w.n().div_ceil(COLUMN_CHUNK);
            Some(first)
        })
        .collect();
    let tasks = starts.last().copied().unwrap_or(0) + parts.last().map_or(0, chunks);
    let step = chunk_rows(k);
    for part in (0..rows).step_by(step) {
        let these = part..rows.min(part + step);
        let a = all.rows(these.clone());
        let views: Vec<Output> = outs
            .iter_mut()
            .zip(parts)
            .map(|(o, w)| Output::new(&mut o[these.start * w.n()..these.end * w.n()]))
            .collect();
        threads::parallel(tasks, width * k, &|range| {
            for (p, w) in parts.iter().enumerate() {
                let (lo, hi) = (starts[p], starts[p] + chunks(w));
                let (from, to) = (range.start.max(lo), range.end.min(hi));
                if from < to {
                    let col = |t: usize| ((t - lo) * COLUMN_CHUNK).min(w.n());
                    some_columns(kernel, &a, *w, col(from)..col(to), &views[p]);
                }
            }
        });
    }
    let mut col = 0;
    for (w, out) in parts.iter().zip(&outs) {
        let n = w.n();
        for (r, src) in out.chunks_exact(n.max(1)).enumerate().take(rows) {
            y[r * width + col..r * width + col + n].copy_from_slice(src);
        }
        col += n;
    }
    Ok(())
}

/// A part's column chunks.
fn chunks(w: &Weights<'_>) -> usize {
    w.n().div_ceil(COLUMN_CHUNK)
}
