//! [`I8Scratch`]: one call's activations as int8 blocks, kept between calls so that a caller
//! running many products (a layer runner) allocates once.
//!
//! ```text
//! q    [rows, k]       i8    block b of row r at r * k + 32 b
//! d    [rows, padded]  f32   padded = blocks rounded up to LANES; the padding is 0, so the
//! sum  [rows, padded]  f32   SIMD combine loads eight blocks' d and sum with plain loads
//! ```

use super::{quantise, Activations, I8Kernel, LANES};
use crate::row_split::{for_rows, SharedRows};
use crate::shape::{check, ShapeError};
use crate::weights::BLOCK;

/// The quantised activations of the last [`crate::matmul_i8`] (or [`I8Scratch::quantise`]).
#[derive(Clone, Debug, Default)]
pub struct I8Scratch {
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<f32>,
    /// `[rows, padded]`: each block's `Σ q` over its weights 0..16 (`lo`) and 16..32 (`hi`),
    /// exact, 0 in the padding (what `wide.rs` corrects Q6's two half sums by).
    lo: Vec<f32>,
    /// `[rows, padded]`: `-128 (sum, lo, hi)` as i32, 0 in the padding (`Activations::bias`).
    bias: Vec<[i32; 3]>,
    hi: Vec<f32>,
    /// One row's `q` laid out for `one_row.rs`; empty unless one row and a SIMD kernel.
    pairs: Vec<i8>,
    /// `q` as i16, for `wide_avx2.rs`; empty unless several rows on the AVX2 kernel.
    q16: Vec<i16>,
    /// Whether one row takes `one_row.rs` (None: unless `KVPARK_CPU_ONE_ROW=off`).
    one_row: Option<bool>,
    rows: usize,
    k: usize,
}

/// One row of an [`I8Scratch`]: `x[32 b + i] ≈ d[b] * q[32 b + i]`, `sum[b] = Σ_i q[32 b + i]`.
#[derive(Clone, Copy, Debug)]
pub struct QuantisedRow<'a> {
    /// `[k]`, each in [-127, 127].
    pub q: &'a [i8],
    /// `[k / 32]`: the block scales (0 for a block too small to quantise, NaN for one that holds
    /// an inf or NaN).
    pub d: &'a [f32],
    /// `[k / 32]`: each block's sum of `q`, exact.
    pub sum: &'a [f32],
}

impl I8Scratch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Quantises `x` (`[rows, k]`) by the rule in [`crate::int8`], with `kernel`'s quantiser
    /// (all give the same bits). Reuses the buffers' memory.
    ///
    /// # Panics
    /// If this CPU cannot run `kernel`.
    pub fn quantise(
        &mut self,
        x: &[f32],
        rows: usize,
        k: usize,
        kernel: I8Kernel,
    ) -> Result<(), ShapeError> {
        if k == 0 || !k.is_multiple_of(BLOCK) {
            return Err(ShapeError(format!(
                "k = {k} is not a positive multiple of {BLOCK}"
            )));
        }
        check("x", x.len(), rows * k)?;
        kernel.assert_runs_here();
        let padded = padded_blocks(k);
        self.q.resize(rows * k, 0);
        self.d.resize(rows * padded, 0.0);
        self.sum.resize(rows * padded, 0.0);
        self.lo.resize(rows * padded, 0.0);
        self.bias.resize(rows * padded, [0; 3]);
        self.hi.resize(rows * padded, 0.0);
        (self.rows, self.k) = (rows, k);
        // an i16 copy for the AVX2 kernel of several rows: each quad as 0, 2, 1, 3, the pairs
        // wide_avx2.rs widens the weights into
        let widened = rows >= 2 && kernel == I8Kernel::Avx2;
        self.q16.resize(if widened { rows * k } else { 0 }, 0);
        let q = SharedRows::new(&mut self.q, k);
        let q16 = SharedRows::new(&mut self.q16, k.max(1));
        let (d, sum) = (
            SharedRows::new(&mut self.d, padded),
            SharedRows::new(&mut self.sum, padded),
        );
        let (lo, hi) = (
            SharedRows::new(&mut self.lo, padded),
            SharedRows::new(&mut self.hi, padded),
        );
        let bias = SharedRows::new(&mut self.bias, padded);
        for_rows(rows, k, &|r| {
            for r in r {
                // SAFETY: for_rows hands each range of rows to one thread.
                let sums = unsafe {
                    quantise::Sums {
                        d: d.rows(r..r + 1),
                        sum: sum.rows(r..r + 1),
                        lo: lo.rows(r..r + 1),
                        bias: bias.rows(r..r + 1),
                        hi: hi.rows(r..r + 1),
                    }
                };
                let padding = k / BLOCK..padded;
                // the buffers may hold an earlier call's values in the padding
                for v in [&mut *sums.d, &mut *sums.sum, &mut *sums.lo, &mut *sums.hi] {
                    v[padding.clone()].fill(0.0);
                }
                sums.bias[padding.clone()].fill([0; 3]);
                // SAFETY: as above.
                let q = unsafe { q.rows(r..r + 1) };
                quantise::row(&x[r * k..(r + 1) * k], q, sums, kernel != I8Kernel::Plain);
                if widened {
                    // SAFETY: as above.
                    let wide = unsafe { q16.rows(r..r + 1) };
                    for (w, q) in wide.chunks_exact_mut(4).zip(q.chunks_exact(4)) {
                        w.copy_from_slice(&[q[0], q[2], q[1], q[3]].map(i16::from));
                    }
                }
            }
        });
        self.pairs.clear();
        #[cfg(target_arch = "x86_64")]
        if rows == 1
            && kernel != I8Kernel::Plain
            && self.one_row.unwrap_or_else(super::one_row::enabled)
        {
            super::one_row::lay_out_pairs(&self.q, &mut self.pairs);
        }
        Ok(())
    }

    /// Sends the products of one row to the one-row kernel (`int8/one_row.rs`) or keeps them
    /// on the column kernel (the same bits: for tests and measuring); by default the one-row
    /// kernel unless `KVPARK_CPU_ONE_ROW=off`.
    pub fn set_one_row(&mut self, on: bool) {
        self.one_row = Some(on);
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row `r` of the last quantisation.
    pub fn row(&self, r: usize) -> QuantisedRow<'_> {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        let (k, padded) = (self.k, padded_blocks(self.k));
        let blocks = r * padded..r * padded + k / BLOCK;
        QuantisedRow {
            q: &self.q[r * k..(r + 1) * k],
            d: &self.d[blocks.clone()],
            sum: &self.sum[blocks],
        }
    }

    pub(crate) fn activations(&self) -> Activations<'_> {
        let padded = padded_blocks(self.k);
        Activations {
            q: &self.q[..self.rows * self.k],
            d: &self.d[..self.rows * padded],
            sum: &self.sum[..self.rows * padded],
            lo: &self.lo[..self.rows * padded],
            bias: &self.bias[..self.rows * padded],
            hi: &self.hi[..self.rows * padded],
            rows: self.rows,
            k: self.k,
            padded,
            pairs: &self.pairs,
            q16: &self.q16,
        }
    }
}

fn padded_blocks(k: usize) -> usize {
    (k / BLOCK).div_ceil(LANES) * LANES
}
