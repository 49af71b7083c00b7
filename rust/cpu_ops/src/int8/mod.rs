//! `y = x @ W.T` with the activations rounded to int8 inside the call: integer dot products
//! against the weight quants, then one float multiply-add per block.
//!
//! Why: the f32 path ([`crate::matmul_q4`]) spends four FMAs per row on every block of 32
//! weights; here a row's block is one integer instruction pair (`vpmaddubsw` + `vpmaddwd` on
//! AVX2) or one instruction (`vpdpbusd`, AVX-512 VNNI), and the floats come in once per block.
//! The price is 8-bit activations (the bound below); the f32 path stays the exact-weights one.
//!
//! Where it pays: docs/cpu-kernels.md has the rates by kernel and CPU (`examples/int8_speed.rs`,
//! `examples/gemm_speed.rs`); at several rows the side-by-side kernels (`wide.rs` on VNNI,
//! `wide_avx2.rs`) take the calls where the column kernels had been about even with f32.
//!
//! # Activations (row by row, block of 32 by block: a row's result depends only on that row)
//! - `amax` is the largest `|x_i|`, found as the largest `x_i.to_bits() & 0x7fff_ffff`: an
//!   integer maximum, so every path finds the same bits, NaN included;
//! - a block holding an inf or NaN gets `d = NaN` and every `q_i = 0`: its row's outputs are NaN;
//! - otherwise `d = amax / 127` (f32 division); if `d < f32::MIN_POSITIVE` (a zero block, or one
//!   whose values are all below `127 * 2^-126`, about 1.5e-36) then `d = 0` and every `q_i = 0`;
//! - otherwise `q_i = round_ties_even(x_i * (1 / d))`: `1 / d` and the product each rounded to
//!   f32, then the IEEE default rounding to an integer (to nearest, ties to even; the SIMD path
//!   asks for it explicitly, so MXCSR's mode does not matter); `sum = Σ q_i`.
//!
//! `q_i` lies in [-127, 127] and `|x_i - d q_i| <= ρ d` with `ρ = 1/2 + 2^-16`: `1 / d` and
//! `x_i * (1 / d)` are within a relative `u = 2^-24` each, so with `|x_i / d| <= 127 / (1 - u)`
//! the rounded product is within `127 (2u + u^2) / (1 - u) < 2^-16` of `x_i / d`, and `q_i` within
//! 1/2 of it (so `|q_i| < 127.5`). No `i8` saturates anywhere below: AVX2's `vpmaddubsw` pairs
//! reach `2 * 15 * 127` (Q4) or `2 * 128 * 127` (Q8 and Q6 via `|w|` and `x * sign(w)`), under
//! 32767.
//!
//! # Integer sums
//! Per block `b`: `isum_b = Σ nibble_i q_i` for [`Q4Weights`] (Q4_1 as stored;
//! Q4_0 is Q4_1 with `offset = -8 * scale`, as the loader already stores it), `Σ w_i q_i` for
//! [`Q8Weights`]. Exact in every path, and `|isum_b| <= 32 * 128 * 127 < 2^24`,
//! so `isum_b as f32` is exact too. `Σ_i w_i x_i ≈ scale_b d_b isum_b + offset_b d_b sum_b`.
//!
//! # The float combine: one order, every kernel
//! Per (row, column): eight f32 lanes start at +0. Blocks go in groups of [`LANES`], the last
//! group padded with empty blocks (scale, offset, `d`, `sum` and `isum` all 0); block
//! `b = 8 g + l` updates lane `l`, groups in order:
//!
//! ```text
//! lane[l] = fma(scale_b * d_b, isum_b as f32, lane[l])
//! lane[l] = fma(offset_b * d_b, sum_b, lane[l])      // only where the weights have offsets
//! y = ((lane0 + lane4) + (lane2 + lane6)) + ((lane1 + lane5) + (lane3 + lane7))
//! ```
//!
//! [`Q6Weights`] have two scales per block and no offset: `isum_b` splits into `isum'_b` over
//! weights 0..16 and `isum''_b` over 16..32, and block `b` updates its lane twice, in the place
//! of the two lines above: `fma(scale'_b * d_b, isum'_b, lane)`, then `fma(scale''_b * d_b,
//! isum''_b, lane)` (`q6.rs`; `plain::dot_q6`).
//!
//! Each product `scale_b * d_b`, `offset_b * d_b` is rounded to f32 on its own (never fused).
//! The plain path runs this lane by lane; the SIMD paths as one 8-lane vector per group (eight
//! blocks' integer sums reduced into one vector, the scales loaded eight at a time).
//!
//! # Error bound
//! With `q^w_i` the weight's quant (nibble or 8-bit), `ŵ_i = scale_b q^w_i + offset_b` (exact,
//! real; offset 0 where there is none), the target `T = Σ_i ŵ_i x_i` and
//! `P = Σ_b d_b (scale_b isum_b + offset_b sum_b) = Σ_b Σ_{i∈b} ŵ_i d_b q_i` (what the combine
//! computes, before rounding):
//!
//! 1. quantisation: `|T - P| <= Σ_b e_b Σ_{i∈b} |ŵ_i|`, `e_b = ρ d_b`, or `amax_b` for a block
//!    set to 0 (above);
//! 2. rounding: each term `p` of the lane sums is an exact product inside an fma of a rounded
//!    scale product; it meets at most `1 + m + 3` roundings (its scale product, the `m` updates
//!    of its lane — `m = ⌈B / 8⌉` for `B` blocks, twice that with offsets or Q6's two halves —
//!    and the three levels of the tree), so by the recursive-summation argument `|ŷ - P| <= γ_{m+4} Σ|p| + floor`,
//!    `γ_n = n u / (1 - n u)`. And `Σ|p| = Σ_b d_b (|scale_b isum_b| + |offset_b sum_b|) <=
//!    Σ_b Σ_{i∈b} (|scale_b q^w_i| + |offset_b|) (|x_i| + e_b)` since `d_b |q_i| <= |x_i| + e_b`;
//! 3. the floor: a rounding in the subnormal range may add an absolute `2^-150` instead; an fl of
//!    a scale product meets `|isum_b|` (or `|sum_b|`) in its fma, and there are `8 m + 7`
//!    roundings after, each error at most doubled later: `floor = 2^-149 (Σ_b (|isum_b| +
//!    |sum_b|) + 8 m + 8)`, with `|isum_b| + |sum_b| <= 32 * 128 * 128` (Q6: `|isum'_b| +
//!    |isum''_b|`, within the same). For Q6 the steps hold as written with `scale_b` the scale
//!    of weight `i`'s half and `offset_b = 0`.
//!
//! So `|ŷ - T| <= Σ_b e_b Σ_{i∈b} |ŵ_i| + γ_{m+4} Σ_b Σ_{i∈b} (|scale_b q^w_i| + |offset_b|)
//! (|x_i| + e_b) + floor` (`tests/int8_bound.rs` checks it; the worst error seen there is about
//! a third of the bound).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod group_fetch;
#[cfg(target_arch = "x86_64")]
mod one_row;
mod packed_columns;
mod parts;
mod plain;
#[cfg(target_arch = "x86_64")]
mod q6;
mod quantise;
mod scratch;
#[cfg(target_arch = "x86_64")]
mod side_by_side;
#[cfg(target_arch = "x86_64")]
mod side_by_side_packed;
#[cfg(target_arch = "x86_64")]
mod side_by_side_q8;
#[cfg(target_arch = "x86_64")]
mod simd;
#[cfg(target_arch = "x86_64")]
mod transpose_avx2;
#[cfg(target_arch = "x86_64")]
mod vnni;
#[cfg(target_arch = "x86_64")]
mod wide;
#[cfg(target_arch = "x86_64")]
mod wide_avx2;
#[cfg(target_arch = "x86_64")]
mod wide_avx2_packed;
#[cfg(target_arch = "x86_64")]
mod wide_packed;

