//! The AVX2 kernel: per row, two 8-lane accumulators (lanes 0-7 and 8-15 of `mod.rs`'s order);
//! each chunk of 16 weights widened once into two vectors (F16C's `vcvtph2ps` for f16, a
//! zero-extend and shift for bf16) and multiplied into every row of the tile.

use std::arch::x86_64::*;

use super::format::{Bf16, Format, F16, F32};
use super::{Lanes, Line, LANES, PREFETCH_AHEAD, PREFETCH_HINT};
use crate::lane_tree::fold8;
use crate::tiling::{COLUMN_GROUP, ROW_TILE};

/// A format's chunk of 16 values as two vectors of eight f32, widened exactly.
pub(crate) trait Load: Format {
    /// Whether a load converts (f16, bf16) rather than only reads (f32).
    const WIDENS: bool;

    /// # Safety
    /// `p` points at 16 values; the CPU has AVX2, FMA and F16C.
    unsafe fn load(p: *const Self::Raw) -> [__m256; 2];

    /// Eight values as one vector: either half of [`Load::load`]'s chunk.
    ///
    /// # Safety
    /// `p` points at 8 values; the CPU has AVX2, FMA and F16C.
    unsafe fn load8(p: *const Self::Raw) -> __m256;
}

impl Load for F32 {
    const WIDENS: bool = false;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> [__m256; 2] {
        [Self::load8(p), Self::load8(p.add(8))]
    }

    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl Load for F16 {
    const WIDENS: bool = true;

    #[inline(always)]
    unsafe fn load(p: *const u16) -> [__m256; 2] {
        [Self::load8(p), Self::load8(p.add(8))]
    }

    #[inline(always)]
    unsafe fn load8(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

impl Load for Bf16 {
    const WIDENS: bool = true;

    #[inline(always)]
    unsafe fn load(p: *const u16) -> [__m256; 2] {
        [Self::load8(p), Self::load8(p.add(8))]
    }

    #[inline(always)]
    unsafe fn load8(p: *const u16) -> __m256 {
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))
    }
}

/// As `plain::lanes`, bit for bit.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` holds `tile` rows of `k`, `w` `cols` columns of `k`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn lanes<F: Load>(
    x: &[f32],
    tile: usize,
    k: usize,
    w: &[F::Raw],
    cols: usize,
    out: &mut Lanes,
) {
    // A row's two accumulators are two dependent FMA chains; with few rows, columns run side
    // by side so the core has independent chains to overlap. Neither changes any one sum.
    match (tile, cols) {
        (1, 4) => group::<1, 4, F>(x, 0, 1, k, w, 0, out),
        (2, 4) => {
            group::<2, 2, F>(x, 0, 2, k, w, 0, out);
            group::<2, 2, F>(x, 0, 2, k, w, 2, out);
        }
        (1, _) => (0..cols).for_each(|g| group::<1, 1, F>(x, 0, 1, k, w, g, out)),
        (2, _) => (0..cols).for_each(|g| group::<2, 1, F>(x, 0, 2, k, w, g, out)),
        // f32 from five rows: two columns' weights streaming at once, three rows at a time
        // (twelve accumulators); one column's four rows at a time streamed an f32 matrix from
        // memory ~12 % slower (eight rows, one core, Sapphire Rapids VM held to AVX2). Widened
        // formats keep one column: each pass over a column pair would widen its weights again.
        (5.., 4) if !F::WIDENS => {
            for g in [0, 2] {
                for r0 in (0..tile).step_by(3) {
                    group::<3, 2, F>(x, r0, (tile - r0).min(3), k, w, g, out);
                }
            }
        }
        // widened formats from six rows: a column's lanes 0-7 over the whole row, then lanes
        // 8-15, every row of the tile at once, so each weight is widened once for all of them
        (6.., _) if F::WIDENS => {
            (0..cols).for_each(|g| halves::<ROW_TILE, F>(x, tile, k, w, g, out))
        }
        _ => {
            for r0 in (0..tile).step_by(4) {
                let t = (tile - r0).min(4);
                (0..cols).for_each(|g| group::<4, 1, F>(x, r0, t, k, w, g, out));
            }
        }
    }
}

