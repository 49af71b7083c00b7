//! The attention's dot products and weighted sums on each instruction set: the portable code
//! and the same operations on AVX2 and AVX-512 vectors (`block.rs` fixes the order; the
//! compiler cuts a 16-lane array into pieces of two, so the SIMD paths spell theirs out).

/// Lanes of the dot product.
pub(super) const LANES: usize = 16;

/// `q . k` in the module's order: the plain code, and the same operations on vectors (the
/// compiler cuts a 16-lane array into pieces of two, so the SIMD paths spell theirs out).
pub(super) trait Dot {
    /// Whether [`Dot::dots16`] is implemented: scores sixteen cells at a time.
    const WIDE: bool = false;
    /// Query heads whose weighted sums [`weighted_heads`] runs together (at most
    /// [`HEADS`]); 1: it runs them one by one.
    const TOGETHER: usize = 1;

    /// [`weighted_heads`] on this level, where [`Dot::TOGETHER`] is more than 1: `out[h]` from
    /// `p[h]` for `h < count` (`2 <= count <= TOGETHER`).
    ///
    /// # Safety
    /// As for [`Dot::weighted`].
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn weighted_many(
        p: [&[f32]; HEADS],
        count: usize,
        v: &[f32],
        stride: usize,
        cells: std::ops::Range<usize>,
        m: usize,
        out: &mut [[[f32; LANES]; 4]; HEADS],
    ) {
        let _ = (p, count, v, stride, cells, m, out);
        unreachable!("weighted_many of a Dot that runs heads one by one")
    }

    /// # Safety
    /// The CPU has the instructions the implementation uses; `q` and `k` have one length.
    unsafe fn dot(q: &[f32], k: &[f32]) -> f32;

    /// `out[c] = dot(q, k_c)` for sixteen cells whose rows lie `stride` apart in `rows` (cell
    /// `c` from `c * stride`), bit for bit what [`Dot::dot`] gives each.
    ///
    /// # Safety
    /// As for [`Dot::dot`]; `rows` holds `15 stride + q.len()` values.
    #[inline(always)]
    unsafe fn dots16(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32; LANES]) {
        let _ = (q, rows, stride, out);
        unreachable!("dots16 of a Dot that is not WIDE")
    }

    /// `out[u][l] = Σ_c p[c] · v[c · stride + 16 u + l]` for `u < m` (at most 4), over `c` in
    /// `cells` in order, each sum a fused multiply-add from +0.
    ///
    /// # Safety
    /// As for [`Dot::dot`]; `v` holds every row read.
    #[inline(always)]
    unsafe fn weighted(
        p: &[f32],
        v: &[f32],
        stride: usize,
        cells: std::ops::Range<usize>,
        m: usize,
        out: &mut [[f32; LANES]; 4],
    ) {
        *out = [[0.0; LANES]; 4];
        for c in cells {
            let row = &v[c * stride..][..m * LANES];
            for (sum, v) in out.iter_mut().zip(row.chunks_exact(LANES)) {
                for l in 0..LANES {
                    sum[l] = p[c].mul_add(v[l], sum[l]);
                }
            }
        }
    }
}

/// Query heads run together at most, by any level (`block.rs` hands them out so many at a time).
pub(super) const HEADS: usize = 4;

/// `count` query heads' [`Dot::weighted`] over one V (`1 <= count <= HEADS`): `out[h]` from
/// `p[h]`, each bit for bit what `weighted` gives it alone (a SIMD level runs them together,
/// loading each V row once for all of them: the rows come from L2 on a long prompt, and each
/// pass over them cost as much as the products).
///
/// # Safety
/// As for [`Dot::weighted`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn weighted_heads<D: Dot>(
    p: [&[f32]; HEADS],
    count: usize,
    v: &[f32],
    stride: usize,
    cells: std::ops::Range<usize>,
    m: usize,
    out: &mut [[[f32; LANES]; 4]; HEADS],
) {
    let mut h = 0;
    while h < count {
        let together = (count - h).min(D::TOGETHER);
        if together == 1 {
            D::weighted(p[h], v, stride, cells.clone(), m, &mut out[h]);
        } else {
            let mut part = [[[0.0f32; LANES]; 4]; HEADS];
            let ps = std::array::from_fn(|i| p[(h + i).min(count - 1)]);
            D::weighted_many(ps, together, v, stride, cells.clone(), m, &mut part);
            out[h..h + together].copy_from_slice(&part[..together]);
        }
        h += together;
    }
}

