//! `wide.rs`'s per-call transposition: each group of sixteen columns' blocks into [`Block16`]s
//! (u8 quads, the sign bits flipped where the kind is signed; the columns' scales and offsets as
//! vectors), asking for the next group's bytes as it goes (`group_fetch.rs`).

use std::arch::x86_64::*;

use super::Block16;
use crate::int8::group_fetch::NextGroup;
use crate::iq4::IQ4_TABLE;
use crate::weights::{Iq4Weights, Q4Weights, Q6Weights, Q8Weights, BLOCK};

/// The sixteen columns' value of each of `blocks` blocks from `p` (`[n, blocks * per]`, column
/// `c`'s block `b` at `c * blocks * per + b * per + h`).
#[inline(always)]
unsafe fn gather(
    p: *const f32,
    c0: usize,
    blocks: usize,
    per: usize,
    b: usize,
    h: usize,
) -> __m512 {
    let stride = (blocks * per) as i32;
    let index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride),
    );
    let base = p.add(c0 * blocks * per + b * per + h);
    _mm512_i32gather_ps::<4>(index, base)
}

/// Q4: column `c`'s block `b` is 16 bytes, byte `i` holding weight `i` (low nibble) and `i + 16`.
#[inline(always)]
pub(super) unsafe fn transpose_q4(
    w: Q4Weights<'_>,
    c0: usize,
    blocks: usize,
    g: &mut [Block16],
    next: &NextGroup,
) {
    let qs = w.qs.as_ptr();
    let group = qs.add(c0 * blocks * 16);
    let mask = _mm512_set1_epi8(0x0f);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        next.transposing(b);
        let col = |c: usize| _mm_loadu_si128(group.add((c * blocks + b) * 16) as *const __m128i);
        // v[i] holds columns i, i + 4, i + 8, i + 12 in its four 128-bit lanes; a 4 x 4
        // transpose of u32 in every lane then gives vector t = quad t of columns 0..16
        let v: [__m512i; 4] = std::array::from_fn(|i| {
            let v = _mm512_castsi128_si512(col(i));
            let v = _mm512_inserti32x4::<1>(v, col(i + 4));
            let v = _mm512_inserti32x4::<2>(v, col(i + 8));
            _mm512_inserti32x4::<3>(v, col(i + 12))
        });
        let t = transpose4(v);
        for (i, t) in t.iter().enumerate() {
            blk.quads[i] = _mm512_and_si512(*t, mask); // weights 4i..4i + 4
            blk.quads[4 + i] = _mm512_and_si512(_mm512_srli_epi16::<4>(*t), mask);
            // 16 + 4i..
        }
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 1, b, 0);
        blk.offset = gather(w.offset.as_ptr(), c0, blocks, 1, b, 0);
    }
}

/// IQ4: Q4's nibbles, each looked up in the table (`vpshufb`) into its int8 weight and then
/// flipped as Q8's are: the q8 blocks the table gives, so the q8 kind's sums and correction.
#[inline(always)]
pub(super) unsafe fn transpose_iq4(
    w: Iq4Weights<'_>,
    c0: usize,
    blocks: usize,
    g: &mut [Block16],
    next: &NextGroup,
) {
    let qs = w.qs.as_ptr();
    let group = qs.add(c0 * blocks * 16);
    let mask = _mm512_set1_epi8(0x0f);
    let flip = _mm512_set1_epi8(i8::MIN);
    let table = _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4_TABLE.as_ptr().cast()));
    let weights = |nibbles: __m512i| _mm512_xor_si512(_mm512_shuffle_epi8(table, nibbles), flip);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        next.transposing(b);
        let col = |c: usize| _mm_loadu_si128(group.add((c * blocks + b) * 16) as *const __m128i);
        let v: [__m512i; 4] = std::array::from_fn(|i| {
            let v = _mm512_castsi128_si512(col(i));
            let v = _mm512_inserti32x4::<1>(v, col(i + 4));
            let v = _mm512_inserti32x4::<2>(v, col(i + 8));
            _mm512_inserti32x4::<3>(v, col(i + 12))
        });
        for (i, t) in transpose4(v).iter().enumerate() {
            blk.quads[i] = weights(_mm512_and_si512(*t, mask));
            blk.quads[4 + i] = weights(_mm512_and_si512(_mm512_srli_epi16::<4>(*t), mask));
        }
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 1, b, 0);
    }
}

