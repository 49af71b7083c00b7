//! BF16 matrices by bf16 activations, two inputs a lane at a time: the arithmetic of AVX-512
//! BF16's `vdpbf16ps`, which llama.cpp's BF16 products use too (its activations for a BF16
//! matrix are bf16).
//!
//! Why: a BF16 weight widened to f32 and multiplied into f32 rows costs a shift and an FMA of
//! sixteen lanes, and at eight rows and in prompts that product was bound by the FMA ports, not
//! by memory (an eight-row SmolLM2-135M step at ~40 % of the FMA units' peak on an AMD EPYC with
//! AVX-512 BF16, and its prompts at 0.7x llama-server's, which runs `vdpbf16ps`). `vdpbf16ps`
//! does 32 multiply-adds an instruction on the stored bits, with no widening.
//!
//! # Arithmetic: one order, every kernel
//! Each activation is rounded to bf16 once per call ([`round_bf16`]: to nearest even, a zero or
//! subnormal to a zero of its sign, a NaN kept quiet). Per (row, column), the `k` inputs (a
//! multiple of [`PAIR_CHUNK`]) go in chunks of 32; lane `i` of 16 takes inputs `2i + 1`, then
//! `2i`, of each chunk in order, from +0:
//!
//! ```text
//! lane[i] = ftz(fma(w[2i + 1], x[2i + 1], lane[i]))
//! lane[i] = ftz(fma(w[2i],     x[2i],     lane[i]))
//! ```
//!
//! with every bf16 input read as zero where it is subnormal (`daz`) and `ftz` flushing a
//! subnormal result to a zero of its sign: `vdpbf16ps` as Intel's manual defines it (DAZ in,
//! FTZ out, round to nearest even, the odd pair first), which `tests/bf16_pairs.rs` checks the
//! CPU's instruction against where it has one. The lanes then fold as every dense product's do
//! (`mod.rs`), in plain f32 adds. A row's result depends only on that row and the matrix: exact
//! mode holds.
//!
//! # Error bound
//! Against the exact products of the rounded activations, as `mod.rs`'s bound with `m = k / 16`
//! updates a lane, plus `(k + 15) 2^-126` for results flushed from the subnormals; each
//! activation's rounding moves it by at most `2^-8` (bf16's unit roundoff) of `|x_i|`.
//! `tests/bf16_pairs.rs` checks both against float64.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::{Lanes, LANES};
use crate::isa::{self, Isa};
use crate::shape::ShapeError;
use crate::threads::{parallel, Output};
use crate::tiling::{COLUMN_CHUNK, COLUMN_GROUP, ROW_TILE};
use crate::weights::{DenseValues, DenseWeights, Weights};

/// Inputs a chunk holds: two for each of the sixteen lanes.
pub const PAIR_CHUNK: usize = 2 * LANES;

/// Weights (bytes) a column block holds while every tile of rows passes over it: a share of a
/// core's L2, as the f32 products' blocks.
const BLOCK_BYTES: usize = 256 * 1024;

/// Which code computes a bf16-pairs product. Both give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PairKernel {
    /// Portable Rust: the definition, on any CPU.
    Plain,
    /// AVX-512 BF16's `vdpbf16ps`.
    Avx512Bf16,
}

impl PairKernel {
    /// `vdpbf16ps` where the CPU has it (under `KVPARK_CPU_ISA`), else the portable code.
    pub fn best() -> PairKernel {
        let f = isa::effective();
        if cfg!(target_arch = "x86_64") && f.level() == Isa::Avx512 && f.avx512_bf16 {
            PairKernel::Avx512Bf16
        } else {
            PairKernel::Plain
        }
    }

    /// Every kernel this CPU runs, narrowest first: what tests compare.
    pub fn available() -> Vec<PairKernel> {
        let best = PairKernel::best();
        [PairKernel::Plain, PairKernel::Avx512Bf16]
            .into_iter()
            .filter(|k| *k <= best)
            .collect()
    }
}

/// Whether `w` takes this product: bf16 values, and whole chunks of inputs.
pub fn applies(w: &DenseWeights<'_>) -> bool {
    matches!(w.values, DenseValues::Bf16(_)) && w.k.is_multiple_of(PAIR_CHUNK)
}

/// `x` rounded to bf16 bits: to nearest even, a zero or subnormal to a zero of its sign (what
/// `vdpbf16ps` would read it as), a NaN quiet.
pub fn round_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    if bits & 0x7f80_0000 == 0 {
        return ((bits >> 16) & 0x8000) as u16;
    }
    // a carry out of the fraction steps the exponent, up to infinity: round to nearest even
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// A bf16 input as `vdpbf16ps` reads it: its value, a subnormal as a zero of its sign.
#[inline(always)]
fn daz(b: u16) -> f32 {
    let bits = if b & 0x7f80 == 0 { b & 0x8000 } else { b };
    f32::from_bits(u32::from(bits) << 16)
}

