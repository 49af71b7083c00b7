//! The f32 block product `y = x @ W.T`: each weight block expanded in registers and multiplied
//! into f32 rows (the crate doc gives its arithmetic), split by output columns over the thread
//! team. A dense matrix goes to its own product ([`crate::dense`]).

use crate::dense::{matmul_dense, DenseKernel};
use crate::shape::ShapeError;
use crate::threads::{parallel, Output};
use crate::tiling::{COLUMN_CHUNK, COLUMN_GROUP, ROW_TILE};
use crate::weights::Weights;
use crate::{avx2, plain};

/// `y = x @ W.T`: on the thread team with SIMD where the CPU has it, or on the calling thread
/// through the portable path (`simd` false).
pub(crate) fn product(
    x: &[f32],
    rows: usize,
    w: Weights<'_>,
    y: &mut [f32],
    simd: bool,
) -> Result<(), ShapeError> {
    if let Weights::Dense(d) = w {
        let kernel = if simd {
            DenseKernel::best()
        } else {
            DenseKernel::Plain
        };
        return matmul_dense(x, rows, d, y, kernel);
    }
    w.check(x, y, rows)?;
    if simd {
        on_team(x, rows, w.k(), w, y);
    } else {
        any_columns(x, rows, w.k(), w, 0..w.n(), &Output::new(y), false);
    }
    Ok(())
}

/// The product split by [`COLUMN_CHUNK`]s of output columns over the thread team.
fn on_team(x: &[f32], rows: usize, k: usize, w: Weights<'_>, y: &mut [f32]) {
    let n = w.n();
    let simd = avx2::available();
    let out = Output::new(y);
    let col = |c: usize| (c * COLUMN_CHUNK).min(n);
    parallel(n.div_ceil(COLUMN_CHUNK), n * k, &|chunks| {
        any_columns(
            x,
            rows,
            k,
            w,
            col(chunks.start)..col(chunks.end),
            &out,
            simd,
        )
    });
}

/// [`columns`] for any block weights: IQ4 ones expanded into q8 blocks a chunk at a time.
fn any_columns(
    x: &[f32],
    rows: usize,
    k: usize,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
    simd: bool,
) {
    match w {
        Weights::Iq4(w) => crate::iq4::expanded_columns(w, rows, cols, y, &|w, c, y| {
            columns(x, rows, k, w, c, y, simd)
        }),
        _ if w.packed() => crate::packed::unpacked_columns(w, rows, cols, y, &|w, c, y| {
            columns(x, rows, k, w, c, y, simd)
        }),
        _ => columns(x, rows, k, w, cols, y, simd),
    }
}

/// Output columns `cols` of every row: `y[r * n + c]` for `c` in `cols`. `y` is the whole
/// output; only those columns are written, so threads given disjoint columns can share it.
fn columns(
    x: &[f32],
    rows: usize,
    k: usize,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
    simd: bool,
) {
    let n = w.n();
    let mut out = [[0.0f32; ROW_TILE]; COLUMN_GROUP];
    let mut r0 = 0;
    while r0 < rows {
        let tile = ROW_TILE.min(rows - r0);
        let xt = &x[r0 * k..(r0 + tile) * k];
        let mut c = cols.start;
        while c < cols.end {
            let group = COLUMN_GROUP.min(cols.end - c);
            if simd {
                // SAFETY: `simd` is only true when avx2::available() said the CPU has AVX2 and FMA.
                unsafe { avx2::columns(xt, tile, k, w, c, group, &mut out) };
            } else {
                for (g, o) in out.iter_mut().enumerate().take(group) {
                    plain::column(xt, tile, k, w, c + g, o);
                }
            }
            for (g, o) in out.iter().enumerate().take(group) {
                for (r, v) in o[..tile].iter().enumerate() {
                    y.set((r0 + r) * n + c + g, *v);
                }
            }
            c += group;
        }
        r0 += tile;
    }
}