pub use parts::matmul_i8_parts;
pub use scratch::{I8Scratch, QuantisedRow};

use crate::isa::{self, Isa};
use crate::shape::ShapeError;
use crate::threads::{self, Output};
use crate::tiling::COLUMN_CHUNK;
use crate::weights::{Q4Weights, Q6Weights, Q8Weights, Weights};

/// Lanes of the float combine (and blocks per group).
pub const LANES: usize = 8;

/// Blocks ahead of the one being multiplied whose quants (and scales) the column kernels
/// (`simd.rs`, `q6.rs`) ask for: 8 KiB of q8 or q6 quants, 4 KiB of q4. A decode step streams
/// every matrix from memory once, and the hardware prefetcher alone kept one-row products at
/// ~21 GB/s on two threads of a Sapphire Rapids VM, two columns ahead (1.1 KiB at k = 576) at
/// 20-22; 8 KiB ahead took them to 24-29 GB/s (the Q8_0 head 1.44-1.50 -> 1.14-1.18 ms on
/// AVX2, 1.40 -> 1.01-1.09 ms with VNNI), where a plain streaming loop reads at most ~32.
pub(super) const PREFETCH_BLOCKS: usize = 256;

/// Which code computes an int8 product. All give the same bits; they differ in speed only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum I8Kernel {
    /// Portable Rust.
    Plain,
    /// AVX2: `vpmaddubsw` (u8 x i8 pairs to i16) then `vpmaddwd` by ones (to i32).
    Avx2,
    /// AVX-512 VNNI on 256-bit vectors: `vpdpbusd` (u8 x i8 quads to i32) in one instruction.
    Avx512Vnni,
}

