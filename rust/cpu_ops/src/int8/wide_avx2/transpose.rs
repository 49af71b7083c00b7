//! `wide_avx2.rs`'s per-call transposition: each group of eight columns' blocks into [`Block8`]s
//! (i16 pairs of the full-range kinds, `q - low` quads of the narrow ones; the columns' scales and
//! offsets as vectors), asking for the next group's bytes as it goes where the call's size says
//! so (`group_fetch.rs`).

use std::arch::x86_64::*;

use super::{Block8, COLUMNS};
use crate::int8::group_fetch::NextGroup;
use crate::int8::transpose_avx2::transpose8;
use crate::iq4::IQ4_TABLE;
use crate::weights::{Iq4Weights, Q6Weights, Q8Weights, BLOCK};

/// The eight columns' value of block `b` from `p` (`[n, blocks * per]`, column `c`'s block `b`
/// at `c * blocks * per + b * per + h`).
#[inline(always)]
unsafe fn gather(
    p: *const f32,
    c0: usize,
    blocks: usize,
    per: usize,
    b: usize,
    h: usize,
) -> __m256 {
    let stride = (blocks * per) as i32;
    let index = _mm256_mullo_epi32(
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        _mm256_set1_epi32(stride),
    );
    _mm256_i32gather_ps::<4>(p.add(c0 * blocks * per + b * per + h), index)
}

/// IQ4: each column's 16 nibble bytes (byte `i`: weight `i` low, `i + 16` high) looked up in
/// the table (`vpshufb`) into its 32 int8 weights: the q8 blocks the table gives.
#[inline(always)]
pub(super) unsafe fn transpose_iq4(
    w: Iq4Weights<'_>,
    c0: usize,
    blocks: usize,
    g: &mut [Block8],
    next: &NextGroup,
) {
    let group = w.qs.as_ptr().add(c0 * blocks * 16);
    let mask = _mm_set1_epi8(0x0f);
    let table = _mm_loadu_si128(IQ4_TABLE.as_ptr().cast());
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        next.transposing(b);
        let col = |c: usize| {
            let v = _mm_loadu_si128(group.add((c * blocks + b) * 16) as *const __m128i);
            let lo = _mm_shuffle_epi8(table, _mm_and_si128(v, mask));
            let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(v), mask));
            _mm256_set_m128i(hi, lo)
        };
        set_pairs(blk, std::array::from_fn(col));
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 1, b, 0);
    }
}

/// Q8: column `c`'s block `b` is 32 int8.
#[inline(always)]
pub(super) unsafe fn transpose_q8(
    w: Q8Weights<'_>,
    c0: usize,
    blocks: usize,
    g: &mut [Block8],
    next: &NextGroup,
) {
    transpose_quants(w.qs.as_ptr(), w.low, c0, blocks, g, next);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 1, b, 0);
        if let Some(o) = w.offset {
            blk.offset = gather(o.as_ptr(), c0, blocks, 1, b, 0);
        }
    }
}

/// Q6: 32 int8 per block as Q8, and two scales per block.
#[inline(always)]
pub(super) unsafe fn transpose_q6(
    w: Q6Weights<'_>,
    c0: usize,
    blocks: usize,
    g: &mut [Block8],
    next: &NextGroup,
) {
    transpose_quants(w.qs.as_ptr(), w.low, c0, blocks, g, next);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 2, b, 0);
        blk.scale[1] = gather(w.scale.as_ptr(), c0, blocks, 2, b, 1);
    }
}

/// A kind's int8 quants into `g`: the full range as i16 pairs, or less `low` as quads where every
/// quant lies within 32 (Q8) or 64 (Q6) of it.
#[inline(always)]
unsafe fn transpose_quants(
    qs: *const i8,
    low: Option<i8>,
    c0: usize,
    blocks: usize,
    g: &mut [Block8],
    next: &NextGroup,
) {
    match low {
        Some(low) => transpose_narrow(qs, c0, blocks, g, low, next),
        None => transpose_bytes(qs, c0, blocks, g, next),
    }
}

/// 32 int8 per column block into the block's sixteen vectors of i16 pairs.
#[inline(always)]
pub(super) unsafe fn transpose_bytes(
    qs: *const i8,
    c0: usize,
    blocks: usize,
    g: &mut [Block8],
    next: &NextGroup,
) {
    let group = qs.add(c0 * blocks * BLOCK);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        next.transposing(b);
        let col =
            |c: usize| _mm256_loadu_si256(group.add((c * blocks + b) * BLOCK) as *const __m256i);
        set_pairs(blk, std::array::from_fn(col));
    }
}

/// The narrow kinds: 32 int8 per column block, less `low`, into the block's eight quad vectors.
#[inline(always)]
pub(super) unsafe fn transpose_narrow(
    qs: *const i8,
    c0: usize,
    blocks: usize,
    g: &mut [Block8],
    low: i8,
    next: &NextGroup,
) {
    let group = qs.add(c0 * blocks * BLOCK);
    let low = _mm256_set1_epi8(low);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        next.transposing(b);
        // row c of the 8 x 8 matrix of u32: column c's eight quads
        let rows: [__m256i; 8] = std::array::from_fn(|c| {
            _mm256_loadu_si256(group.add((c * blocks + b) * BLOCK) as *const __m256i)
        });
        for (t, quads) in transpose8(rows).into_iter().enumerate() {
            blk.pairs[t] = _mm256_sub_epi8(quads, low);
        }
    }
}

/// Each column's 32 int8 weights transposed a quad at a time, then widened in place: vector
/// `2t` holds weights `4t, 4t + 2` of every column as an i16 pair, vector `2t + 1` weights
/// `4t + 1, 4t + 3` (the order of `Activations::q16`).
///
/// Why that pairing: an i16 lane of a quad is the weights `4t + 2j` (low byte) and `4t + 2j + 1`
/// (high byte), so two shifts sign-extend each in place, where pairs of neighbours would need a
/// widening and a second transposition per half block: per group of eight columns 24 shuffles
/// and 24 shifts against 16 widenings and 48 shuffles (the Q8_0 head at eight rows 6.7 % faster).
#[inline(always)]
pub(super) unsafe fn set_pairs(blk: &mut Block8, cols: [__m256i; COLUMNS]) {
    for (t, quads) in transpose8(cols).into_iter().enumerate() {
        blk.pairs[2 * t] = _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(quads));
        blk.pairs[2 * t + 1] = _mm256_srai_epi16::<8>(quads);
    }
}
