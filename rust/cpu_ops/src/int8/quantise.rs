//! The activation rule of [`crate::int8`], block by block: plain Rust, and AVX2 for the SIMD
//! kernels. The same operations on the same values in both (an integer maximum, an f32 division,
//! an f32 reciprocal, f32 products, rounding to nearest even), so the same bits.

use crate::weights::BLOCK;

/// Bits of `|x|` at or above these are an inf or NaN.
const NON_FINITE: u32 = 0x7f80_0000;

/// A block's scale from the bits of its largest `|x|`: `(d, Some(1 / d))`, or `(d, None)` where
/// every `q` is 0 (NaN for a non-finite block, 0 for one too small to quantise).
fn scale(amax_bits: u32) -> (f32, Option<f32>) {
    if amax_bits >= NON_FINITE {
        return (f32::NAN, None);
    }
    let d = f32::from_bits(amax_bits) / 127.0;
    if d < f32::MIN_POSITIVE {
        (0.0, None) // 1 / d would overflow, or lose bits to the subnormal range
    } else {
        (d, Some(1.0 / d))
    }
}

/// One block's values besides its quants: `d`, `Σ q`, and `Σ q` over quants 0..16 and 16..32
/// (`wide.rs`'s Q6 kinds correct their two half dots by them). The sums are exact integers.
pub(super) struct Sums<'a> {
    pub d: &'a mut [f32],
    pub sum: &'a mut [f32],
    pub lo: &'a mut [f32],
    /// `-128` times `sum`, `lo` and `hi`, as i32 (`super::Activations::bias`).
    pub bias: &'a mut [[i32; 3]],
    pub hi: &'a mut [f32],
}

/// One row: `q` `[k]`, each of `out` at least `[k / 32]` (only those written).
///
/// `simd` asks for the AVX2 quantiser; the caller checked the CPU has AVX2 (an int8 kernel other
/// than plain passed [`super::I8Kernel::assert_runs_here`]).
pub(super) fn row(x: &[f32], q: &mut [i8], out: Sums<'_>, simd: bool) {
    let Sums {
        d,
        sum,
        lo,
        hi,
        bias,
    } = out;
    let least = d
        .len()
        .min(sum.len())
        .min(lo.len())
        .min(hi.len())
        .min(bias.len());
    assert!(x.len() == q.len() && x.len().is_multiple_of(BLOCK) && least >= x.len() / 32);
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: AVX2 is present (above); the lengths were checked.
        unsafe {
            avx2_row(
                x,
                q,
                Sums {
                    d,
                    sum,
                    lo,
                    hi,
                    bias,
                },
            )
        };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd; // no SIMD quantiser elsewhere
    for (b, (xb, qb)) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .enumerate()
    {
        let amax_bits = xb.iter().map(|v| v.to_bits() & 0x7fff_ffff).max();
        let (db, inverse) = scale(amax_bits.unwrap_or(0));
        let mut s = [0i32; 2];
        for (i, (qi, xi)) in qb.iter_mut().zip(xb).enumerate() {
            // |x * (1 / d)| < 127.5 (see crate::int8), so the conversion never saturates
            *qi = inverse.map_or(0, |id| (xi * id).round_ties_even() as i8);
            s[i / (BLOCK / 2)] += i32::from(*qi);
        }
        d[b] = db;
        (lo[b], hi[b]) = (s[0] as f32, s[1] as f32);
        sum[b] = (s[0] + s[1]) as f32;
        bias[b] = [s[0] + s[1], s[0], s[1]].map(|s| -128 * s);
    }
}

/// # Safety
/// The CPU has AVX2; `row`'s lengths hold.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_row(x: &[f32], q: &mut [i8], out: Sums<'_>) {
    let Sums {
        d,
        sum,
        lo,
        hi,
        bias,
    } = out;
    use std::arch::x86_64::*;
    let magnitude = _mm256_set1_epi32(0x7fff_ffff);
    // vpackssdw / vpacksswb interleave 128-bit halves; this puts the dwords back in order
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..x.len() / BLOCK {
        let p = x.as_ptr().add(b * BLOCK);
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i)));
        let a = v.map(|v| _mm256_and_si256(_mm256_castps_si256(v), magnitude));
        let m = _mm256_max_epi32(_mm256_max_epi32(a[0], a[1]), _mm256_max_epi32(a[2], a[3]));
        let (db, inverse) = scale(hmax(m));
        let out = q.as_mut_ptr().add(b * BLOCK) as *mut __m256i;
        let Some(id) = inverse else {
            _mm256_storeu_si256(out, _mm256_setzero_si256());
            (d[b], sum[b], lo[b], hi[b]) = (db, 0.0, 0.0, 0.0);
            bias[b] = [0; 3];
            continue;
        };
        let id = _mm256_set1_ps(id);
        let i = v.map(|v| {
            let t = _mm256_mul_ps(v, id);
            // integral after the rounding, so the conversion is exact whatever MXCSR says
            _mm256_cvtps_epi32(_mm256_round_ps::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(t))
        });
        let (first, second) = (
            hsum_i32(_mm256_add_epi32(i[0], i[1])),
            hsum_i32(_mm256_add_epi32(i[2], i[3])),
        );
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        );
        _mm256_storeu_si256(out, _mm256_permutevar8x32_epi32(bytes, order));
        (d[b], lo[b], hi[b]) = (db, first as f32, second as f32);
        sum[b] = (first + second) as f32;
        bias[b] = [first + second, first, second].map(|s| -128 * s);
    }
}

/// The largest of eight i32 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hmax(v: std::arch::x86_64::__m256i) -> u32 {
    use std::arch::x86_64::*;
    let m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let m = _mm_max_epi32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
    let m = _mm_max_epi32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
    _mm_cvtsi128_si32(m) as u32
}

/// The sum of eight i32 lanes (exact: a block's sum is at most 32 * 127).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum_i32(v: std::arch::x86_64::__m256i) -> i32 {
    use std::arch::x86_64::*;
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}