impl I8Kernel {
    /// The fastest kernel this CPU runs under `KVPARK_CPU_ISA` ([`crate::isa`]): `avx2` there
    /// keeps a VNNI machine on the AVX2 kernel, `plain` on the portable one.
    pub fn best() -> I8Kernel {
        let f = isa::effective();
        match f.level() {
            Isa::Avx512 if f.avx512_vnni => I8Kernel::Avx512Vnni,
            Isa::Avx512 | Isa::Avx2 => I8Kernel::Avx2,
            Isa::Plain => I8Kernel::Plain,
        }
    }

    /// Every kernel this CPU may run (under the same cap), narrowest first: what tests compare.
    pub fn available() -> Vec<I8Kernel> {
        let best = I8Kernel::best();
        [I8Kernel::Plain, I8Kernel::Avx2, I8Kernel::Avx512Vnni]
            .into_iter()
            .filter(|k| *k <= best)
            .collect()
    }

    /// A short name, for benchmarks and messages.
    pub fn name(self) -> &'static str {
        match self {
            I8Kernel::Plain => "plain",
            I8Kernel::Avx2 => "avx2",
            I8Kernel::Avx512Vnni => "avx512vnni",
        }
    }

    fn assert_runs_here(self) {
        assert!(
            self <= I8Kernel::best(),
            "the {} int8 kernel cannot run on this CPU (see I8Kernel::available)",
            self.name()
        );
    }
}

/// `y = x @ W.T` for 4-bit block weights through int8 activations, on the fastest kernel and a
/// scratch of its own. Layouts as in [`crate::matmul_q4`].
pub fn matmul_q4_i8(
    x: &[f32],
    rows: usize,
    w: Q4Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    matmul_i8(
        x,
        rows,
        w.into(),
        y,
        I8Kernel::best(),
        &mut I8Scratch::new(),
    )
}

