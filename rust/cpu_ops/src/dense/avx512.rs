//! The AVX-512 kernel: per row, one 16-lane accumulator (`mod.rs`'s lanes in one vector); each
//! chunk of 16 weights widened once (`vcvtph2ps` for f16, a zero-extend and shift for bf16) and
//! multiplied into every row of the tile. With 32 vector registers a whole tile of eight rows
//! fits at once.

use std::arch::x86_64::*;

use super::format::{Bf16, Format, F16, F32};
use super::{Lanes, Line, LANES, PREFETCH_AHEAD, PREFETCH_HINT};
use crate::lane_tree::reduce16;
use crate::tiling::{COLUMN_GROUP, ROW_TILE};

/// A format's chunk of 16 values as one vector of f32, widened exactly.
pub(crate) trait Load: Format {
    /// # Safety
    /// `p` points at 16 values; the CPU has AVX-512F.
    unsafe fn load(p: *const Self::Raw) -> __m512;
}

impl Load for F32 {
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

impl Load for F16 {
    #[inline(always)]
    unsafe fn load(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

impl Load for Bf16 {
    #[inline(always)]
    unsafe fn load(p: *const u16) -> __m512 {
        let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))
    }
}

/// As `plain::lanes`, bit for bit.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512F; `x` holds `tile` rows of `k`, `w` `cols` columns.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) unsafe fn lanes<F: Load>(
    x: &[f32],
    tile: usize,
    k: usize,
    w: &[F::Raw],
    cols: usize,
    out: &mut Lanes,
) {
    // As in avx2.rs: columns side by side where there are few rows, for independent chains.
    // From five rows (a decode step of several sequences; prompt-sized products run packed,
    // `packed.rs`), all the rows by two columns, twice: sixteen accumulators, each weight read
    // once as it streams from memory. Four rows by four columns twice (each weight read twice,
    // the second pass from cache with no memory access in flight) left a step at eight rows
    // 10-20 % slower, f32, f16 and bf16 alike (`kvpark bench --scenario profile`, alternated).
    match (tile, cols) {
        (1, 4) => group::<1, 4, F>(x, 0, 1, k, w, 0, out),
        (2, 4) => group::<2, 4, F>(x, 0, 2, k, w, 0, out),
        (3 | 4, 4) => group::<4, 4, F>(x, 0, tile, k, w, 0, out),
        (5..=8, 4) => {
            group::<8, 2, F>(x, 0, tile, k, w, 0, out);
            group::<8, 2, F>(x, 0, tile, k, w, 2, out);
        }
        (1, _) => (0..cols).for_each(|g| group::<1, 1, F>(x, 0, 1, k, w, g, out)),
        (2, _) => (0..cols).for_each(|g| group::<2, 1, F>(x, 0, 2, k, w, g, out)),
        (3 | 4, _) => (0..cols).for_each(|g| group::<4, 1, F>(x, 0, tile, k, w, g, out)),
        _ => (0..cols).for_each(|g| group::<8, 1, F>(x, 0, tile, k, w, g, out)),
    }
}

/// Rows `r0..r0 + t` (`t <= R`; rows past `t` read row `r0 + t - 1` again and are dropped)
/// against columns `g0..g0 + G`.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
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
    let mut acc = [[_mm512_setzero_ps(); R]; G];
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    for ch in 0..chunks {
        for (g, accs) in acc.iter_mut().enumerate() {
            let at = (g0 + g) * k + ch * LANES;
            // the weights stream from memory once per call: ask for them a little ahead, so
            // the loads below do not each wait out a memory access (this column's later
            // chunks, then the next columns', which follow it in memory)
            _mm_prefetch(
                wp.wrapping_add(at + PREFETCH_AHEAD) as *const i8,
                PREFETCH_HINT,
            );
            let wv = F::load(wp.add(at));
            for (a, at) in accs.iter_mut().zip(row_at) {
                *a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp.add(at + ch * LANES)), *a);
            }
        }
    }
    for (g, accs) in acc.iter().enumerate() {
        for (r, a) in accs.iter().enumerate().take(t) {
            _mm512_storeu_ps(out[g0 + g][r0 + r].as_mut_ptr(), *a);
        }
    }
}

