//! The int8 kernel for several rows of 4-bit weights: eight output columns side by side in one
//! vector, so no integer reduction across lanes at all.
//!
//! Why: `simd.rs` puts a block's 32 weights of one column in a vector, so every (row, block) ends
//! in a horizontal reduction of its eight i32 lanes (`vphaddd`), which at eight rows costs what
//! the float path's FMAs do. Here lane `c` of every vector belongs to column `c` of a group of
//! eight: a block's quants are transposed once per call into eight vectors of four quants per
//! column (the nibbles already split), and each row multiplies them by its four activations
//! broadcast to every lane. A block's integer dot then ends in lane `c` of one vector, and the
//! float combine of `int8` runs on eight columns at once (lane `l` of `int8`'s combine is
//! accumulator `l` here, one vector per lane, and the final tree adds those vectors).
//!
//! The integer sums are exact either way and the float operations are the same ones in the same
//! order, so the bits are `plain.rs`'s (the tests check it). The transposition costs about what a
//! row's dots do, so one row keeps `simd.rs` ([`MIN_ROWS`]).

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use super::{Activations, LANES};
use crate::packed::{position, quads_at, value_at, PACK};
use crate::threads::Output;
use crate::weights::{Q4Weights, BLOCK};

/// Columns per group: the eight i32 (or f32) lanes of a 256-bit vector.
pub(super) const GROUP: usize = 8;
/// Rows from which a call takes this kernel.
pub(super) const MIN_ROWS: usize = 2;

/// A block's integer dot of eight columns: lane `c` = Σ over the eight operand pairs of the
/// products of their u8 and i8 quads in lane `c`, exact.
pub(super) trait Quads {
    /// The running sum of a block's first operand pair.
    ///
    /// # Safety
    /// The CPU has the instructions the implementation uses.
    unsafe fn first(u: __m256i, s: __m256i) -> __m256i;
    /// `sums` with the next operand pair's products added.
    ///
    /// # Safety
    /// As [`Quads::first`].
    unsafe fn add(sums: __m256i, u: __m256i, s: __m256i) -> __m256i;
    /// The block's i32 sums from its running sum of all eight pairs.
    ///
    /// # Safety
    /// As [`Quads::first`].
    unsafe fn finish(sums: __m256i) -> __m256i;
}

/// One block of a group, transposed: the eight operand vectors (weights `4t..4t + 4` of each
/// column in vector `t`, weights `16 + 4t..` in vector `4 + t`), and the columns' scale and
/// offset as one vector each.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
struct Block8 {
    quads: [__m256i; 8],
    scale: __m256,
    offset: __m256,
}

thread_local! {
    /// The transposed group, reused by every call on this thread and grown to the longest row
    /// seen. (A fixed stack array of 64 blocks had left rows longer than 2048, a 1B model's
    /// 8192-wide down projection, on `simd.rs`: a quarter of an AVX2 Q4_K_M prefill.)
    static TRANSPOSED: RefCell<Vec<Block8>> = const { RefCell::new(Vec::new()) };
}

/// Whether a call of `rows` rows against `w` takes this kernel for its column groups.
/// `KVPARK_CPU_SIDE_BY_SIDE=off` keeps every call on `simd.rs` (same bits: for measuring).
pub(super) fn takes(rows: usize, w: &Q4Weights<'_>) -> bool {
    enabled() && rows >= MIN_ROWS && w.k >= BLOCK
}

/// Whether the side-by-side kernels (this one and `side_by_side_q8.rs`) are on.
pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVPARK_CPU_SIDE_BY_SIDE").as_deref() != Ok("off"))
}

/// Output columns `c0..c0 + GROUP` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX2, FMA and what `D` uses; `c0 + GROUP <= w.n`; [`takes`] holds.
#[inline(always)]
pub(super) unsafe fn group<D: Quads>(a: &Activations<'_>, w: Q4Weights<'_>, c0: usize, y: &Output) {
    let blocks = a.k / BLOCK;
    assert!(c0 + GROUP <= w.n && blocks > 0 && a.k == w.k);
    assert!(w.qs.len() == w.n * blocks * 16 && w.scale.len() == w.n * blocks);
    assert!(w.offset.len() == w.scale.len() && a.padded.is_multiple_of(LANES));
    assert!(a.q.len() == a.rows * a.k && a.d.len().min(a.sum.len()) == a.rows * a.padded);
    // the buffer as a plain slice, not inside `with_borrow_mut`'s closure: a closure does not
    // inherit the caller's target features, and the tiles' intrinsics there became calls (35x)
    let g = TRANSPOSED.with_borrow_mut(|g| {
        if g.len() < blocks {
            // SAFETY: every field is plain SIMD data, for which all-zero bits are valid.
            g.resize(blocks, std::mem::zeroed());
        }
        g.as_mut_ptr()
    });
    // SAFETY: the thread's buffer holds at least `blocks` entries, and nothing else touches it
    // (or resizes it) on this thread until this call returns: no kernel calls back in here.
    let g = std::slice::from_raw_parts_mut(g, blocks);
    transpose(w, c0, g);
    let mut r0 = 0;
    while r0 < a.rows {
        let left = a.rows - r0;
        match left {
            1 => tile::<D, 1>(a, g, r0, y, w.n, c0),
            2 => tile::<D, 2>(a, g, r0, y, w.n, c0),
            3 => tile::<D, 3>(a, g, r0, y, w.n, c0),
            _ => tile::<D, TILE>(a, g, r0, y, w.n, c0),
        }
        r0 += left.min(TILE);
    }
}