/// `y = x @ W.T` for 8-bit block weights through int8 activations; see [`matmul_q4_i8`].
pub fn matmul_q8_i8(
    x: &[f32],
    rows: usize,
    w: Q8Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    matmul_i8(
        x,
        rows,
        w.into(),
        y,
        I8Kernel::best(),
        &mut I8Scratch::new(),
    )
}

/// `y = x @ W.T` for Q6_K weights through int8 activations; see [`matmul_q4_i8`].
pub fn matmul_q6_i8(
    x: &[f32],
    rows: usize,
    w: Q6Weights<'_>,
    y: &mut [f32],
) -> Result<(), ShapeError> {
    matmul_i8(
        x,
        rows,
        w.into(),
        y,
        I8Kernel::best(),
        &mut I8Scratch::new(),
    )
}

/// `y = x @ W.T` through int8 activations on `kernel`, quantising `x` into `scratch` (reused
/// across calls, so a layer runner allocates nothing per step). Many rows go a chunk at a time
/// (`chunk_rows`), each chunk's columns split over the threads of [`crate::set_threads`]; no
/// chunk, split, tiling or kernel changes a bit of the result.
/// Block weights only: a dense matrix is refused ([`crate::dense`] multiplies it).
///
/// # Panics
/// If this CPU cannot run `kernel` (it is not in [`I8Kernel::available`]).
pub fn matmul_i8(
    x: &[f32],
    rows: usize,
    w: Weights<'_>,
    y: &mut [f32],
    kernel: I8Kernel,
    scratch: &mut I8Scratch,
) -> Result<(), ShapeError> {
    if let Weights::Dense(_) = w {
        return Err(ShapeError(
            "int8 activations are defined only against block weights, not a dense matrix".into(),
        ));
    }
    w.check(x, y, rows)?;
    kernel.assert_runs_here();
    scratch.quantise(x, rows, w.k(), kernel)?;
    let all = scratch.activations();
    let n = w.n();
    let step = chunk_rows(w.k());
    // (`max(1)`: a matrix of no columns has an empty `y`, which `chunks_mut(0)` would refuse)
    for (part, y) in (0..rows).step_by(step).zip(y.chunks_mut((step * n).max(1))) {
        let a = all.rows(part..rows.min(part + step));
        product(kernel, &a, w, &Output::new(y));
    }
    Ok(())
}

/// Activation bytes of one row chunk (below).
const CHUNK_BYTES: usize = 512 << 10;

/// Rows multiplied together against every column before the next rows start: a prompt's int8
/// activations are read again for every group of output columns, so all of them at once fall
/// out of the core's L2 once they pass it. At 448 rows and k = 8192 (3.5 MiB: Llama-1B's down
/// projection) the AVX-512 kernel took 1.16x the time per row and block that it takes at k =
/// 2048; chunks of 512 KiB (64 rows there) took it back to within 5 % (the weights' groups are
/// transposed once per chunk instead of once per call: a few per cent of a chunk at most).
fn chunk_rows(k: usize) -> usize {
    (CHUNK_BYTES / k.max(1)).max(64)
}

/// Every output column of the rows of `a`, split over the threads.
fn product(kernel: I8Kernel, a: &Activations<'_>, w: Weights<'_>, out: &Output) {
    let a = *a;
    let n = w.n();
    let col = |c: usize| (c * COLUMN_CHUNK).min(n);
    threads::parallel(n.div_ceil(COLUMN_CHUNK), n * w.k(), &|chunks| {
        some_columns(kernel, &a, w, col(chunks.start)..col(chunks.end), out)
    });
}