/// Rows `0..t` (`t <= R`; rows past `t` read row `t - 1` again and are dropped) against column
/// `g`, one half of the lanes at a time: `R` accumulators for lanes 0-7 over every chunk, then
/// for lanes 8-15. Each lane takes the same products in the same order as in [`group`].
///
/// Why: [`group`] holds two accumulators a row, so sixteen registers fit four rows, and eight
/// rows widened every weight twice; the conversion shares the multiply ports with the FMAs
/// (`vcvtph2ps`, bf16's shift), about a fifth of them at eight rows.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn halves<const R: usize, F: Load>(
    x: &[f32],
    t: usize,
    k: usize,
    w: &[F::Raw],
    g: usize,
    out: &mut Lanes,
) {
    let chunks = k / LANES;
    assert!(t >= 1 && t <= R && t * k <= x.len() && (g + 1) * k <= w.len());
    let row_at: [usize; R] = std::array::from_fn(|r| r.min(t - 1) * k);
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    for h in 0..2 {
        let mut acc = [_mm256_setzero_ps(); R];
        for ch in 0..chunks {
            let at = g * k + ch * LANES + 8 * h;
            _mm_prefetch(
                wp.wrapping_add(at + PREFETCH_AHEAD) as *const i8,
                PREFETCH_HINT,
            );
            let wv = F::load8(wp.add(at));
            for (a, row) in acc.iter_mut().zip(row_at) {
                let xv = _mm256_loadu_ps(xp.add(row + ch * LANES + 8 * h));
                *a = _mm256_fmadd_ps(wv, xv, *a);
            }
        }
        for (r, a) in acc.iter().enumerate().take(t) {
            _mm256_storeu_ps(out[g][r].as_mut_ptr().add(8 * h), *a);
        }
    }
}

/// Rows `r0..r0 + t` (`t <= R`; rows past `t` read row `r0 + t - 1` again and are dropped)
/// against columns `g0..g0 + G`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn group<const R: usize, const G: usize, F: Load>(
    x: &[f32],
    r0: usize,
    t: usize,
    k: usize,
    w: &[F::Raw],
    g0: usize,
    out: &mut Lanes,
) {
    let chunks = k / LANES;
    assert!(t >= 1 && t <= R && (r0 + t) * k <= x.len() && (g0 + G) * k <= w.len());
    let row_at: [usize; R] = std::array::from_fn(|r| (r0 + r.min(t - 1)) * k);
    let mut acc = [[[_mm256_setzero_ps(); 2]; R]; G];
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    for ch in 0..chunks {
        for (g, accs) in acc.iter_mut().enumerate() {
            let at = (g0 + g) * k + ch * LANES;
            // as in avx512.rs: the weights' cache lines asked for a little ahead
            _mm_prefetch(
                wp.wrapping_add(at + PREFETCH_AHEAD) as *const i8,
                PREFETCH_HINT,
            );
            let wv = F::load(wp.add(at));
            for (a, at) in accs.iter_mut().zip(row_at) {
                let xb = xp.add(at + ch * LANES);
                a[0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xb), a[0]);
                a[1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xb.add(8)), a[1]);
            }
        }
    }
    for (g, accs) in acc.iter().enumerate() {
        for (r, a) in accs.iter().enumerate().take(t) {
            let o = out[g0 + g][r0 + r].as_mut_ptr();
            _mm256_storeu_ps(o, a[0]);
            _mm256_storeu_ps(o.add(8), a[1]);
        }
    }
}