/// A result as `vdpbf16ps` writes it: a subnormal flushed to a zero of its sign.
#[inline(always)]
fn ftz(v: f32) -> f32 {
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}

/// One lane's update by one pair: the odd input, then the even one.
#[inline(always)]
pub(crate) fn pair(lane: f32, w: [u16; 2], x: [u16; 2]) -> f32 {
    let odd = ftz(daz(w[1]).mul_add(daz(x[1]), lane));
    ftz(daz(w[0]).mul_add(daz(x[0]), odd))
}

/// One chunk of a row's rounded activations, on a cache line of its own.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Chunk([u16; PAIR_CHUNK]);

thread_local! {
    /// The calling thread's rounded rows, kept across calls.
    static ROWS: RefCell<Vec<Chunk>> = const { RefCell::new(Vec::new()) };
}

/// `y = x @ W.T` for a BF16 matrix by bf16 activations ([`applies`]), its columns split over
/// the threads of [`crate::set_threads`]; no split, tiling or kernel changes a bit.
///
/// # Panics
/// If this CPU cannot run `kernel` (it is not in [`PairKernel::available`]).
pub fn matmul_bf16_pairs(
    x: &[f32],
    rows: usize,
    w: DenseWeights<'_>,
    y: &mut [f32],
    kernel: PairKernel,
) -> Result<(), ShapeError> {
    Weights::Dense(w).check(x, y, rows)?;
    let DenseValues::Bf16(values) = w.values else {
        return Err(ShapeError("bf16 pairs multiply a bf16 matrix only".into()));
    };
    if !w.k.is_multiple_of(PAIR_CHUNK) {
        return Err(ShapeError(format!(
            "bf16 pairs need k a multiple of {PAIR_CHUNK}, not {}",
            w.k
        )));
    }
    assert!(
        kernel <= PairKernel::best(),
        "the {kernel:?} kernel cannot run on this CPU (see PairKernel::available)"
    );
    let out = Output::new(y);
    let (n, k) = (w.n, w.k);
    ROWS.with(|cell| {
        let mut chunks = cell.borrow_mut();
        chunks.clear();
        chunks.extend(
            x.chunks_exact(PAIR_CHUNK)
                .map(|c| Chunk(std::array::from_fn(|i| round_bf16(c[i])))),
        );
        let p = Pairs {
            x: &chunks,
            rows,
            k,
            n,
            w: values,
            kernel,
        };
        let col = |c: usize| (c * COLUMN_CHUNK).min(n);
        parallel(n.div_ceil(COLUMN_CHUNK), n * k, &|range| {
            p.columns(col(range.start)..col(range.end), &out)
        });
    });
    Ok(())
}

/// One call's operands.
struct Pairs<'a> {
    /// `[row][chunk]`
    x: &'a [Chunk],
    rows: usize,
    k: usize,
    n: usize,
    w: &'a [u16],
    kernel: PairKernel,
}

impl Pairs<'_> {
    /// Output columns `cols` of every row, in blocks of columns each kept in cache while every
    /// tile of rows passes over it.
    fn columns(&self, cols: std::ops::Range<usize>, y: &Output) {
        let per_column = self.k * 2;
        let block = (BLOCK_BYTES / per_column).max(COLUMN_GROUP) / COLUMN_GROUP * COLUMN_GROUP;
        let mut b = cols.start;
        while b < cols.end {
            let end = (b + block).min(cols.end);
            self.block(b..end, y);
            b = end;
        }
    }

    fn block(&self, cols: std::ops::Range<usize>, y: &Output) {
        let chunks = self.k / PAIR_CHUNK;
        let mut sums: Lanes = [[[0.0; LANES]; ROW_TILE]; COLUMN_GROUP];
        let mut out = [[0.0f32; COLUMN_GROUP]; ROW_TILE];
        let mut r0 = 0;
        while r0 < self.rows {
            let tile = ROW_TILE.min(self.rows - r0);
            let xt = &self.x[r0 * chunks..(r0 + tile) * chunks];
            let mut c = cols.start;
            while c < cols.end {
                let group = COLUMN_GROUP.min(cols.end - c);
                let wg = &self.w[c * self.k..(c + group) * self.k];
                match self.kernel {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the CPU has AVX-512F and AVX-512 BF16 (PairKernel::best).
                    PairKernel::Avx512Bf16 => unsafe {
                        avx512_lanes(xt, tile, chunks, wg, group, &mut sums);
                        super::avx512::reduce_tile(&sums, tile, &mut out);
                    },
                    _ => {
                        plain_lanes(xt, tile, chunks, wg, group, &mut sums);
                        for (r, row) in out.iter_mut().enumerate().take(tile) {
                            for (g, o) in row.iter_mut().enumerate().take(group) {
                                *o = crate::lane_tree::fold(&sums[g][r]);
                            }
                        }
                    }
                }
                for (r, row) in out.iter().enumerate().take(tile) {
                    let at = (r0 + r) * self.n + c;
                    if group == COLUMN_GROUP {
                        y.set_array(at, row);
                    } else {
                        y.set_run(at, &row[..group]);
                    }
                }
                c += group;
            }
            r0 += tile;
        }
    }
}