/// Output columns `cols` of every row of `a`: one thread's piece of a product (a run of whole
/// [`COLUMN_CHUNK`]s, the last one possibly short).
pub(super) fn some_columns(
    kernel: I8Kernel,
    a: &Activations<'_>,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    out: &Output,
) {
    let a = *a;
    match w {
        #[cfg(target_arch = "x86_64")]
        Weights::Iq4(w) if kernel != I8Kernel::Plain && !a.pairs.is_empty() => {
            // SAFETY: the kernel runs here (matmul_i8 checked); `pairs` is set for one row.
            unsafe {
                match kernel {
                    I8Kernel::Avx512Vnni => vnni::one_row_iq4(&a, w, cols, out),
                    _ => avx2::one_row_iq4(&a, w, cols, out),
                }
            }
        }
        Weights::Iq4(iq4) => {
            let mut c = cols.start;
            #[cfg(target_arch = "x86_64")]
            if kernel == I8Kernel::Avx512Vnni && wide::takes(a.rows, &w) {
                while c + wide::COLUMNS <= cols.end {
                    // SAFETY: the kernel runs here (matmul_i8 checked), the group lies
                    // inside the matrix and `a` was quantised for `w`.
                    unsafe { wide::group(&a, w, c, out) };
                    c += wide::COLUMNS;
                }
            }
            #[cfg(target_arch = "x86_64")]
            if kernel == I8Kernel::Avx2 && wide_avx2::takes(&a, &w) {
                while c + wide_avx2::COLUMNS <= cols.end {
                    // SAFETY: as above, with AVX2 and FMA.
                    unsafe { wide_avx2::group(&a, w, c, out) };
                    c += wide_avx2::COLUMNS;
                }
            }
            // the rest on q8 blocks expanded a few columns at a time
            crate::iq4::expanded_columns(iq4, a.rows, c..cols.end, out, &|w, c, y| {
                columns(kernel, &a, w, c, y)
            })
        }
        _ => columns(kernel, &a, w, cols, out),
    }
}

/// The quantised activations of one call, as the kernels read them.
#[derive(Clone, Copy)]
pub(crate) struct Activations<'a> {
    /// `[rows, k]` int8.
    pub q: &'a [i8],
    /// `[rows, padded]` f32: each block's `d` and `sum`, 0 in the padding.
    pub d: &'a [f32],
    pub sum: &'a [f32],
    /// `[rows, padded]` f32: each block's `Σ q` over weights 0..16 and 16..32, 0 in the padding.
    pub lo: &'a [f32],
    /// `[rows, padded]`: `-128` times each block's `sum`, `lo` and `hi`, as i32 (0 in the
    /// padding): where `wide.rs` starts a flipped kind's integer chain, so that it ends at
    /// `Σ w q` with no float correction after.
    pub bias: &'a [[i32; 3]],
    pub hi: &'a [f32],
    pub rows: usize,
    pub k: usize,
    /// Blocks per row rounded up to a multiple of [`LANES`].
    pub padded: usize,
    /// One row's `q` in the order of `one_row.rs` (empty for more rows, or off).
    pub pairs: &'a [i8],
    /// `[rows, k]`: `q` as i16 for `wide_avx2.rs`, each quad in the order 0, 2, 1, 3 (its
    /// weight pairs'), empty but for several rows on AVX2.
    pub q16: &'a [i16],
}

impl<'a> Activations<'a> {
    /// Rows `rows` alone, as if quantised by themselves (every value is a row's own).
    pub(crate) fn rows(&self, rows: std::ops::Range<usize>) -> Self {
        if rows == (0..self.rows) {
            return *self;
        }
        let (k, p) = (self.k, self.padded);
        let by = |per: usize| rows.start * per..rows.end * per;
        let q16 = if self.q16.is_empty() {
            self.q16
        } else {
            &self.q16[by(k)]
        };
        Activations {
            q: &self.q[by(k)],
            d: &self.d[by(p)],
            sum: &self.sum[by(p)],
            lo: &self.lo[by(p)],
            bias: &self.bias[by(p)],
            hi: &self.hi[by(p)],
            rows: rows.len(),
            k,
            padded: p,
            // one row's other order exists only for a call of one row (returned whole above)
            pairs: &[],
            q16,
        }
    }
}

