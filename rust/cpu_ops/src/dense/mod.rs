//! `y = x @ W.T` for dense weights ([`DenseWeights`]: f32, f16 or bf16 values, `[n, k]`), with
//! f32 activations `x` `[rows, k]` and `y` `[rows, n]` as in the block products. The decoder
//! runs these whatever its block dot: int8 activations are defined only against blocks
//! ([`crate::int8`]), so a dense matrix always takes the f32 rows as they are.
//!
//! Why: Hugging Face checkpoints and F32/F16/BF16 GGUF tensors hold dense matrices; multiplying
//! them here lets the decoder serve them without torch, and a model may mix them with blocks
//! (a dense head over block layers, say).
//!
//! # Arithmetic: one order, every kernel
//! Each weight is widened exactly to f32 where it is used: f32 as it is, bf16 by a 16-bit
//! shift, f16 by F16C's `vcvtph2ps` where the CPU has it or an exact scalar conversion
//! otherwise (subnormals normalised, infinities kept, a NaN made quiet). Per (row, column),
//! [`LANES`] f32 lanes start at +0 and input `i` (in order, `0..k`) updates lane `i % 16`:
//!
//! ```text
//! lane[i % 16] = fma(w_i, x_i, lane[i % 16])
//! a[j] = lane[j] + lane[j + 8]                     (j < 8)
//! y = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
//! ```
//!
//! The SIMD kernels run whole chunks of 16 inputs as vectors (two 8-lane AVX2 vectors or one
//! 16-lane AVX-512 vector per row), and the tail of `k % 16` inputs and the reduction in the
//! same scalar code as the plain kernel; an fma is one rounding everywhere, so every kernel
//! gives the same bits. A row's result depends only on that row of `x` and on `W`: never on the
//! other rows, the row tiling or the thread split (exact mode needs this).
//!
//! # Error bound
//! Each product `w_i x_i` is exact inside its fma and meets at most `m + 4` roundings (the
//! `m = ⌈k / 16⌉` updates of its lane, then the four levels of the reduction), so with
//! `γ_n = n u / (1 - n u)`, `u = 2^-24`: `|ŷ - Σ w_i x_i| <= γ_{m+4} Σ |w_i x_i| + floor`, where
//! `floor = (k + 15) 2^-149` covers the `k + 15` roundings should any land in the subnormal
//! range (`tests/dense.rs` checks it against a float64 product).

pub mod bf16_pairs;
mod format;
#[cfg(target_arch = "x86_64")]
mod packed;
mod plain;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use format::{Bf16, Format, F16, F32};

use crate::isa::{self, Isa};
use crate::shape::ShapeError;
use crate::threads::{parallel, Output};
use crate::tiling::{COLUMN_CHUNK, COLUMN_GROUP, ROW_TILE};
use crate::weights::{DenseValues, DenseWeights, Weights};

/// Lanes each output accumulates in.
pub const LANES: usize = 16;

/// Weights ahead of the one a SIMD kernel loads whose cache line it asks for: the weights stream
/// from memory once per call, and a load that waits out each memory access left a decode step
/// of a BF16 model at eight rows stalled on them (`perf`: the samples on the widening right
/// after each weight load). 2048 weights (4 KiB of f16 or bf16, 8 KiB of f32) ahead cover a
/// memory access's latency where 512 did not: on an Intel Xeon (Sapphire Rapids, 2 threads)
/// a SmolLM2-135M decode step ran 35-50 % faster at one row and 20-35 % at eight for F16 and
/// BF16, 10-25 % for F32, than 512 ahead (`kvpark bench --scenario profile`); 8192 was slower
/// again.
pub(crate) const PREFETCH_AHEAD: usize = 2048;