/// The portable dot.
pub(super) struct PlainDot;

impl Dot for PlainDot {
    #[inline(always)]
    unsafe fn dot(q: &[f32], k: &[f32]) -> f32 {
        let mut lanes = [0.0f32; LANES];
        for (i, (x, y)) in q.iter().zip(k).enumerate() {
            lanes[i % LANES] = x.mul_add(*y, lanes[i % LANES]);
        }
        finish(&lanes)
    }
}

/// The lanes' fixed tree.
#[inline(always)]
fn finish(lanes: &[f32; LANES]) -> f32 {
    crate::lane_tree::fold(lanes)
}

/// The tail of `d % 16` values into `lanes` (lane `i` takes value `whole + i`), then the tree.
#[inline(always)]
fn tail(q: &[f32], k: &[f32], whole: usize, lanes: &mut [f32; LANES]) -> f32 {
    for (l, (x, y)) in q[whole..].iter().zip(&k[whole..]).enumerate() {
        lanes[l] = x.mul_add(*y, lanes[l]);
    }
    finish(lanes)
}

/// Off x86-64 every level is the portable code.
#[cfg(not(target_arch = "x86_64"))]
pub(super) type Avx2Dot = PlainDot;
#[cfg(not(target_arch = "x86_64"))]
pub(super) type Avx512Dot = PlainDot;

/// AVX2: lanes 0..8 and 8..16 in two vectors.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx2Dot;

#[cfg(target_arch = "x86_64")]
impl Dot for Avx2Dot {
    const WIDE: bool = true;
    const TOGETHER: usize = 2;

    #[inline(always)]
    unsafe fn dots16(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32; LANES]) {
        use std::arch::x86_64::*;
        let d = q.len();
        assert!(rows.len() >= 15 * stride + d);
        if !d.is_multiple_of(LANES) {
            for (c, o) in out.iter_mut().enumerate() {
                *o = Self::dot(q, &rows[c * stride..][..d]);
            }
            return;
        }
        let (qp, rp) = (q.as_ptr(), rows.as_ptr());
        // each cell's two vectors of lanes as `dot` keeps them, four cells at a time (twelve
        // registers: their eight sums and `q`'s two vectors), each eight folded at once
        for half in 0..2 {
            let mut a = [_mm256_setzero_ps(); 8];
            for quad in 0..2 {
                let first = rp.add((8 * half + 4 * quad) * stride);
                let mut lo = [_mm256_setzero_ps(); 4];
                let mut hi = [_mm256_setzero_ps(); 4];
                for i in (0..d).step_by(LANES) {
                    let (ql, qh) = (_mm256_loadu_ps(qp.add(i)), _mm256_loadu_ps(qp.add(i + 8)));
                    for c in 0..4 {
                        let k = first.add(c * stride + i);
                        lo[c] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k), lo[c]);
                        hi[c] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k.add(8)), hi[c]);
                    }
                }
                for c in 0..4 {
                    a[4 * quad + c] = _mm256_add_ps(lo[c], hi[c]);
                }
            }
            let folded = crate::lane_tree::fold8(a);
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * half), folded);
        }
    }

    #[inline(always)]
    unsafe fn weighted(
        p: &[f32],
        v: &[f32],
        stride: usize,
        cells: std::ops::Range<usize>,
        m: usize,
        out: &mut [[f32; LANES]; 4],
    ) {
        let out = std::slice::from_mut(out);
        match m {
            4 => weighted_avx2::<1, 4>([p], v, 0, stride, cells, out),
            3 => weighted_avx2::<1, 3>([p], v, 0, stride, cells, out),
            2 => weighted_avx2::<1, 2>([p], v, 0, stride, cells, out),
            _ => weighted_avx2::<1, 1>([p], v, 0, stride, cells, out),
        }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn weighted_many(
        p: [&[f32]; HEADS],
        count: usize,
        v: &[f32],
        stride: usize,
        cells: std::ops::Range<usize>,
        m: usize,
        out: &mut [[[f32; LANES]; 4]; HEADS],
    ) {
        debug_assert_eq!(count, 2);
        let p = [p[0], p[1]];
        // two heads' sums of two runs fill eight of the sixteen registers: the runs two at a
        // time (each run's sums are independent of the others', so the split changes no bit)
        let mut u = 0;
        while u < m {
            match m - u {
                1 => weighted_avx2::<2, 1>(p, v, u, stride, cells.clone(), out),
                _ => weighted_avx2::<2, 2>(p, v, u, stride, cells.clone(), out),
            }
            u += 2;
        }
    }

    #[inline(always)]
    unsafe fn dot(q: &[f32], k: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let whole = q.len() - q.len() % LANES;
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in (0..whole).step_by(LANES) {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(i)), _mm256_loadu_ps(kp.add(i)), lo);
            let (q8, k8) = (qp.add(i + 8), kp.add(i + 8));
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(q8), _mm256_loadu_ps(k8), hi);
        }
        if whole == q.len() {
            return reduce8(_mm256_add_ps(lo, hi));
        }
        let mut lanes = [0.0f32; LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
        tail(q, k, whole, &mut lanes)
    }
}