/// Output columns `cols` of every row, on `kernel` (which [`matmul_i8`] checked runs here).
pub(super) fn columns(
    kernel: I8Kernel,
    a: &Activations<'_>,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    if w.packed() {
        return packed_columns::columns(kernel, a, w, cols, y);
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == I8Kernel::Avx512Vnni && wide::takes(a.rows, &w) {
        // whole groups of sixteen columns side by side, the rest column by column
        let mut c = cols.start;
        while c + wide::COLUMNS <= cols.end {
            // SAFETY: the kernel runs here (matmul_i8 checked), the group lies inside the
            // matrix and `a` was quantised for `w`.
            unsafe { wide::group(a, w, c, y) };
            c += wide::COLUMNS;
        }
        return columns_one_by_one(kernel, a, w, c..cols.end, y);
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == I8Kernel::Avx2 && wide_avx2::takes(a, &w) {
        // the same on AVX2, eight columns a group
        let mut c = cols.start;
        while c + wide_avx2::COLUMNS <= cols.end {
            // SAFETY: the kernel runs here (matmul_i8 checked: AVX2 and FMA), the group lies
            // inside the matrix and `a` was quantised for `w`.
            unsafe { wide_avx2::group(a, w, c, y) };
            c += wide_avx2::COLUMNS;
        }
        return columns_one_by_one(kernel, a, w, c..cols.end, y);
    }
    #[cfg(target_arch = "x86_64")]
    if let Weights::Q4(q4) = w {
        if kernel != I8Kernel::Plain && side_by_side::takes(a.rows, &q4) {
            // whole groups of eight columns side by side, the rest column by column
            let mut c = cols.start;
            while c + side_by_side::GROUP <= cols.end {
                // SAFETY: as below; the group lies inside the matrix and `takes` holds.
                unsafe {
                    match kernel {
                        I8Kernel::Avx512Vnni => vnni::group(a, q4, c, y),
                        _ => avx2::group(a, q4, c, y),
                    }
                }
                c += side_by_side::GROUP;
            }
            return columns_one_by_one(kernel, a, w, c..cols.end, y);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Weights::Q8(q8) = w {
        if kernel == I8Kernel::Avx512Vnni && side_by_side_q8::takes(a.rows, &q8) {
            let mut c = cols.start;
            while c + side_by_side::GROUP <= cols.end {
                // SAFETY: the kernel runs here (matmul_i8 checked), the group lies inside the
                // matrix and `takes` holds.
                unsafe { side_by_side_q8::group(a, q8, c, y) };
                c += side_by_side::GROUP;
            }
            return columns_one_by_one(kernel, a, w, c..cols.end, y);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Weights::Q4(q4) = w {
        if kernel != I8Kernel::Plain && !a.pairs.is_empty() {
            // SAFETY: as below; `pairs` is set for one row only (I8Scratch::quantise).
            unsafe {
                match kernel {
                    I8Kernel::Avx512Vnni => vnni::one_row(a, q4, cols, y),
                    _ => avx2::one_row(a, q4, cols, y),
                }
            }
            return;
        }
    }
    columns_one_by_one(kernel, a, w, cols, y)
}

/// Output columns `cols` of every row, each column on its own.
fn columns_one_by_one(
    kernel: I8Kernel,
    a: &Activations<'_>,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    match kernel {
        // SAFETY: matmul_i8 asserted the CPU has AVX2 and FMA (the kernel is at most best()).
        #[cfg(target_arch = "x86_64")]
        I8Kernel::Avx2 => unsafe { avx2::columns(a, w, cols, y) },
        // SAFETY: as above, with AVX-512 F, BW, VL and VNNI.
        #[cfg(target_arch = "x86_64")]
        I8Kernel::Avx512Vnni => unsafe { vnni::columns(a, w, cols, y) },
        _ => plain::columns(a, w, cols, y),
    }
}
