//! Prompt-sized dense products: each column block's weights widened once into an aligned f32
//! copy laid out in the order the kernel reads them, and each tile of rows copied to an aligned
//! buffer, before every tile of rows passes over the block.
//!
//! Why: at many rows a dense product is bound by how fast the core feeds its FMA units, not by
//! memory. Loads that straddle two cache lines (a file's tensors are 32-byte aligned, numpy's
//! rows 16-byte) and the widening of f16/bf16 on the FMA ports per tile of rows held the
//! 512-bit kernel at about half its FMA rate; on aligned, pre-widened f32 in one stream per group
//! of columns it runs at some 1.5x that (Intel Xeon, Sapphire Rapids). Below [`PACK_ROWS`] rows
//! the weights are read about once and the copy would cost more than it saves.
//!
//! The arithmetic is `mod.rs`'s, unchanged: widening is exact, and each (row, column) gets the
//! same FMAs in the same order into the same sixteen lanes, then the same reduction.

use std::cell::RefCell;
use std::ops::Range;

use super::{avx2, avx512, DenseKernel, Kernels, Lanes, Line, Product, LANES};
use crate::threads::Output;
use crate::tiling::{COLUMN_GROUP, ROW_TILE};

/// Rows from which a product packs its weights (each packed weight then serves at least two
/// tiles of rows).
pub(super) const PACK_ROWS: usize = 2 * ROW_TILE;

/// Packed f32 weights a block holds: a share of a core's L2 cache.
const PACKED_BLOCK_BYTES: usize = 256 * 1024;

thread_local! {
    /// This thread's packed block, kept across calls.
    static PACKED: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's aligned copy of a call's rows, kept across calls.
    static ROWS: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// `f` of `x` (whole lines: `k` is a multiple of 16) as aligned lines: `x` itself where it is
/// aligned, else a copy made once for every thread and block of the call.
pub(super) fn with_lines<R>(x: &[f32], f: impl FnOnce(&[Line]) -> R) -> R {
    assert!(x.len().is_multiple_of(LANES));
    if (x.as_ptr() as usize).is_multiple_of(std::mem::align_of::<Line>()) {
        // SAFETY: aligned for Line, whole lines of f32, and Line is sixteen f32 (repr(C)).
        let lines =
            unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<Line>(), x.len() / LANES) };
        return f(lines);
    }
    ROWS.with(|rows| {
        let mut rows = rows.borrow_mut();
        rows.clear();
        rows.extend(
            x.chunks_exact(LANES)
                .map(|c| Line(c.try_into().expect("16 values"))),
        );
        f(&rows)
    })
}

/// Whether `p` runs packed: enough rows, no tail of inputs, a SIMD kernel.
pub(super) fn applies(p: &Product<'_>) -> bool {
    p.rows >= PACK_ROWS && p.k.is_multiple_of(LANES) && p.kernel != DenseKernel::Plain
}

/// `Product::columns` for a product that [`applies`].
pub(super) fn columns<F: Kernels>(p: &Product<'_>, w: &[F::Raw], cols: Range<usize>, y: &Output) {
    let per_column = p.k * std::mem::size_of::<f32>();
    let block = (PACKED_BLOCK_BYTES / per_column).max(COLUMN_GROUP) / COLUMN_GROUP * COLUMN_GROUP;
    PACKED.with(|packed| {
        let packed = &mut *packed.borrow_mut();
        let mut b = cols.start;
        while b < cols.end {
            let end = (b + block).min(cols.end);
            run_block::<F>(p, w, b..end, y, packed);
            b = end;
        }
    });
}

/// Packs columns `cols`, then runs every tile of rows over them.
fn run_block<F: Kernels>(
    p: &Product<'_>,
    w: &[F::Raw],
    cols: Range<usize>,
    y: &Output,
    packed: &mut Vec<Line>,
) {
    let (k, n) = (p.k, p.n);
    let chunks = k / LANES;
    let groups = cols.len().div_ceil(COLUMN_GROUP);
    let per_group = chunks * COLUMN_GROUP;
    packed.clear();
    packed.resize(groups * per_group, Line([0.0; LANES]));
    for gi in 0..groups {
        let c0 = cols.start + gi * COLUMN_GROUP;
        let width = COLUMN_GROUP.min(cols.end - c0);
        let dst = &mut packed[gi * per_group..][..per_group];
        pack::<F>(p.kernel, &w[c0 * k..(c0 + width) * k], k, width, dst);
    }
    let mut sums = [[0.0f32; COLUMN_GROUP]; ROW_TILE];
    // the AVX2 kernel's lane sums, zeroed once a block rather than once a group
    let mut lanes: Lanes = [[[0.0; LANES]; ROW_TILE]; COLUMN_GROUP];
    let mut r0 = 0;
    while r0 < p.rows {
        let tile = ROW_TILE.min(p.rows - r0);
        let xt = &p.lines[r0 * chunks..(r0 + tile) * chunks];
        for gi in 0..groups {
            let c0 = cols.start + gi * COLUMN_GROUP;
            let width = COLUMN_GROUP.min(cols.end - c0);
            let wg = &packed[gi * per_group..][..per_group];
            match p.kernel {
                // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (DenseKernel::best).
                DenseKernel::Avx512 => unsafe {
                    avx512::packed_sums(xt, tile, chunks, wg, &mut sums)
                },
                // SAFETY: the CPU has AVX2, FMA and F16C (DenseKernel::best).
                _ => unsafe { avx2::packed_sums(xt, tile, chunks, wg, &mut lanes, &mut sums) },
            }
            for (r, row) in sums.iter().enumerate().take(tile) {
                if width == COLUMN_GROUP {
                    y.set_array((r0 + r) * n + c0, row);
                } else {
                    y.set_run((r0 + r) * n + c0, &row[..width]);
                }
            }
        }
        r0 += tile;
    }
}

/// Columns `w` (`width` of `k`, at most a group) widened into `dst`: `[chunk][column][16]`,
/// columns past `width` left zero.
fn pack<F: Kernels>(kernel: DenseKernel, w: &[F::Raw], k: usize, width: usize, dst: &mut [Line]) {
    match kernel {
        // SAFETY: the CPU has AVX-512F (DenseKernel::best).
        DenseKernel::Avx512 => unsafe { avx512::pack::<F>(w, k, width, dst) },
        // SAFETY: the CPU has AVX2, FMA and F16C (DenseKernel::best).
        _ => unsafe { avx2::pack::<F>(w, k, width, dst) },
    }
}
