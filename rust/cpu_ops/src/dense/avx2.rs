//! The AVX2 kernel: per row, two 8-lane accumulators (lanes 0-7 and 8-15 of `mod.rs`'s order);
//! each chunk of 16 weights widened once into two vectors (F16C's `vcvtph2ps` for f16, a
//! zero-extend and shift for bf16) and multiplied into every row of the tile.

use std::arch::x86_64::*;

use super::format::{Bf16, Format, F16, F32};
use super::{Lanes, Line, LANES, PREFETCH_AHEAD, PREFETCH_HINT};
use crate::tiling::{COLUMN_GROUP, ROW_TILE};

/// A format's chunk of 16 values as two vectors of eight f32, widened exactly.
pub(crate) trait Load: Format {
    /// # Safety
    /// `p` points at 16 values; the CPU has AVX2, FMA and F16C.
    unsafe fn load(p: *const Self::Raw) -> [__m256; 2];
}

impl Load for F32 {
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [__m256; 2] {
        [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
    }
}

impl Load for F16 {
    #[inline(always)]
    unsafe fn load(p: *const u16) -> [__m256; 2] {
        let v = |p: *const u16| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        [v(p), v(p.add(8))]
    }
}

impl Load for Bf16 {
    #[inline(always)]
    unsafe fn load(p: *const u16) -> [__m256; 2] {
        let v = |p: *const u16| {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))
        };
        [v(p), v(p.add(8))]
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
        _ => {
            for r0 in (0..tile).step_by(4) {
                let t = (tile - r0).min(4);
                (0..cols).for_each(|g| group::<4, 1, F>(x, r0, t, k, w, g, out));
            }
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

/// `out[g][r]`: the reduction of `mod.rs` (`lane j + lane j + 8`, then `plain::hsum`'s tree) of
/// every lane sum of a group whose inputs had no tail, in registers: the same additions in the
/// same order as the scalar `finish`, a few instructions an output instead of some twenty.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn reduce_group(
    sums: &Lanes,
    tile: usize,
    cols: usize,
    out: &mut [[f32; ROW_TILE]; COLUMN_GROUP],
) {
    for (per_row, o) in sums.iter().zip(out.iter_mut()).take(cols) {
        for (l, o) in per_row.iter().zip(o.iter_mut()).take(tile) {
            let p = l.as_ptr();
            let a = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
            let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
            *o = _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
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
/// columns (`[chunk][column]` lines), four rows by one column at a time as `lanes` runs a tile
/// of more than two rows, then `reduce_group`.
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
    sums: &mut [[f32; COLUMN_GROUP]; ROW_TILE],
) {
    assert!(tile <= ROW_TILE && tile * chunks <= x.len() && chunks * COLUMN_GROUP <= w.len());
    let mut lanes: Lanes = [[[0.0; LANES]; ROW_TILE]; COLUMN_GROUP];
    let out = &mut lanes;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut r0 = 0;
    while r0 < tile {
        let t = (tile - r0).min(4);
        let row_at: [usize; 4] = std::array::from_fn(|r| (r0 + r.min(t - 1)) * chunks);
        for (g, per_row) in out.iter_mut().enumerate() {
            let mut acc = [[_mm256_setzero_ps(); 2]; 4];
            for ch in 0..chunks {
                let wl = (*wp.add(ch * COLUMN_GROUP + g)).0.as_ptr();
                let wv = [_mm256_load_ps(wl), _mm256_load_ps(wl.add(8))];
                for (a, at) in acc.iter_mut().zip(row_at) {
                    let xl = (*xp.add(at + ch)).0.as_ptr();
                    a[0] = _mm256_fmadd_ps(wv[0], _mm256_load_ps(xl), a[0]);
                    a[1] = _mm256_fmadd_ps(wv[1], _mm256_load_ps(xl.add(8)), a[1]);
                }
            }
            for (r, a) in acc.iter().enumerate().take(t) {
                let o = per_row[r0 + r].as_mut_ptr();
                _mm256_storeu_ps(o, a[0]);
                _mm256_storeu_ps(o.add(8), a[1]);
            }
        }
        r0 += t;
    }
    let mut by_column = [[0.0f32; ROW_TILE]; COLUMN_GROUP];
    reduce_group(&lanes, tile, COLUMN_GROUP, &mut by_column);
    for (r, row) in sums.iter_mut().enumerate().take(tile) {
        for (g, v) in row.iter_mut().enumerate() {
            *v = by_column[g][r];
        }
    }
}