/// [`Dot::weighted`] of `H` heads over one V, on AVX2: runs `first..first + M` of sixteen values
/// (two vectors each), every sum a fused multiply-add from +0 in cell order, each V vector
/// loaded once for the `H` heads.
///
/// # Safety
/// The CPU has AVX2; `v` holds every row read, each `p` every cell of `cells`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weighted_avx2<const H: usize, const M: usize>(
    p: [&[f32]; H],
    v: &[f32],
    first: usize,
    stride: usize,
    cells: std::ops::Range<usize>,
    out: &mut [[[f32; LANES]; 4]],
) {
    use std::arch::x86_64::*;
    let end = (first + M) * LANES;
    assert!(first + M <= 4 && out.len() >= H);
    assert!(cells.end == 0 || (cells.end - 1) * stride + end <= v.len());
    assert!(p.iter().all(|p| cells.end <= p.len()));
    let mut acc = [[[_mm256_setzero_ps(); 2]; M]; H];
    for c in cells {
        let row = v.as_ptr().add(c * stride + first * LANES);
        let vs: [[__m256; 2]; M] = std::array::from_fn(|u| {
            let at = row.add(u * LANES);
            [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))]
        });
        for (h, a) in acc.iter_mut().enumerate() {
            let pc = _mm256_set1_ps(*p[h].get_unchecked(c));
            for (a, x) in a.iter_mut().zip(vs) {
                a[0] = _mm256_fmadd_ps(pc, x[0], a[0]);
                a[1] = _mm256_fmadd_ps(pc, x[1], a[1]);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        for (o, a) in o[first..first + M].iter_mut().zip(a) {
            _mm256_storeu_ps(o.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), a[1]);
        }
    }
}

/// `plain::hsum` of the eight `a_j`, in registers: `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 +
/// a7))`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce8(a: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)))
}

/// AVX-512: the sixteen lanes in one vector.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx512Dot;

#[cfg(target_arch = "x86_64")]
impl Dot for Avx512Dot {
    const WIDE: bool = true;
    const TOGETHER: usize = HEADS;

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn weighted_many(
        p: [&[f32]; HEADS],
        count: usize,
        v: &[f32],
        stride: usize,
        cells: std::ops::Range<usize>,
        m: usize,
        out: &mut [[[f32; LANES]; 4]; HEADS],
    ) {
        match (count, m) {
            (4, 4) => weighted_n_m::<4, 4>(p, v, stride, cells, out),
            (4, 3) => weighted_n_m::<4, 3>(p, v, stride, cells, out),
            (4, 2) => weighted_n_m::<4, 2>(p, v, stride, cells, out),
            (4, _) => weighted_n_m::<4, 1>(p, v, stride, cells, out),
            (3, 4) => weighted_n_m::<3, 4>(p, v, stride, cells, out),
            (3, 3) => weighted_n_m::<3, 3>(p, v, stride, cells, out),
            (3, 2) => weighted_n_m::<3, 2>(p, v, stride, cells, out),
            (3, _) => weighted_n_m::<3, 1>(p, v, stride, cells, out),
            (_, 4) => weighted_n_m::<2, 4>(p, v, stride, cells, out),
            (_, 3) => weighted_n_m::<2, 3>(p, v, stride, cells, out),
            (_, 2) => weighted_n_m::<2, 2>(p, v, stride, cells, out),
            _ => weighted_n_m::<2, 1>(p, v, stride, cells, out),
        }
    }

