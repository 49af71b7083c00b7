//! One row against 4-bit blocks: the single-stream decode step's products.
//!
//! At one row each block of weights meets one block of activations, so the column kernel
//! (`simd.rs`) spends most of its instructions unpacking nibbles: per block a 16-byte load, two
//! masks, a shift and a lane insert to build one operand in the activations' order. Here the
//! activations are laid out once per call in the weights' order instead ([`lay_out_pairs`]), so
//! one 32-byte load holds two blocks' quants and a mask and a shift give both operands; at the
//! end of a group of eight blocks, three `vphaddd` and a lane permute give the eight block sums.
//! The integer sums are exact and the float combine is the one of `int8`, so the bits are those
//! of every other kernel.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::simd::{load_lanes, Dot};
use super::{Activations, LANES};
use crate::iq4::IQ4_TABLE;
use crate::threads::Output;
use crate::weights::{Iq4Weights, Q4Weights, BLOCK};

/// Bytes of a pair of blocks' activations in [`lay_out_pairs`]' order.
const PAIR: usize = 2 * BLOCK;
/// Bytes ahead of the block being read whose quants are asked for: several columns of the
/// default model, past what the hardware prefetcher has in flight at a column's start. 4 KiB
/// ran one-row Q4 products over 120 MB of weights 4-10 % faster than 1 KiB (Intel Xeon,
/// Sapphire Rapids, 2 threads, alternated in one process); 8 KiB no faster.
const PREFETCH_BYTES: usize = 4096;

/// Whether one-row products take this kernel (`KVPARK_CPU_ONE_ROW=off`: the column kernel).
pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVPARK_CPU_ONE_ROW").as_deref() != Ok("off"))
}

/// Lays out one row's int8 blocks `q` (`[k]`) pair by pair in the order a Q4 pair load gives
/// the nibbles: for blocks `b`, `b + 1` (a 32-byte load holds quants `b` then `b + 1`, each byte
/// weight `i` in its low nibble and `i + 16` in its high one), `[x_b[..16], x_b1[..16]]` then
/// `[x_b[16..], x_b1[16..]]`. An odd last block pairs with zeros. `out` gets
/// `blocks.div_ceil(2) * 64` bytes.
pub(super) fn lay_out_pairs(q: &[i8], out: &mut Vec<i8>) {
    let blocks = q.len() / BLOCK;
    out.clear();
    out.resize(blocks.div_ceil(2) * PAIR, 0);
    for (b, block) in q.chunks_exact(BLOCK).enumerate() {
        let (pair, second) = (b / 2 * PAIR, (b % 2) * 16);
        out[pair + second..pair + second + 16].copy_from_slice(&block[..16]);
        out[pair + BLOCK + second..pair + BLOCK + second + 16].copy_from_slice(&block[16..]);
    }
}

