//! The x86-64 path: AVX2 and FMA intrinsics. Same arithmetic and order as `plain.rs`.
//!
//! Per block of 32 weights: load its 16 (Q4) or 32 (Q8, Q6) bytes once, widen them to four vectors
//! of eight f32 and expand each with one FMA (`scale * q + offset`; Q6: one multiply by the
//! vector's own scale, two per block); then every row of the tile adds
//! four FMAs into its own eight-lane accumulator. The expanded block stays in registers for all
//! rows of the tile, so at eight rows a weight byte costs about a tenth of what it does at one.

use crate::tiling::{COLUMN_GROUP, ROW_TILE};
use crate::weights::{Weights, BLOCK};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether this CPU can run [`column`], and `KVPARK_CPU_ISA` lets it ([`crate::isa`]).
pub(crate) fn available() -> bool {
    crate::isa::avx2()
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn columns(
    x: &[f32],
    tile: usize,
    k: usize,
    w: Weights<'_>,
    c: usize,
    cols: usize,
    out: &mut [[f32; ROW_TILE]; COLUMN_GROUP],
) {
    for g in 0..cols {
        crate::plain::column(x, tile, k, w, c + g, &mut out[g]);
    }
}

/// `out[g][r] = x[r] . W[c + g]` for the `tile` rows of `x` and the `cols` columns from `c`
/// (`cols` at most [`COLUMN_GROUP`]). Bitwise `plain::column`'s result for each column.
///
/// # Safety
/// The CPU must have AVX2 and FMA ([`available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn columns(
    x: &[f32],
    tile: usize,
    k: usize,
    w: Weights<'_>,
    c: usize,
    cols: usize,
    out: &mut [[f32; ROW_TILE]; COLUMN_GROUP],
) {
    // A row's accumulator takes four dependent FMAs per block; with few rows, several columns
    // run side by side so the core has independent chains to overlap. Neither changes the order
    // of any one sum.
    match (tile, cols) {
        (1, 4) => group::<1, 4>(x, k, w, c, out),
        (2, 4) => group::<2, 4>(x, k, w, c, out),
        (3 | 4, 4) => {
            group::<4, 2>(x, k, w, c, out);
            let mut rest = [[0.0; ROW_TILE]; COLUMN_GROUP];
            group::<4, 2>(x, k, w, c + 2, &mut rest);
            out[2] = rest[0];
            out[3] = rest[1];
        }
        _ => {
            for (g, column) in out.iter_mut().enumerate().take(cols) {
                let mut one = [[0.0; ROW_TILE]; COLUMN_GROUP];
                match tile {
                    1 => group::<1, 1>(x, k, w, c + g, &mut one),
                    2 => group::<2, 1>(x, k, w, c + g, &mut one),
                    3 | 4 => group::<4, 1>(x, k, w, c + g, &mut one),
                    _ => group::<8, 1>(x, k, w, c + g, &mut one),
                }
                *column = one[0];
            }
        }
    }
}