/// Q8: column `c`'s block `b` is 32 int8.
#[inline(always)]
pub(super) unsafe fn transpose_q8(
    w: Q8Weights<'_>,
    c0: usize,
    blocks: usize,
    g: &mut [Block16],
    next: &NextGroup,
) {
    transpose_bytes(w.qs.as_ptr(), c0, blocks, g, next);
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
    g: &mut [Block16],
    next: &NextGroup,
) {
    transpose_bytes(w.qs.as_ptr(), c0, blocks, g, next);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 2, b, 0);
        blk.scale[1] = gather(w.scale.as_ptr(), c0, blocks, 2, b, 1);
    }
}

/// 32 int8 per column block into eight vectors of u8 quads, the sign bits flipped; the next
/// group's quants and its `values` (each an array's start and f32 per block, or null) asked for.
#[inline(always)]
unsafe fn transpose_bytes(
    qs: *const i8,
    c0: usize,
    blocks: usize,
    g: &mut [Block16],
    next: &NextGroup,
) {
    let group = qs.add(c0 * blocks * BLOCK);
    let flip = _mm512_set1_epi8(i8::MIN);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        next.transposing(b);
        let col =
            |c: usize| _mm256_loadu_si256(group.add((c * blocks + b) * BLOCK) as *const __m256i);
        // v[i] holds column i in its low half and i + 8 in its high half; an 8 x 8 transpose of
        // u32 per half then gives vector j = quad j of columns 0..8 | 8..16
        let v: [__m512i; 8] = std::array::from_fn(|i| {
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(col(i)), col(i + 8))
        });
        for (j, t) in transpose8(v).iter().enumerate() {
            blk.quads[j] = _mm512_xor_si512(*t, flip);
        }
    }
}

/// Per 128-bit lane, the transpose of the 4 x 4 matrix of u32 whose rows are the four vectors.
#[inline(always)]
unsafe fn transpose4(v: [__m512i; 4]) -> [__m512i; 4] {
    let lo01 = _mm512_unpacklo_epi32(v[0], v[1]);
    let hi01 = _mm512_unpackhi_epi32(v[0], v[1]);
    let lo23 = _mm512_unpacklo_epi32(v[2], v[3]);
    let hi23 = _mm512_unpackhi_epi32(v[2], v[3]);
    [
        _mm512_unpacklo_epi64(lo01, lo23),
        _mm512_unpackhi_epi64(lo01, lo23),
        _mm512_unpacklo_epi64(hi01, hi23),
        _mm512_unpackhi_epi64(hi01, hi23),
    ]
}

/// Per 256-bit half, the transpose of the 8 x 8 matrix of u32 whose rows are the eight vectors.
#[inline(always)]
unsafe fn transpose8(r: [__m512i; 8]) -> [__m512i; 8] {
    // within each 128-bit lane: elements 0 and 1 (then 2 and 3) of rows 0-3 and of rows 4-7
    let t01 = transpose4([r[0], r[1], r[2], r[3]]);
    let t45 = transpose4([r[4], r[5], r[6], r[7]]);
    // per 256-bit half: the low 128 bits of rows 0-3 with those of rows 4-7 (quads 0..4), then
    // the high 128 bits (quads 4..8); lanes 0, 2 of the 512-bit result from `a`, 1, 3 from `b`
    let low = |a: __m512i, b: __m512i| {
        _mm512_permutex2var_epi64(a, _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), b)
    };
    let high = |a: __m512i, b: __m512i| {
        _mm512_permutex2var_epi64(a, _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15), b)
    };
    [
        low(t01[0], t45[0]),
        low(t01[1], t45[1]),
        low(t01[2], t45[2]),
        low(t01[3], t45[3]),
        high(t01[0], t45[0]),
        high(t01[1], t45[1]),
        high(t01[2], t45[2]),
        high(t01[3], t45[3]),
    ]
}