/// Rows multiplied together against each block's operand vectors.
const TILE: usize = 4;

/// Rows `r0..r0 + R` against the transposed group `g`, lane by lane: lane `l`'s blocks `l, l + 8,
/// ...` in order into one accumulator a row, held in a register for the whole lane.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<D: Quads, const R: usize>(
    a: &Activations<'_>,
    g: &[Block8],
    r0: usize,
    y: &Output,
    n: usize,
    c0: usize,
) {
    let xq: [*const i8; R] = std::array::from_fn(|i| a.q.as_ptr().add((r0 + i) * a.k));
    let d: [*const f32; R] = std::array::from_fn(|i| a.d.as_ptr().add((r0 + i) * a.padded));
    let sum: [*const f32; R] = std::array::from_fn(|i| a.sum.as_ptr().add((r0 + i) * a.padded));
    let blocks = g.len();
    // every lane is written below before it is read (zeroed first, it was a `memset` a tile)
    let mut acc = [[MaybeUninit::<__m256>::uninit(); LANES]; R];
    #[allow(clippy::needless_range_loop)] // `l` picks both the blocks and each row's accumulator
    for l in 0..LANES {
        let mut lane = [_mm256_setzero_ps(); R];
        for b in (l..a.padded).step_by(LANES) {
            // a padding block updates its lane with zeros, as `plain.rs` does
            if b < blocks {
                let u = &g[b].quads;
                let mut sums = [_mm256_setzero_si256(); R];
                for (j, u) in u.iter().enumerate() {
                    let at = b * BLOCK + if j < 4 { 4 * j } else { 16 + 4 * (j - 4) };
                    for i in 0..R {
                        let s = _mm256_set1_epi32((xq[i].add(at) as *const i32).read_unaligned());
                        sums[i] = if j == 0 {
                            D::first(*u, s)
                        } else {
                            D::add(sums[i], *u, s)
                        };
                    }
                }
                for i in 0..R {
                    let isum = _mm256_cvtepi32_ps(D::finish(sums[i]));
                    let (db, sb) = (*d[i].add(b), *sum[i].add(b));
                    combine(&mut lane[i], isum, g[b].scale, Some(g[b].offset), db, sb);
                }
            } else {
                let z = _mm256_setzero_ps();
                for i in 0..R {
                    combine(&mut lane[i], z, z, Some(z), *d[i].add(b), *sum[i].add(b));
                }
            }
        }
        for i in 0..R {
            acc[i][l] = MaybeUninit::new(lane[i]);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        // SAFETY: the loop above wrote lane `l` of every row for each `l`.
        store_row(&acc.map(|v| v.assume_init()), y, (r0 + i) * n + c0);
    }
}

/// `int8`'s float combine of block `b` into its lane's accumulator, for eight columns at once:
/// `acc = fma(scale * d, isum, acc)`, then `acc = fma(offset * d, sum, acc)` where the weights
/// have offsets (each product rounded on its own).
#[inline(always)]
pub(super) unsafe fn combine(
    acc: &mut __m256,
    isum: __m256,
    scale: __m256,
    offset: Option<__m256>,
    d: f32,
    sum: f32,
) {
    let db = _mm256_set1_ps(d);
    *acc = _mm256_fmadd_ps(_mm256_mul_ps(scale, db), isum, *acc);
    if let Some(offset) = offset {
        *acc = _mm256_fmadd_ps(_mm256_mul_ps(offset, db), _mm256_set1_ps(sum), *acc);
    }
}

/// A row's eight accumulators added in `plain::hsum`'s tree, lane by lane of the eight columns,
/// into `y[at..at + GROUP]`.
#[inline(always)]
pub(super) unsafe fn store_row(acc: &[__m256; LANES], y: &Output, at: usize) {
    let v = _mm256_add_ps(
        _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
        _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])),
    );
    let mut out = [0.0f32; GROUP];
    _mm256_storeu_ps(out.as_mut_ptr(), v);
    for (c, v) in out.iter().enumerate() {
        y.set(at + c, *v);
    }
}