    #[inline(always)]
    unsafe fn dots16(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32; LANES]) {
        use std::arch::x86_64::*;
        let d = q.len();
        assert!(rows.len() >= 15 * stride + d);
        let whole = d - d % LANES;
        let (qp, rp) = (q.as_ptr(), rows.as_ptr());
        // cell c's sixteen lanes in acc[c], as `dot` keeps them, then all sixteen folded at once
        let mut acc = [_mm512_setzero_ps(); LANES];
        for i in (0..whole).step_by(LANES) {
            let qv = _mm512_loadu_ps(qp.add(i));
            for (c, a) in acc.iter_mut().enumerate() {
                let k = _mm512_loadu_ps(rp.add(c * stride + i));
                *a = _mm512_fmadd_ps(qv, k, *a);
            }
        }
        if whole < d {
            // the tail into lanes 0..d % 16 only, as `tail` adds it
            let mask: __mmask16 = (1u16 << (d - whole)) - 1;
            let qv = _mm512_maskz_loadu_ps(mask, qp.add(whole));
            for (c, a) in acc.iter_mut().enumerate() {
                let k = _mm512_maskz_loadu_ps(mask, rp.add(c * stride + whole));
                *a = _mm512_mask3_fmadd_ps(qv, k, *a, mask);
            }
        }
        // reduce16 puts output o in lane 4 (o % 4) + o / 4: hand it cell 4 (o % 4) + o / 4 as o
        let v = std::array::from_fn(|o| acc[4 * (o % 4) + o / 4]);
        _mm512_storeu_ps(out.as_mut_ptr(), crate::lane_tree::reduce16(v));
    }

    #[inline(always)]
    unsafe fn dot(q: &[f32], k: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let whole = q.len() - q.len() % LANES;
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let mut acc = _mm512_setzero_ps();
        for i in (0..whole).step_by(LANES) {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(i)), _mm512_loadu_ps(kp.add(i)), acc);
        }
        let mut lanes = [0.0f32; LANES];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        tail(q, k, whole, &mut lanes)
    }

    #[inline(always)]
    unsafe fn weighted(
        p: &[f32],
        v: &[f32],
        stride: usize,
        cells: std::ops::Range<usize>,
        m: usize,
        out: &mut [[f32; LANES]; 4],
    ) {
        use std::arch::x86_64::*;
        assert!(m <= 4 && (cells.end == 0 || (cells.end - 1) * stride + m * LANES <= v.len()));
        assert!(cells.end <= p.len());
        let mut acc = [_mm512_setzero_ps(); 4];
        for c in cells {
            let pc = _mm512_set1_ps(*p.get_unchecked(c));
            let row = v.as_ptr().add(c * stride);
            for (u, a) in acc.iter_mut().enumerate().take(m) {
                *a = _mm512_fmadd_ps(pc, _mm512_loadu_ps(row.add(u * LANES)), *a);
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            _mm512_storeu_ps(o.as_mut_ptr(), a);
        }
    }
}

/// [`Avx512Dot`]'s `weighted_many` for `H` heads (the first `H` of `p`) and `M` runs of sixteen
/// values: `H M` sums independent of each other (the adds of one cell overlap the last's; at
/// most 16 accumulators, four V vectors and a broadcast: 21 of the 32 registers), each V vector
/// loaded once for every head; each sum a fused multiply-add, in cell order, as `weighted`.
///
/// # Safety
/// The CPU has AVX-512F; `v` holds every row read, each `p` every cell of `cells`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weighted_n_m<const H: usize, const M: usize>(
    p: [&[f32]; HEADS],
    v: &[f32],
    stride: usize,
    cells: std::ops::Range<usize>,
    out: &mut [[[f32; LANES]; 4]; HEADS],
) {
    use std::arch::x86_64::*;
    assert!(H <= HEADS && M <= 4);
    assert!(cells.end == 0 || (cells.end - 1) * stride + M * LANES <= v.len());
    assert!(p[..H].iter().all(|p| cells.end <= p.len()));
    let mut acc = [[_mm512_setzero_ps(); M]; H];
    for c in cells {
        let row = v.as_ptr().add(c * stride);
        let vs: [__m512; M] = std::array::from_fn(|u| _mm512_loadu_ps(row.add(u * LANES)));
        for (h, a) in acc.iter_mut().enumerate() {
            let pc = _mm512_set1_ps(*p[h].get_unchecked(c));
            for (a, x) in a.iter_mut().zip(vs) {
                *a = _mm512_fmadd_ps(pc, x, *a);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        for (o, a) in o.iter_mut().zip(a) {
            _mm512_storeu_ps(o.as_mut_ptr(), a);
        }
    }
}