/// The definition: `tile` rows of `x` against `cols` columns of `w`, into `lanes[column][row]`.
fn plain_lanes(x: &[Chunk], tile: usize, chunks: usize, w: &[u16], cols: usize, lanes: &mut Lanes) {
    let k = chunks * PAIR_CHUNK;
    for (g, per_row) in lanes.iter_mut().enumerate().take(cols) {
        for (r, lane) in per_row.iter_mut().enumerate().take(tile) {
            *lane = [0.0; LANES];
            for ch in 0..chunks {
                let (xc, wc) = (&x[r * chunks + ch].0, &w[g * k + ch * PAIR_CHUNK..]);
                for (i, l) in lane.iter_mut().enumerate() {
                    *l = pair(*l, [wc[2 * i], wc[2 * i + 1]], [xc[2 * i], xc[2 * i + 1]]);
                }
            }
        }
    }
}

/// As [`plain_lanes`], bit for bit, by `vdpbf16ps`: as `avx512.rs`'s f32 kernel, columns side by
/// side where there are few rows, all the rows by two columns from five.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16; the shapes are [`plain_lanes`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn avx512_lanes(
    x: &[Chunk],
    tile: usize,
    chunks: usize,
    w: &[u16],
    cols: usize,
    out: &mut Lanes,
) {
    assert!((1..=ROW_TILE).contains(&tile) && tile * chunks <= x.len());
    assert!(cols <= COLUMN_GROUP && cols * chunks * PAIR_CHUNK <= w.len());
    match (tile, cols) {
        (1, 4) => group::<1, 4>(x, tile, chunks, w, 0, out),
        (2, 4) => group::<2, 4>(x, tile, chunks, w, 0, out),
        (3 | 4, 4) => group::<4, 4>(x, tile, chunks, w, 0, out),
        (5..=8, 4) => {
            group::<8, 2>(x, tile, chunks, w, 0, out);
            group::<8, 2>(x, tile, chunks, w, 2, out);
        }
        (1, _) => (0..cols).for_each(|g| group::<1, 1>(x, tile, chunks, w, g, out)),
        (2, _) => (0..cols).for_each(|g| group::<2, 1>(x, tile, chunks, w, g, out)),
        (3 | 4, _) => (0..cols).for_each(|g| group::<4, 1>(x, tile, chunks, w, g, out)),
        _ => (0..cols).for_each(|g| group::<8, 1>(x, tile, chunks, w, g, out)),
    }
}

/// Rows `0..t` (`t <= R`; rows past `t` read row `t - 1` again and are dropped) against
/// columns `g0..g0 + G`.
///
/// # Safety
/// As [`avx512_lanes`], which checked the shapes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn group<const R: usize, const G: usize>(
    x: &[Chunk],
    t: usize,
    chunks: usize,
    w: &[u16],
    g0: usize,
    out: &mut Lanes,
) {
    let k = chunks * PAIR_CHUNK;
    let row_at: [usize; R] = std::array::from_fn(|r| r.min(t - 1) * chunks);
    let mut acc = [[_mm512_setzero_ps(); R]; G];
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    for ch in 0..chunks {
        for (g, accs) in acc.iter_mut().enumerate() {
            let at = (g0 + g) * k + ch * PAIR_CHUNK;
            // the weights stream from memory once per call (mod.rs: PREFETCH_AHEAD)
            _mm_prefetch(
                wp.wrapping_add(at + super::PREFETCH_AHEAD) as *const i8,
                super::PREFETCH_HINT,
            );
            let wv: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(at).cast()));
            for (a, row) in accs.iter_mut().zip(row_at) {
                let xv: __m512bh =
                    std::mem::transmute(_mm512_load_si512((*xp.add(row + ch)).0.as_ptr().cast()));
                *a = _mm512_dpbf16_ps(*a, wv, xv);
            }
        }
    }
    for (g, accs) in acc.iter().enumerate() {
        for (r, a) in accs.iter().enumerate().take(t) {
            _mm512_storeu_ps(out[g0 + g][r].as_mut_ptr(), *a);
        }
    }
}