/// The cache level those weights are asked into: L2 (`_MM_HINT_T1`), not L1. A prefetch into
/// L1 holds one of the core's few L1 fill buffers until its line arrives, and at eight rows the
/// weight loads themselves then waited on those buffers (`perf`: most of an 8-row F32 step's
/// kernel samples on the weight loads); into L2 the requests queue in L2's larger table, and
/// the loads find the lines one level down instead of in memory. On an Intel Xeon (Sapphire
/// Rapids): an F32 product of eight rows against a 3072 x 576 matrix streamed from memory
/// +10-15 % on the AVX2 and AVX-512 kernels, an 8-chat F32 decode step ~5 % faster in process,
/// F16 and one row unchanged within the VM's noise (alternated).
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_HINT: i32 = std::arch::x86_64::_MM_HINT_T1;

/// One group's lane sums: `[column][row][lane]`.
pub(crate) type Lanes = [[[f32; LANES]; ROW_TILE]; COLUMN_GROUP];

/// Which code computes a dense product. All give the same bits; they differ in speed only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DenseKernel {
    /// Portable Rust.
    Plain,
    /// AVX2, FMA and F16C: two 8-lane vectors per row.
    Avx2,
    /// AVX-512F: one 16-lane vector per row.
    Avx512,
}

impl DenseKernel {
    /// The fastest kernel this CPU runs under `KVPARK_CPU_ISA` ([`crate::isa`]).
    pub fn best() -> DenseKernel {
        let f = isa::effective();
        match f.level() {
            _ if !cfg!(target_arch = "x86_64") || !f.f16c => DenseKernel::Plain,
            Isa::Avx512 => DenseKernel::Avx512,
            Isa::Avx2 => DenseKernel::Avx2,
            Isa::Plain => DenseKernel::Plain,
        }
    }

    /// Every kernel this CPU may run (under the same cap), narrowest first: what tests compare.
    pub fn available() -> Vec<DenseKernel> {
        let best = DenseKernel::best();
        [DenseKernel::Plain, DenseKernel::Avx2, DenseKernel::Avx512]
            .into_iter()
            .filter(|k| *k <= best)
            .collect()
    }

    /// A short name, for benchmarks and messages.
    pub fn name(self) -> &'static str {
        match self {
            DenseKernel::Plain => "plain",
            DenseKernel::Avx2 => "avx2",
            DenseKernel::Avx512 => "avx512",
        }
    }
}

/// `y = x @ W.T` for a dense matrix on `kernel`, its columns split over the threads of
/// [`crate::set_threads`]; no split, tiling or kernel changes a bit of the result.
///
/// # Panics
/// If this CPU cannot run `kernel` (it is not in [`DenseKernel::available`]).
pub fn matmul_dense(
    x: &[f32],
    rows: usize,
    w: DenseWeights<'_>,
    y: &mut [f32],
    kernel: DenseKernel,
) -> Result<(), ShapeError> {
    Weights::Dense(w).check(x, y, rows)?;
    assert!(
        kernel <= DenseKernel::best(),
        "the {} dense kernel cannot run on this CPU (see DenseKernel::available)",
        kernel.name()
    );
    let out = Output::new(y);
    let p = Product {
        x,
        lines: &[],
        rows,
        k: w.k,
        n: w.n,
        kernel,
    };
    #[cfg(target_arch = "x86_64")]
    if w.k.is_multiple_of(LANES) && kernel != DenseKernel::Plain {
        // Every SIMD product reads its rows from lines aligned once for every thread and block
        // (`packed.rs`): a 64-byte row load straddling two cache lines takes two load slots, and
        // a decode tile loads each row once per chunk for only two FMAs a column. Eight-row
        // F16 and F32 decode steps ran ~4.5 % faster, one-row steps alike (alternated in one
        // process); the copy of a step's rows is a few KiB.
        packed::with_lines(x, |lines| {
            let x = Line::floats(lines);
            Product { x, lines, ..p }.run(w, &out)
        });
        return Ok(());
    }
    p.run(w, &out);
    Ok(())
}

