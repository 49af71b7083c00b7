//! The 8 x 8 transposition of 32-bit lanes with which `wide_avx2.rs` turns the rows of eight
//! columns into operand vectors.

use std::arch::x86_64::*;

/// The transpose of the 8 x 8 matrix of u32 whose rows are the eight vectors.
#[inline(always)]
pub(super) unsafe fn transpose8(v: [__m256i; 8]) -> [__m256i; 8] {
    // per 128-bit half a 4 x 4 transpose, rows 0-3 and rows 4-7 apart: half h of `low[t]` holds
    // element t + 4h of rows 0..4, of `high[t]` of rows 4..8
    let low = transpose4([v[0], v[1], v[2], v[3]]);
    let high = transpose4([v[4], v[5], v[6], v[7]]);
    std::array::from_fn(|e| {
        let t = e % 4;
        if e < 4 {
            _mm256_permute2x128_si256::<0x20>(low[t], high[t])
        } else {
            _mm256_permute2x128_si256::<0x31>(low[t], high[t])
        }
    })
}

/// Per 128-bit half, the transpose of the 4 x 4 matrix of u32 whose rows are the four vectors.
#[inline(always)]
unsafe fn transpose4(v: [__m256i; 4]) -> [__m256i; 4] {
    let lo01 = _mm256_unpacklo_epi32(v[0], v[1]);
    let hi01 = _mm256_unpackhi_epi32(v[0], v[1]);
    let lo23 = _mm256_unpacklo_epi32(v[2], v[3]);
    let hi23 = _mm256_unpackhi_epi32(v[2], v[3]);
    [
        _mm256_unpacklo_epi64(lo01, lo23),
        _mm256_unpackhi_epi64(lo01, lo23),
        _mm256_unpacklo_epi64(hi01, hi23),
        _mm256_unpackhi_epi64(hi01, hi23),
    ]
}