/// `out[r][g]`: the reduction of `mod.rs` of every column's lane sums for rows `0..tile`, four
/// rows by the group's four columns at a time in registers by `reduce16` (as `packed_sums`).
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn reduce_tile(
    sums: &Lanes,
    tile: usize,
    out: &mut [[f32; COLUMN_GROUP]; ROW_TILE],
) {
    const { assert!(COLUMN_GROUP == 4 && ROW_TILE.is_multiple_of(4)) };
    for r0 in (0..tile).step_by(4) {
        // output o = 4 g + r: column g of row r0 + r (rows past the tile computed and dropped)
        let v: [__m512; 16] =
            std::array::from_fn(|o| _mm512_loadu_ps(sums[o / 4][r0 + o % 4].as_ptr()));
        let mut folded = [0.0f32; LANES];
        _mm512_storeu_ps(folded.as_mut_ptr(), reduce16(v));
        for (r, row) in out[r0..(r0 + 4).min(tile)].iter_mut().enumerate() {
            row.copy_from_slice(&folded[4 * r..][..4]);
        }
    }
}

/// `packed.rs`'s widening of up to a group of columns into `[chunk][column][16]` lines.
///
/// # Safety
/// The CPU has AVX-512F; `w` holds `width` columns of `k` (a multiple of 16); `dst` holds
/// `k / 16 * COLUMN_GROUP` lines.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) unsafe fn pack<F: Load>(w: &[F::Raw], k: usize, width: usize, dst: &mut [Line]) {
    let chunks = k / LANES;
    assert!(width <= COLUMN_GROUP && width * k <= w.len() && chunks * COLUMN_GROUP <= dst.len());
    for g in 0..width {
        for ch in 0..chunks {
            let v = F::load(w.as_ptr().add(g * k + ch * LANES));
            _mm512_store_ps(dst[ch * COLUMN_GROUP + g].0.as_mut_ptr(), v);
        }
    }
}

/// `out[row][column]`: `tile` rows of `x` (`[row][chunk]` lines) against a packed group of
/// columns (`[chunk][column]` lines), four rows at a time by the group's four columns (sixteen
/// accumulators), each output's lanes reduced in registers by `reduce16`.
///
/// # Safety
/// The CPU has AVX-512F; `x` holds `tile * chunks` lines, `w` `chunks * COLUMN_GROUP`.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) unsafe fn packed_sums(
    x: &[Line],
    tile: usize,
    chunks: usize,
    w: &[Line],
    out: &mut [[f32; COLUMN_GROUP]; ROW_TILE],
) {
    assert!(tile <= ROW_TILE && tile * chunks <= x.len() && chunks * COLUMN_GROUP <= w.len());
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut r0 = 0;
    while r0 < tile {
        let t = (tile - r0).min(4);
        let row_at: [usize; 4] = std::array::from_fn(|r| (r0 + r.min(t - 1)) * chunks);
        let mut acc = [[_mm512_setzero_ps(); 4]; COLUMN_GROUP];
        for ch in 0..chunks {
            let xs: [__m512; 4] =
                std::array::from_fn(|r| _mm512_load_ps((*xp.add(row_at[r] + ch)).0.as_ptr()));
            for (g, accs) in acc.iter_mut().enumerate() {
                let wv = _mm512_load_ps((*wp.add(ch * COLUMN_GROUP + g)).0.as_ptr());
                for (a, xv) in accs.iter_mut().zip(xs) {
                    *a = _mm512_fmadd_ps(wv, xv, *a);
                }
            }
        }
        let sums = reduce16(std::array::from_fn(|o| acc[o / 4][o % 4]));
        let mut lanes = [0.0f32; LANES];
        _mm512_storeu_ps(lanes.as_mut_ptr(), sums);
        for (r, row) in out[r0..r0 + t].iter_mut().enumerate() {
            row.copy_from_slice(&lanes[r * COLUMN_GROUP..][..COLUMN_GROUP]);
        }
        r0 += t;
    }
}