/// Row `r` of a dense matrix, widened exactly to f32 (the embedding lookup).
pub(crate) fn row(w: DenseWeights<'_>, r: usize, out: &mut [f32]) {
    fn widen<F: Format>(src: &[F::Raw], out: &mut [f32]) {
        out.iter_mut().zip(src).for_each(|(o, v)| *o = F::widen(*v));
    }
    let at = r * w.k..(r + 1) * w.k;
    match w.values {
        DenseValues::F32(v) => widen::<F32>(&v[at], out),
        DenseValues::F16(v) => widen::<F16>(&v[at], out),
        DenseValues::Bf16(v) => widen::<Bf16>(&v[at], out),
    }
}

/// Sixteen f32 on one cache line: a packed product's rows and weights (`packed.rs`).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Line(pub(crate) [f32; LANES]);

#[cfg(target_arch = "x86_64")]
impl Line {
    /// `lines` as the f32 they hold, in order.
    pub(crate) fn floats(lines: &[Line]) -> &[f32] {
        // SAFETY: Line is sixteen f32 with no padding (repr(C)), so the slices cover the same
        // bytes, and f32's alignment is below Line's.
        unsafe { std::slice::from_raw_parts(lines.as_ptr().cast::<f32>(), lines.len() * LANES) }
    }
}

/// One call's shapes and kernel.
#[derive(Clone, Copy)]
struct Product<'a> {
    x: &'a [f32],
    /// `x` as aligned lines (`x` is then these lines' floats), where a SIMD kernel runs on whole
    /// chunks of inputs (empty otherwise).
    lines: &'a [Line],
    rows: usize,
    k: usize,
    n: usize,
    kernel: DenseKernel,
}

impl Product<'_> {
    /// Every column of `w`, split over the threads in chunks of [`COLUMN_CHUNK`].
    fn run(&self, w: DenseWeights<'_>, out: &Output) {
        let n = self.n;
        let col = |c: usize| (c * COLUMN_CHUNK).min(n);
        parallel(n.div_ceil(COLUMN_CHUNK), n * self.k, &|chunks| {
            let cols = col(chunks.start)..col(chunks.end);
            match w.values {
                DenseValues::F32(v) => self.columns::<F32>(v, cols, out),
                DenseValues::F16(v) => self.columns::<F16>(v, cols, out),
                DenseValues::Bf16(v) => self.columns::<Bf16>(v, cols, out),
            }
        });
    }

    /// Output columns `cols` of every row; only those are written, so threads given disjoint
    /// columns share `y`.
    fn columns<F: Kernels>(&self, w: &[F::Raw], cols: std::ops::Range<usize>, y: &Output) {
        #[cfg(target_arch = "x86_64")]
        if packed::applies(self) {
            return packed::columns::<F>(self, w, cols, y);
        }
        // Columns in blocks of about BLOCK_BYTES of weights, each block's weights kept in cache
        // while every row tile passes over them: a whole share of columns per row tile
        // streamed a matrix bigger than the cache once per eight rows.
        let per_column = self.k * std::mem::size_of::<F::Raw>();
        let block = (BLOCK_BYTES / per_column).max(COLUMN_GROUP) / COLUMN_GROUP * COLUMN_GROUP;
        let mut b = cols.start;
        while b < cols.end {
            let end = (b + block).min(cols.end);
            self.block::<F>(w, b..end, y);
            b = end;
        }
    }

    /// Every row tile against columns `cols`.
    fn block<F: Kernels>(&self, w: &[F::Raw], cols: std::ops::Range<usize>, y: &Output) {
        let (k, n) = (self.k, self.n);
        let mut sums: Lanes = [[[0.0; LANES]; ROW_TILE]; COLUMN_GROUP];
        let mut r0 = 0;
        while r0 < self.rows {
            let tile = ROW_TILE.min(self.rows - r0);
            let xt = &self.x[r0 * k..(r0 + tile) * k];
            let mut c = cols.start;
            while c < cols.end {
                let group = COLUMN_GROUP.min(cols.end - c);
                let wg = &w[c * k..(c + group) * k];
                lanes::<F>(self.kernel, xt, tile, k, wg, group, &mut sums);
                #[cfg(target_arch = "x86_64")]
                if k % LANES == 0 && self.kernel != DenseKernel::Plain {
                    // no tail: the reduction of the whole tile in registers (the same adds),
                    // then each row's run of columns written at once
                    let mut out = [[0.0f32; COLUMN_GROUP]; ROW_TILE];
                    match self.kernel {
                        // SAFETY: the CPU has AVX-512F (DenseKernel::best).
                        DenseKernel::Avx512 => unsafe {
                            avx512::reduce_tile(&sums, tile, &mut out)
                        },
                        // SAFETY: a SIMD kernel ran, so the CPU has AVX2 (DenseKernel::best).
                        _ => unsafe { avx2::reduce_tile(&sums, tile, &mut out) },
                    }
                    for (r, row) in out.iter().enumerate().take(tile) {
                        let at = (r0 + r) * n + c;
                        if group == COLUMN_GROUP {
                            y.set_array(at, row);
                        } else {
                            y.set_run(at, &row[..group]);
                        }
                    }
                    c += group;
                    continue;
                }
                for (g, per_row) in sums.iter_mut().enumerate().take(group) {
                    let wc = &wg[g * k..(g + 1) * k];
                    for (r, l) in per_row.iter_mut().enumerate().take(tile) {
                        let v = finish::<F>(&xt[r * k..(r + 1) * k], wc, l);
                        y.set((r0 + r) * n + c + g, v);
                    }
                }
                c += group;
            }
            r0 += tile;
        }
    }
}

