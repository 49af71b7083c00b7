//! The x86-64 int8 kernel both SIMD paths share; each supplies its integer dot ([`Dot`]) and
//! compiles this under its own `#[target_feature]` (everything here is `inline(always)`).
//!
//! Per column: its blocks are unpacked, [`CHUNK`] at a time, into 32 u8 operands each (nibbles for
//! Q4, `|w|` for Q8) on the stack; then every row of the tile, eight blocks at a time, takes eight
//! integer dots (eight i32 lanes each), reduces them into one vector of eight block sums, and
//! adds the group into its accumulator with one FMA (two with offsets): the order `int8` fixes.

use std::arch::x86_64::*;

use super::{Activations, LANES, PREFETCH_BLOCKS};
use crate::threads::Output;
use crate::tiling::ROW_TILE;
use crate::weights::{Weights, BLOCK};

/// A u8 x i8 dot: lane `j` of the result is `Σ_{i<4} u[4j+i] * s[4j+i]`, exact (see `int8`).
pub(super) trait Dot {
    /// # Safety
    /// The CPU has the instructions the implementation uses.
    unsafe fn dot(u: __m256i, s: __m256i) -> __m256i;

    /// `dot(u1, s1) + dot(u2, s2)` (lane by lane, exact).
    ///
    /// # Safety
    /// As for [`Dot::dot`].
    #[inline(always)]
    unsafe fn pair(u1: __m256i, s1: __m256i, u2: __m256i, s2: __m256i) -> __m256i {
        _mm256_add_epi32(Self::dot(u1, s1), Self::dot(u2, s2))
    }
}

/// Blocks unpacked at a time (a multiple of [`LANES`], so groups stay aligned to lanes): 2 KiB.
const CHUNK: usize = 64;

/// A column's unpacked blocks: the u8 operands and, for Q8, the signed quants whose signs the
/// activations take.
pub(super) struct Unpacked {
    u: [__m256i; CHUNK],
    signs: [__m256i; CHUNK],
}

/// Output columns `cols` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX2, FMA and what `D` uses.
#[inline(always)]
pub(super) unsafe fn columns<D: Dot>(
    a: &Activations<'_>,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    let blocks = a.k / BLOCK;
    assert!(
        cols.end <= w.n() && a.k == w.k() && a.padded >= blocks && a.padded.is_multiple_of(LANES)
    );
    assert!(a.q.len() == a.rows * a.k && a.d.len().min(a.sum.len()) == a.rows * a.padded);
    match w {
        Weights::Q4(w) => {
            assert!(w.qs.len() == w.n * blocks * 16 && w.scale.len() == w.n * blocks);
            assert!(w.offset.len() == w.scale.len());
            let f = Q4 {
                qs: w.qs.as_ptr(),
                scale: w.scale.as_ptr(),
            };
            columns_of::<D, Q4>(a, f, Some(w.offset.as_ptr()), w.n, cols, y)
        }
        Weights::Q8(w) => {
            assert!(w.qs.len() == w.n * blocks * 32 && w.scale.len() == w.n * blocks);
            assert!(w.offset.is_none_or(|o| o.len() == w.scale.len()));
            let f = Q8 {
                qs: w.qs.as_ptr(),
                scale: w.scale.as_ptr(),
            };
            let offset = w.offset.map(|o| o.as_ptr());
            match w.low {
                Some(low) => {
                    columns_of::<D, Narrow>(a, Narrow { q8: f, low }, offset, w.n, cols, y)
                }
                None => columns_of::<D, Q8>(a, f, offset, w.n, cols, y),
            }
        }
        Weights::Q6(w) => super::q6::columns::<D>(a, w, cols, y),
        Weights::Iq4(_) => unreachable!("expanded into q8 blocks first (iq4.rs)"),
        Weights::Dense(_) => unreachable!("matmul_i8 refuses dense matrices"),
    }
}

#[inline(always)]
unsafe fn columns_of<D: Dot, F: Format>(
    a: &Activations<'_>,
    w: F,
    offset: Option<*const f32>,
    n: usize,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    let blocks = a.k / BLOCK;
    let mut unpacked = Unpacked {
        u: [_mm256_setzero_si256(); CHUNK],
        signs: [_mm256_setzero_si256(); CHUNK],
    };
    let mut out = [0.0f32; ROW_TILE];
    for c in cols {
        for r0 in (0..a.rows).step_by(ROW_TILE) {
            let tile = ROW_TILE.min(a.rows - r0);
            column::<D, F>(
                a,
                r0..r0 + tile,
                w,
                offset,
                c * blocks,
                &mut unpacked,
                &mut out,
            );
            for (r, v) in out[..tile].iter().enumerate() {
                y.set((r0 + r) * n + c, *v);
            }
        }
    }
}