/// `R` accumulators per column for `G` columns; rows past the tile read the tile's last row
/// again (their sums are computed and dropped), so `x` needs only `tile` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn group<const R: usize, const G: usize>(
    x: &[f32],
    k: usize,
    w: Weights<'_>,
    c: usize,
    out: &mut [[f32; ROW_TILE]; COLUMN_GROUP],
) {
    match w {
        Weights::Q4(w) => {
            assert!((c + G) * k / 2 <= w.qs.len() && (c + G) * k / 32 <= w.scale.len());
            assert!(w.scale.len() == w.offset.len());
            let blocks = Q4Blocks {
                qs: w.qs.as_ptr(),
                scale: w.scale.as_ptr(),
                offset: w.offset.as_ptr(),
            };
            group_of::<R, G, _>(x, k, blocks, c, out)
        }
        Weights::Q8(w) => {
            assert!((c + G) * k <= w.qs.len() && (c + G) * k / 32 <= w.scale.len());
            assert!(w.offset.is_none_or(|o| o.len() == w.scale.len()));
            let blocks = Q8Blocks {
                qs: w.qs.as_ptr(),
                scale: w.scale.as_ptr(),
                offset: w.offset.map(|o| o.as_ptr()),
            };
            group_of::<R, G, _>(x, k, blocks, c, out)
        }
        Weights::Q6(w) => {
            assert!((c + G) * k <= w.qs.len() && (c + G) * k / 16 <= w.scale.len());
            let blocks = Q6Blocks {
                qs: w.qs.as_ptr(),
                scale: w.scale.as_ptr(),
            };
            group_of::<R, G, _>(x, k, blocks, c, out)
        }
        Weights::Iq4(_) => unreachable!("expanded into q8 blocks first (iq4.rs)"),
        Weights::Dense(_) => unreachable!("dense matrices have their own product (dense/)"),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn group_of<const R: usize, const G: usize, B: Expand>(
    x: &[f32],
    k: usize,
    w: B,
    c: usize,
    out: &mut [[f32; ROW_TILE]; COLUMN_GROUP],
) {
    let blocks = k / BLOCK;
    let tile = x.len() / k;
    assert!(tile >= 1 && x.len() == tile * k);
    let row_at: [usize; R] = std::array::from_fn(|r| r.min(tile - 1) * k);
    let mut acc = [[_mm256_setzero_ps(); R]; G];
    let xp = x.as_ptr();
    for b in 0..blocks {
        for (g, accs) in acc.iter_mut().enumerate() {
            // the same block of the next group's columns: streams the weights ahead of use
            w.prefetch((c + G + g) * blocks + b);
            let wv = w.expand((c + g) * blocks + b);
            for (a, at) in accs.iter_mut().zip(row_at) {
                let xb = xp.add(at + b * BLOCK);
                for (v, wvv) in wv.iter().enumerate() {
                    *a = _mm256_fmadd_ps(*wvv, _mm256_loadu_ps(xb.add(v * 8)), *a);
                }
            }
        }
    }
    for g in 0..G {
        for r in 0..R.min(tile) {
            out[g][r] = hsum(acc[g][r]);
        }
    }
}

/// A block format: block `at` (`column * blocks + b`) as four vectors of eight f32 weights.
#[cfg(target_arch = "x86_64")]
trait Expand: Copy {
    /// # Safety
    /// `at` is a block of the matrix (the caller checked the bounds); AVX2 and FMA are present.
    unsafe fn expand(self, at: usize) -> [__m256; 4];

    /// Asks for block `at`'s bytes to be brought into cache; `at` may lie past the matrix.
    fn prefetch(self, at: usize);
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Q4Blocks {
    qs: *const u8,
    scale: *const f32,
    offset: *const f32,
}

#[cfg(target_arch = "x86_64")]
impl Expand for Q4Blocks {
    #[inline(always)]
    fn prefetch(self, at: usize) {
        // SAFETY: a prefetch never faults, and wrapping_add forms the address without UB.
        unsafe {
            _mm_prefetch(self.qs.wrapping_add(at * 16) as *const i8, _MM_HINT_T0);
            _mm_prefetch(self.scale.wrapping_add(at) as *const i8, _MM_HINT_T0);
            _mm_prefetch(self.offset.wrapping_add(at) as *const i8, _MM_HINT_T0);
        }
    }

    #[inline(always)]
    unsafe fn expand(self, at: usize) -> [__m256; 4] {
        let s = _mm256_set1_ps(*self.scale.add(at));
        let o = _mm256_set1_ps(*self.offset.add(at));
        let bytes = _mm_loadu_si128(self.qs.add(at * 16) as *const __m128i);
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(bytes, mask); // weights 0..16
        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask); // weights 16..32
        let q = [
            _mm256_cvtepu8_epi32(lo),
            _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
            _mm256_cvtepu8_epi32(hi),
            _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)),
        ];
        q.map(|v| _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(v), o))
    }
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Q8Blocks {
    qs: *const i8,
    scale: *const f32,
    offset: Option<*const f32>,
}

#[cfg(target_arch = "x86_64")]
impl Expand for Q8Blocks {
    #[inline(always)]
    fn prefetch(self, at: usize) {
        // SAFETY: as for Q4Blocks.
        unsafe {
            _mm_prefetch(self.qs.wrapping_add(at * 32), _MM_HINT_T0);
            _mm_prefetch(self.scale.wrapping_add(at) as *const i8, _MM_HINT_T0);
            if let Some(offset) = self.offset {
                _mm_prefetch(offset.wrapping_add(at) as *const i8, _MM_HINT_T0);
            }
        }
    }

    #[inline(always)]
    unsafe fn expand(self, at: usize) -> [__m256; 4] {
        let s = _mm256_set1_ps(*self.scale.add(at));
        let o = self.offset.map_or(0.0, |o| *o.add(at)); // plain.rs's offset: 0 where none
        let o = _mm256_set1_ps(o);
        let p = self.qs.add(at * 32) as *const __m128i;
        let (a, b) = (_mm_loadu_si128(p), _mm_loadu_si128(p.add(1)));
        let q = [
            _mm256_cvtepi8_epi32(a),
            _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)),
            _mm256_cvtepi8_epi32(b),
            _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)),
        ];
        q.map(|v| _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(v), o))
    }
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Q6Blocks {
    qs: *const i8,
    scale: *const f32,
}

#[cfg(target_arch = "x86_64")]
impl Expand for Q6Blocks {
    #[inline(always)]
    fn prefetch(self, at: usize) {
        // SAFETY: as for Q4Blocks.
        unsafe {
            _mm_prefetch(self.qs.wrapping_add(at * 32), _MM_HINT_T0);
            _mm_prefetch(self.scale.wrapping_add(2 * at) as *const i8, _MM_HINT_T0);
        }
    }

    #[inline(always)]
    unsafe fn expand(self, at: usize) -> [__m256; 4] {
        // weights 0..16 take the block's first scale, 16..32 its second (plain.rs's order)
        let lo = _mm256_set1_ps(*self.scale.add(2 * at));
        let hi = _mm256_set1_ps(*self.scale.add(2 * at + 1));
        let p = self.qs.add(at * 32) as *const __m128i;
        let (a, b) = (_mm_loadu_si128(p), _mm_loadu_si128(p.add(1)));
        let q = [
            _mm256_cvtepi8_epi32(a),
            _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)),
            _mm256_cvtepi8_epi32(b),
            _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)),
        ];
        let s = [lo, lo, hi, hi];
        std::array::from_fn(|v| _mm256_mul_ps(s[v], _mm256_cvtepi32_ps(q[v])))
    }
}

/// The eight lanes summed in `plain::hsum`'s tree.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); // l0+l4 ..
    let b = _mm_add_ps(a, _mm_movehl_ps(a, a)); // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
    _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)))
}