/// `out[r][g]`: the reduction of `mod.rs` (`lane j + lane j + 8`, then `lane_tree::fold`'s
/// tree) of every column's lane sums for rows `0..tile`, two rows (eight outputs) at a time in
/// registers by `fold8`: the same additions in the same order as the scalar `finish`, a few
/// shuffles an output instead of a horizontal sum each.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn reduce_tile(
    sums: &Lanes,
    tile: usize,
    out: &mut [[f32; COLUMN_GROUP]; ROW_TILE],
) {
    const { assert!(COLUMN_GROUP == 4 && ROW_TILE.is_multiple_of(2)) };
    for r0 in (0..tile).step_by(2) {
        // output o: column o % 4 of row r0 + o / 4 (of a row past the tile when `tile` is odd:
        // computed and dropped)
        let a: [__m256; 8] = std::array::from_fn(|o| {
            let p = sums[o % 4][r0 + o / 4].as_ptr();
            _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        });
        let mut folded = [0.0f32; 8];
        _mm256_storeu_ps(folded.as_mut_ptr(), fold8(a));
        for (r, row) in out[r0..(r0 + 2).min(tile)].iter_mut().enumerate() {
            row.copy_from_slice(&folded[4 * r..][..4]);
        }
    }
}

/// `packed.rs`'s widening of up to a group of columns into `[chunk][column][16]` lines.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `w` holds `width` columns of `k` (a multiple of 16); `dst`
/// holds `k / 16 * COLUMN_GROUP` lines.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pack<F: Load>(w: &[F::Raw], k: usize, width: usize, dst: &mut [Line]) {
    let chunks = k / LANES;
    assert!(width <= COLUMN_GROUP && width * k <= w.len() && chunks * COLUMN_GROUP <= dst.len());
    for g in 0..width {
        for ch in 0..chunks {
            let [lo, hi] = F::load(w.as_ptr().add(g * k + ch * LANES));
            let o = dst[ch * COLUMN_GROUP + g].0.as_mut_ptr();
            _mm256_store_ps(o, lo);
            _mm256_store_ps(o.add(8), hi);
        }
    }
}

/// `out[row][column]`: `tile` rows of `x` (`[row][chunk]` lines) against a packed group of
/// columns (`[chunk][column]` lines), their lane sums in `lanes` (scratch), then `reduce_tile`.
///
/// Three rows by two columns at a time: twelve accumulators, and each half chunk of a row
/// loaded once into a register for both columns, so a chunk takes ten loads for twelve FMAs.
/// Four rows by one column (eight accumulators, ten loads for eight FMAs) held the FMA ports at
/// the latency of its eight chains; this tile ran 448 rows of the gate-up shape 1.35-1.4x
/// faster (AVX2 on a Sapphire Rapids VM, two threads, builds alternated).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` holds `tile * chunks` lines, `w` `chunks *
/// COLUMN_GROUP`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn packed_sums(
    x: &[Line],
    tile: usize,
    chunks: usize,
    w: &[Line],
    lanes: &mut Lanes,
    sums: &mut [[f32; COLUMN_GROUP]; ROW_TILE],
) {
    assert!(tile <= ROW_TILE && tile * chunks <= x.len() && chunks * COLUMN_GROUP <= w.len());
    let out = &mut *lanes;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut r0 = 0;
    while r0 < tile {
        let t = (tile - r0).min(3);
        let row_at: [usize; 3] = std::array::from_fn(|r| (r0 + r.min(t - 1)) * chunks);
        for g0 in (0..COLUMN_GROUP).step_by(2) {
            let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; 3];
            for ch in 0..chunks {
                for h in 0..2 {
                    let w0 =
                        _mm256_load_ps((*wp.add(ch * COLUMN_GROUP + g0)).0.as_ptr().add(8 * h));
                    let w1 =
                        _mm256_load_ps((*wp.add(ch * COLUMN_GROUP + g0 + 1)).0.as_ptr().add(8 * h));
                    for (a, at) in acc.iter_mut().zip(row_at) {
                        let xv = _mm256_load_ps((*xp.add(at + ch)).0.as_ptr().add(8 * h));
                        a[0][h] = _mm256_fmadd_ps(w0, xv, a[0][h]);
                        a[1][h] = _mm256_fmadd_ps(w1, xv, a[1][h]);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate().take(t) {
                for (c, ac) in a.iter().enumerate() {
                    let o = out[g0 + c][r0 + r].as_mut_ptr();
                    _mm256_storeu_ps(o, ac[0]);
                    _mm256_storeu_ps(o.add(8), ac[1]);
                }
            }
        }
        r0 += t;
    }
    reduce_tile(lanes, tile, sums);
}