/// `out[r - rows.start]` for the rows of the tile against the column whose first block is
/// `base`.
#[inline(always)]
unsafe fn column<D: Dot, F: Format>(
    a: &Activations<'_>,
    rows: std::ops::Range<usize>,
    w: F,
    offset: Option<*const f32>,
    base: usize,
    unpacked: &mut Unpacked,
    out: &mut [f32; ROW_TILE],
) {
    let blocks = a.k / BLOCK;
    // one row uses each block once: unpacked straight into registers, not through the stack
    let single = rows.len() == 1;
    let mut acc = [_mm256_setzero_ps(); ROW_TILE];
    let mut b0 = 0;
    while b0 < blocks {
        let len = CHUNK.min(blocks - b0);
        for j in (0..len).filter(|_| !single) {
            w.prefetch(base + PREFETCH_BLOCKS + b0 + j);
            let (u, signs) = w.unpack(base + b0 + j);
            unpacked.u[j] = u;
            if F::SIGNED {
                unpacked.signs[j] = signs;
            }
        }
        for g in (0..len).step_by(LANES) {
            let m = LANES.min(len - g);
            let at = base + b0 + g;
            // the scales (and offsets) of the blocks the quants' prefetch reaches: a group's
            // eight are half a cache line
            let ahead = at + PREFETCH_BLOCKS;
            _mm_prefetch(w.scale().wrapping_add(ahead) as *const i8, _MM_HINT_T0);
            if let Some(o) = offset {
                _mm_prefetch(o.wrapping_add(ahead) as *const i8, _MM_HINT_T0);
            }
            let scale = load_lanes(w.scale().add(at), m);
            let off = offset.map(|o| load_lanes(o.add(at), m));
            for (r, acc) in rows.clone().zip(acc.iter_mut()) {
                let xq = a.q.as_ptr().add(r * a.k + (b0 + g) * BLOCK);
                let sums = if single {
                    group::<D, F>(m, xq, |j| {
                        w.prefetch(at + PREFETCH_BLOCKS + j);
                        w.unpack(at + j)
                    })
                } else {
                    group::<D, F>(m, xq, |j| (unpacked.u[g + j], unpacked.signs[g + j]))
                };
                let mut isum = _mm256_cvtepi32_ps(reduce(&sums));
                let at_x = r * a.padded + b0 + g;
                if let Some(low) = w.low() {
                    // Σ w q = Σ (w - low) q + low Σ q: integers below 2^24, so exact
                    let sum = _mm256_loadu_ps(a.sum.as_ptr().add(at_x));
                    isum = _mm256_fmadd_ps(_mm256_set1_ps(f32::from(low)), sum, isum);
                }
                let d = _mm256_loadu_ps(a.d.as_ptr().add(at_x));
                *acc = _mm256_fmadd_ps(_mm256_mul_ps(scale, d), isum, *acc);
                if let Some(off) = off {
                    let sum = _mm256_loadu_ps(a.sum.as_ptr().add(at_x));
                    *acc = _mm256_fmadd_ps(_mm256_mul_ps(off, d), sum, *acc);
                }
            }
        }
        b0 += len;
    }
    for (o, acc) in out.iter_mut().zip(&acc).take(rows.len()) {
        *o = crate::avx2::hsum(*acc);
    }
}

/// The integer dots of the group's `m` blocks from `xq` against `operand(j)` (block `j`'s u8
/// operand and signs); zero for the rest of the group.
#[inline(always)]
unsafe fn group<D: Dot, F: Format>(
    m: usize,
    xq: *const i8,
    operand: impl Fn(usize) -> (__m256i, __m256i),
) -> [__m256i; LANES] {
    // the length as a constant: no branch per block in the full groups
    match m {
        8 => dots::<D, F, 8>(xq, operand),
        7 => dots::<D, F, 7>(xq, operand),
        6 => dots::<D, F, 6>(xq, operand),
        5 => dots::<D, F, 5>(xq, operand),
        4 => dots::<D, F, 4>(xq, operand),
        3 => dots::<D, F, 3>(xq, operand),
        2 => dots::<D, F, 2>(xq, operand),
        _ => dots::<D, F, 1>(xq, operand),
    }
}

#[inline(always)]
unsafe fn dots<D: Dot, F: Format, const M: usize>(
    xq: *const i8,
    operand: impl Fn(usize) -> (__m256i, __m256i),
) -> [__m256i; LANES] {
    let mut sums = [_mm256_setzero_si256(); LANES];
    for (j, s) in sums.iter_mut().enumerate().take(M) {
        let (u, signs) = operand(j);
        let mut xv = _mm256_loadu_si256(xq.add(j * BLOCK) as *const __m256i);
        if F::SIGNED {
            xv = _mm256_sign_epi8(xv, signs);
        }
        *s = D::dot(u, xv);
    }
    sums
}