/// Weights a column block holds (`Product::columns`): a share of a core's L2 cache.
const BLOCK_BYTES: usize = 256 * 1024;

/// The tail of `k % 16` inputs into `lanes`, then the reduction: the same scalar code after
/// every kernel.
fn finish<F: Format>(x: &[f32], w: &[F::Raw], lanes: &mut [f32; LANES]) -> f32 {
    let whole = x.len() - x.len() % LANES;
    for (i, (xv, wv)) in x[whole..].iter().zip(&w[whole..]).enumerate() {
        lanes[i] = F::widen(*wv).mul_add(*xv, lanes[i]);
    }
    crate::lane_tree::fold(lanes)
}

/// The lane sums over whole chunks of 16 inputs of `tile` rows of `x` and `cols` columns of
/// `w`, into `lanes[column][row]`, on `kernel` (which [`matmul_dense`] checked runs here).
fn lanes<F: Kernels>(
    kernel: DenseKernel,
    x: &[f32],
    tile: usize,
    k: usize,
    w: &[F::Raw],
    cols: usize,
    lanes: &mut Lanes,
) {
    match kernel {
        // SAFETY: the CPU has AVX2, FMA and F16C (DenseKernel::best).
        #[cfg(target_arch = "x86_64")]
        DenseKernel::Avx2 => unsafe { avx2::lanes::<F>(x, tile, k, w, cols, lanes) },
        // SAFETY: as above, with AVX-512F too.
        #[cfg(target_arch = "x86_64")]
        DenseKernel::Avx512 => unsafe { avx512::lanes::<F>(x, tile, k, w, cols, lanes) },
        _ => plain::lanes::<F>(x, tile, k, w, cols, lanes),
    }
}

/// The formats every kernel can load.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Kernels: avx2::Load + avx512::Load {}
#[cfg(target_arch = "x86_64")]
impl<F: avx2::Load + avx512::Load> Kernels for F {}
#[cfg(not(target_arch = "x86_64"))]
pub(crate) trait Kernels: Format {}
#[cfg(not(target_arch = "x86_64"))]
impl<F: Format> Kernels for F {}
