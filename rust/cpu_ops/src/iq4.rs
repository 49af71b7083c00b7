//! IQ4_NL / IQ4_XS weights ([`Iq4Weights`]): 4-bit indices into one table of sixteen int8
//! values, kept as nibbles and expanded into the [`Q8Weights`] they equal (`q = IQ4_TABLE[nibble]`,
//! the same scale, no offset) a few columns at a time, into a buffer of the calling thread, just
//! before a block kernel reads them.
//!
//! Why: as q8 blocks a matrix takes a byte a weight, where the file takes 4.25 (IQ4_NL) or 4.5
//! bits (IQ4_XS); a decode step, bound by the bytes it reads, read twice what llama.cpp reads. So
//! the weights stay nibbles in memory, and each chunk of [`CHUNK`] columns (at most 24 KiB of
//! int8 at the widest layer of the default model: it stays in L1) is expanded with two table
//! lookups a 32-weight block (`vpshufb`), then multiplied by the q8 kernels. Every product is
//! therefore bitwise the q8 product of the same weights: the kernels promise that no column
//! split changes a bit, and the expansion is exact.

use std::cell::RefCell;
use std::ops::Range;

use crate::threads::Output;
use crate::weights::{Iq4Weights, Q8Packing, Q8Weights, Weights, BLOCK};

/// The values a nibble indexes (the GGUF format's IQ4 table, llama.cpp's `kvalues_iq4nl`).
pub const IQ4_TABLE: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Columns expanded at once: whole groups of the widest kernels (sixteen side by side).
pub(crate) const CHUNK: usize = 16;

thread_local! {
    /// One chunk's expanded quants and its rows' outputs.
    static SCRATCH: RefCell<(Vec<i8>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Output columns `cols` of `rows` rows of `y` (the whole `[rows, w.n]` output): `kernel` runs
/// on each chunk of them expanded into q8 blocks, as columns `0..chunk` of an output of its own,
/// copied into `y` after.
pub(crate) fn expanded_columns(
    w: Iq4Weights<'_>,
    rows: usize,
    cols: Range<usize>,
    y: &Output,
    kernel: &dyn Fn(Weights<'_>, Range<usize>, &Output),
) {
    SCRATCH.with(|s| {
        let (qs, out) = &mut *s.borrow_mut();
        let (k, blocks) = (w.k, w.k / BLOCK);
        let mut c = cols.start;
        while c < cols.end {
            let m = CHUNK.min(cols.end - c);
            qs.resize(m * k, 0);
            out.resize(rows * m, 0.0);
            expand(&w.qs[c * k / 2..(c + m) * k / 2], &mut qs[..m * k]);
            let q8 = Q8Weights {
                qs: &qs[..m * k],
                scale: &w.scale[c * blocks..(c + m) * blocks],
                offset: None,
                n: m,
                k,
                low: None, // the table's values span more than 32
                packed: Q8Packing::Rows,
            };
            kernel(Weights::Q8(q8), 0..m, &Output::new(&mut out[..rows * m]));
            for (r, values) in out[..rows * m].chunks_exact(m).enumerate() {
                y.set_run(r * w.n + c, values);
            }
            c += m;
        }
    });
}

/// Nibbles (16 bytes a block: byte `j` holds weight `j` low, `j + 16` high) into int8 quants.
pub(crate) fn expand(nibbles: &[u8], out: &mut [i8]) {
    debug_assert_eq!(out.len(), nibbles.len() * 2);
    #[cfg(target_arch = "x86_64")]
    if crate::isa::avx2() {
        // SAFETY: the CPU has AVX2 (and so SSSE3); the lengths are checked above.
        return unsafe { expand_ssse3(nibbles, out) };
    }
    for (block, q) in nibbles
        .chunks_exact(BLOCK / 2)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        for (j, &b) in block.iter().enumerate() {
            q[j] = IQ4_TABLE[usize::from(b & 15)];
            q[j + 16] = IQ4_TABLE[usize::from(b >> 4)];
        }
    }
}

/// [`expand`] with one table lookup (`pshufb`) for sixteen weights.
///
/// # Safety
/// The CPU has SSSE3; `out` holds twice `nibbles`' bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn expand_ssse3(nibbles: &[u8], out: &mut [i8]) {
    use std::arch::x86_64::*;
    let table = _mm_loadu_si128(IQ4_TABLE.as_ptr().cast());
    let low = _mm_set1_epi8(15);
    for (block, q) in nibbles
        .chunks_exact(BLOCK / 2)
        .zip(out.chunks_exact_mut(BLOCK))
    {
        let b = _mm_loadu_si128(block.as_ptr().cast());
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(b, low));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(b), low));
        _mm_storeu_si128(q.as_mut_ptr().cast(), lo);
        _mm_storeu_si128(q.as_mut_ptr().add(16).cast(), hi);
    }
}