/// Eight blocks' i32 lanes to one vector of eight block sums (exact integer adds, any order).
#[inline(always)]
unsafe fn reduce(v: &[__m256i; LANES]) -> __m256i {
    let (first, second) = halves(v);
    _mm256_add_epi32(first, second)
}

/// Eight blocks' i32 lanes to two vectors of eight: each block's sum over its bytes 0..16 (the
/// low 128 bits of its vector), then over 16..32 (exact integer adds).
#[inline(always)]
pub(super) unsafe fn halves(v: &[__m256i; LANES]) -> (__m256i, __m256i) {
    // per 128-bit half: h01 = [v0 01, v0 23, v1 01, v1 23], then h0123 = [v0, v1, v2, v3]
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    let h0123 = _mm256_hadd_epi32(h01, h23);
    let h4567 = _mm256_hadd_epi32(h45, h67);
    // low halves [v0..v3 | v4..v7], high halves [v0..v3 | v4..v7]
    let low = _mm256_permute2x128_si256::<0x20>(h0123, h4567);
    let high = _mm256_permute2x128_si256::<0x31>(h0123, h4567);
    (low, high)
}

/// `m` f32 from `p`, +0 in the lanes past them (which may lie past the matrix: masked lanes
/// are never read).
#[inline(always)]
pub(super) unsafe fn load_lanes(p: *const f32, m: usize) -> __m256 {
    if m == LANES {
        _mm256_loadu_ps(p)
    } else {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(m as i32), lane))
    }
}

/// A weight format's blocks as u8 operands.
trait Format: Copy {
    /// Whether the activations take the weights' signs (the operand is `|w|`).
    const SIGNED: bool;

    /// Block `at`'s operand and (where [`Self::SIGNED`]) its signed quants.
    ///
    /// # Safety
    /// `at` is a block of the matrix; AVX2 is present.
    unsafe fn unpack(self, at: usize) -> (__m256i, __m256i);

    /// Asks for block `at`'s quants to be brought into cache; `at` may lie past the matrix.
    fn prefetch(self, at: usize);

    fn scale(self) -> *const f32;

    /// What the operands are less than the quants (`Q8Weights::low`), to be taken back.
    #[inline(always)]
    fn low(self) -> Option<i8> {
        None
    }
}

#[derive(Clone, Copy)]
struct Q4 {
    qs: *const u8,
    scale: *const f32,
}

impl Format for Q4 {
    const SIGNED: bool = false;

    #[inline(always)]
    unsafe fn unpack(self, at: usize) -> (__m256i, __m256i) {
        let bytes = _mm_loadu_si128(self.qs.add(at * 16) as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(bytes, mask); // weights 0..16
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), mask); // weights 16..32
        let u = _mm256_set_m128i(hi, lo);
        (u, u)
    }

    #[inline(always)]
    fn prefetch(self, at: usize) {
        // SAFETY: a prefetch never faults, and wrapping_add forms the address without UB.
        unsafe { _mm_prefetch(self.qs.wrapping_add(at * 16) as *const i8, _MM_HINT_T0) };
    }

    #[inline(always)]
    fn scale(self) -> *const f32 {
        self.scale
    }
}

#[derive(Clone, Copy)]
struct Q8 {
    qs: *const i8,
    scale: *const f32,
}

impl Format for Q8 {
    const SIGNED: bool = true;

    #[inline(always)]
    unsafe fn unpack(self, at: usize) -> (__m256i, __m256i) {
        let w = _mm256_loadu_si256(self.qs.add(at * 32) as *const __m256i);
        // |-128| is 128 read as u8; x * sign(w) stays in [-127, 127]
        (_mm256_abs_epi8(w), w)
    }

    #[inline(always)]
    fn prefetch(self, at: usize) {
        // SAFETY: as for Q4.
        unsafe { _mm_prefetch(self.qs.wrapping_add(at * 32), _MM_HINT_T0) };
    }

    #[inline(always)]
    fn scale(self) -> *const f32 {
        self.scale
    }
}

/// Q8 blocks whose quants span fewer than 32 values (`Q8Weights::low`): the operand is
/// `w - low` as u8, no signs to apply, and each block's sum takes `low Σ q` back.
#[derive(Clone, Copy)]
struct Narrow {
    q8: Q8,
    low: i8,
}

impl Format for Narrow {
    const SIGNED: bool = false;

    #[inline(always)]
    unsafe fn unpack(self, at: usize) -> (__m256i, __m256i) {
        let w = _mm256_loadu_si256(self.q8.qs.add(at * 32) as *const __m256i);
        let u = _mm256_sub_epi8(w, _mm256_set1_epi8(self.low));
        (u, u)
    }

    #[inline(always)]
    fn prefetch(self, at: usize) {
        self.q8.prefetch(at)
    }

    #[inline(always)]
    fn scale(self) -> *const f32 {
        self.q8.scale
    }

    #[inline(always)]
    fn low(self) -> Option<i8> {
        Some(self.low)
    }
}