/// Output columns `cols` of the one row of `a` (whose `pairs` [`lay_out_pairs`] filled) into
/// `y` (`[1, n]`).
///
/// # Safety
/// The CPU has AVX2, FMA and what `D` uses.
#[inline(always)]
pub(super) unsafe fn columns<D: Dot>(
    a: &Activations<'_>,
    w: Q4Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    let blocks = a.k / BLOCK;
    assert!(a.rows == 1 && a.k == w.k && cols.end <= w.n && a.padded >= blocks);
    assert!(a.pairs.len() == blocks.div_ceil(2) * PAIR && a.d.len() == a.padded);
    assert!(w.qs.len() == w.n * blocks * 16 && w.scale.len() == w.n * blocks);
    assert!(w.offset.len() == w.scale.len());
    let (qs, x) = (w.qs.as_ptr(), a.pairs.as_ptr());
    let end = qs.wrapping_add(w.qs.len());
    for c in cols {
        let base = c * blocks;
        let mut acc = _mm256_setzero_ps();
        for b0 in (0..blocks).step_by(LANES) {
            let m = LANES.min(blocks - b0);
            let at = base + b0;
            let mut sums = [_mm256_setzero_si256(); LANES / 2];
            for (j, s) in sums.iter_mut().enumerate().take(m.div_ceil(2)) {
                let b = b0 + 2 * j;
                let p = qs.add((base + b) * 16);
                _mm_prefetch(p.wrapping_add(PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                let bytes = if b + 1 < blocks {
                    _mm256_loadu_si256(p as *const __m256i)
                } else {
                    // an odd last block: its partner's activations are zeros, and its quants
                    // must not be read past the matrix
                    debug_assert!(p.add(16) <= end);
                    _mm256_zextsi128_si256(_mm_loadu_si128(p as *const __m128i))
                };
                let mask = _mm256_set1_epi8(0x0f);
                let lo = _mm256_and_si256(bytes, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), mask);
                let xp = x.add(b * BLOCK);
                let x_lo = _mm256_loadu_si256(xp as *const __m256i);
                let x_hi = _mm256_loadu_si256(xp.add(BLOCK) as *const __m256i);
                *s = D::pair(lo, x_lo, hi, x_hi);
            }
            let isum = _mm256_cvtepi32_ps(reduce_pairs(&sums));
            let scale = load_lanes(w.scale.as_ptr().add(at), m);
            let off = load_lanes(w.offset.as_ptr().add(at), m);
            let d = _mm256_loadu_ps(a.d.as_ptr().add(b0));
            let sum = _mm256_loadu_ps(a.sum.as_ptr().add(b0));
            acc = _mm256_fmadd_ps(_mm256_mul_ps(scale, d), isum, acc);
            acc = _mm256_fmadd_ps(_mm256_mul_ps(off, d), sum, acc);
        }
        y.set(c, crate::avx2::hsum(acc));
        // the first cache line of a later column's scales and offsets
        let ahead = base + 2 * blocks;
        _mm_prefetch(
            w.scale.as_ptr().wrapping_add(ahead) as *const i8,
            _MM_HINT_T0,
        );
        _mm_prefetch(
            w.offset.as_ptr().wrapping_add(ahead) as *const i8,
            _MM_HINT_T0,
        );
    }
}

/// [`columns`] for IQ4 blocks: the same nibbles, each looked up in [`IQ4_TABLE`] (`vpshufb`)
/// into a signed weight `t`, multiplied as the q8 kernels multiply a signed quant (`|t|` against
/// `x * sign(t)`: two products a `vpmaddubsw` lane, at most 2 * 127 * 127), and combined as a q8 block without
/// an offset: the bits of the q8 product of the weights the table gives, at half its bytes.
///
/// # Safety
/// The CPU has AVX2, FMA and what `D` uses.
#[inline(always)]
pub(super) unsafe fn columns_iq4<D: Dot>(
    a: &Activations<'_>,
    w: Iq4Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    let blocks = a.k / BLOCK;
    assert!(a.rows == 1 && a.k == w.k && cols.end <= w.n && a.padded >= blocks);
    assert!(a.pairs.len() == blocks.div_ceil(2) * PAIR && a.d.len() == a.padded);
    assert!(w.qs.len() == w.n * blocks * 16 && w.scale.len() == w.n * blocks);
    let (qs, x) = (w.qs.as_ptr(), a.pairs.as_ptr());
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_TABLE.as_ptr().cast()));
    for c in cols {
        let base = c * blocks;
        let mut acc = _mm256_setzero_ps();
        for b0 in (0..blocks).step_by(LANES) {
            let m = LANES.min(blocks - b0);
            let mut sums = [_mm256_setzero_si256(); LANES / 2];
            for (j, s) in sums.iter_mut().enumerate().take(m.div_ceil(2)) {
                let b = b0 + 2 * j;
                let p = qs.add((base + b) * 16);
                _mm_prefetch(p.wrapping_add(PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                let bytes = if b + 1 < blocks {
                    _mm256_loadu_si256(p as *const __m256i)
                } else {
                    // an odd last block: its partner's activations are zeros
                    _mm256_zextsi128_si256(_mm_loadu_si128(p as *const __m128i))
                };
                let mask = _mm256_set1_epi8(0x0f);
                let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, mask));
                let hi = _mm256_shuffle_epi8(
                    table,
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), mask),
                );
                let xp = x.add(b * BLOCK);
                let x_lo = _mm256_loadu_si256(xp as *const __m256i);
                let x_hi = _mm256_loadu_si256(xp.add(BLOCK) as *const __m256i);
                // two `dot`s, not a `pair`: AVX2's pair adds in i16, safe for nibbles only
                *s = _mm256_add_epi32(
                    D::dot(_mm256_abs_epi8(lo), _mm256_sign_epi8(x_lo, lo)),
                    D::dot(_mm256_abs_epi8(hi), _mm256_sign_epi8(x_hi, hi)),
                );
            }
            let isum = _mm256_cvtepi32_ps(reduce_pairs(&sums));
            let scale = load_lanes(w.scale.as_ptr().add(base + b0), m);
            let d = _mm256_loadu_ps(a.d.as_ptr().add(b0));
            acc = _mm256_fmadd_ps(_mm256_mul_ps(scale, d), isum, acc);
        }
        y.set(c, crate::avx2::hsum(acc));
        let ahead = base + 2 * blocks; // the first cache line of a later column's scales
        _mm_prefetch(
            w.scale.as_ptr().wrapping_add(ahead) as *const i8,
            _MM_HINT_T0,
        );
    }
}

/// Four pairs' i32 lanes (pair `j`: block `2j` in the low half, `2j + 1` in the high one) to one
/// vector of the eight block sums in block order (exact integer adds).
#[inline(always)]
unsafe fn reduce_pairs(p: &[__m256i; LANES / 2]) -> __m256i {
    // per half: [b0 b0 b2 b2 | b1 b1 b3 b3], [b4 b4 b6 b6 | b5 b5 b7 b7], then
    // [b0 b2 b4 b6 | b1 b3 b5 b7]
    let h01 = _mm256_hadd_epi32(p[0], p[1]);
    let h23 = _mm256_hadd_epi32(p[2], p[3]);
    let h = _mm256_hadd_epi32(h01, h23);
    _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}