/// Writes every block of columns `c0..c0 + GROUP` into `g` (one entry a block), transposed.
#[inline(always)]
unsafe fn transpose(w: Q4Weights<'_>, c0: usize, g: &mut [Block8]) {
    if w.packed {
        return split_packed(w, c0, g);
    }
    let blocks = g.len();
    let qs = w.qs.as_ptr();
    let mask = _mm256_set1_epi8(0x0f);
    // the next group's bytes are contiguous after this one's: ask for them now, so they arrive
    // while this group's rows are multiplied (a group reads its memory only here)
    let next = (c0 + GROUP) * blocks;
    for line in (0..GROUP * blocks * 16).step_by(64) {
        _mm_prefetch(qs.wrapping_add(next * 16 + line) as *const i8, _MM_HINT_T0);
    }
    for line in (0..GROUP * blocks * 4).step_by(64) {
        _mm_prefetch(
            w.scale
                .as_ptr()
                .wrapping_add(next)
                .cast::<i8>()
                .wrapping_add(line),
            _MM_HINT_T0,
        );
        _mm_prefetch(
            w.offset
                .as_ptr()
                .wrapping_add(next)
                .cast::<i8>()
                .wrapping_add(line),
            _MM_HINT_T0,
        );
    }
    for (b, blk) in g.iter_mut().enumerate() {
        let col = |c: usize| qs.add(((c0 + c) * blocks + b) * 16) as *const __m128i;
        // column i in the low half, i + 4 in the high half; then a 4 x 4 transpose of u32 quads
        // per half gives vector t = quad t (bytes 4t..4t + 4) of columns 0..8
        let v: [__m256i; 4] = std::array::from_fn(|i| {
            _mm256_set_m128i(_mm_loadu_si128(col(i + 4)), _mm_loadu_si128(col(i)))
        });
        let lo01 = _mm256_unpacklo_epi32(v[0], v[1]);
        let hi01 = _mm256_unpackhi_epi32(v[0], v[1]);
        let lo23 = _mm256_unpacklo_epi32(v[2], v[3]);
        let hi23 = _mm256_unpackhi_epi32(v[2], v[3]);
        let t = [
            _mm256_unpacklo_epi64(lo01, lo23),
            _mm256_unpackhi_epi64(lo01, lo23),
            _mm256_unpacklo_epi64(hi01, hi23),
            _mm256_unpackhi_epi64(hi01, hi23),
        ];
        for (i, t) in t.iter().enumerate() {
            // byte j holds weight j (low nibble) and weight j + 16 (high nibble)
            blk.quads[i] = _mm256_and_si256(*t, mask);
            blk.quads[4 + i] = _mm256_and_si256(_mm256_srli_epi16::<4>(*t), mask);
        }
        // the eight columns' values of block b: one strided load each
        let lanes = |p: *const f32| {
            let at = |c: usize| *p.add((c0 + c) * blocks + b);
            _mm256_setr_ps(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7))
        };
        blk.scale = lanes(w.scale.as_ptr());
        blk.offset = lanes(w.offset.as_ptr());
    }
}

/// [`transpose`] of a matrix packed at load (`crate::packed`; `c0` a multiple of [`GROUP`]):
/// the group is one half of a packed group of sixteen, each block's operand vectors one load
/// and a nibble split each, its scales and offsets one load. For calls of many rows
/// (`side_by_side_packed::SPLIT_ROWS`), which would repeat the split in every tile in place.
#[inline(always)]
unsafe fn split_packed(w: Q4Weights<'_>, c0: usize, g: &mut [Block8]) {
    let blocks = g.len();
    let (start, half) = (c0 - c0 % PACK, c0 % PACK);
    assert!(half.is_multiple_of(GROUP) && start + PACK <= w.n);
    let qs = w.qs.as_ptr().add(quads_at(blocks, start, 0, 4) + 4 * half);
    let at = value_at(blocks, start, 0, 1, 0) + half;
    let (scale, offset) = (w.scale.as_ptr().add(at), w.offset.as_ptr().add(at));
    let mask = _mm256_set1_epi8(0x0f);
    for (b, blk) in g.iter_mut().enumerate() {
        let p = position(blocks, b);
        for i in 0..4 {
            let t = _mm256_loadu_si256(qs.add((p * 4 + i) * 4 * PACK).cast());
            blk.quads[i] = _mm256_and_si256(t, mask);
            blk.quads[4 + i] = _mm256_and_si256(_mm256_srli_epi16::<4>(t), mask);
        }
        blk.scale = _mm256_loadu_ps(scale.add(p * PACK));
        blk.offset = _mm256_loadu_ps(offset.add(p * PACK));
    }
}
