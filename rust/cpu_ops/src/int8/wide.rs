//! The AVX-512 VNNI int8 kernel for several rows of any block kind: sixteen output columns side
//! by side in one 512-bit vector, a tile of rows against the same weights held in registers.
//!
//! Why: `side_by_side.rs` and `side_by_side_q8.rs` put eight columns in a 256-bit vector and
//! reload a block's operands from the stack for every row, so a (row, block) of eight columns
//! costs ~25 instructions; Q6 has no side-by-side kernel at all and pays a horizontal reduction
//! per (row, block, column). Here a (row, block) of sixteen columns is eight `vpdpbusd` whose
//! activation quads come as embedded broadcasts, one conversion, one correction and the float
//! combine: about half the instructions per weight, twice the columns per instruction.
//!
//! Per call and group of [`COLUMNS`] columns, every block of the group is transposed once into a
//! per-thread buffer ([`Block16`], `wide/transpose.rs`): vector `j` holds weights `4j..4j + 4`
//! of each column as u8 (Q4's nibbles as they are; Q8's and Q6's int8 with the sign bit flipped,
//! `w + 128`), and the columns' scales and offsets are one vector each. Then each tile of [`TILE`] rows walks the
//! blocks lane by lane of `int8`'s combine (blocks `l, l + 8, l + 16, ...` into accumulator `l`,
//! in order), so a row needs one accumulator at a time, and the eight lanes are added in
//! `plain::hsum`'s tree at the end.
//!
//! The integer sums are exact and equal the plain kernel's: `vpdpbusd` adds u8 × i8 quads into
//! i32 with no intermediate saturation, and a flipped block's chain starts at `-128 Σ q` (the
//! quantiser's `bias`), so it ends at `Σ (w + 128) q - 128 Σ q = Σ w q` (every partial sum below
//! `2^24` in magnitude): the integer the plain kernel converts. (Until 2026-12-07 the chain
//! started at 0 and the converted sum took `128 Σ q` off in one fused `x − 128 s`, exact too: the
//! same bits, one float operation more per row and block, or two for q6's halves.) The float operations are the plain ones
//! in the same order, so the bits are `plain.rs`'s (the tests check it).

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use self::transpose::{transpose_iq4, transpose_q4, transpose_q6, transpose_q8};
use super::group_fetch::NextGroup;
use super::{Activations, LANES};
use crate::threads::Output;
use crate::weights::{Q8Packing, Weights, BLOCK};

mod transpose;

/// Columns per group: the sixteen i32 (or f32) lanes of a 512-bit vector.
pub(super) const COLUMNS: usize = 16;
/// Rows multiplied together against one block's operands in registers.
pub(super) const TILE: usize = 4;
/// Rows of the tiles a call of many rows takes first, for every kind but Q6: each row's block is
/// one chain of eight `vpdpbusd`, which eight rows' chains in flight keep busy, where four rows
/// needed two chains a row and a `vpaddd` to join them. (Q6's two halves need two chains a row,
/// and eight rows of them do not fit the 32 registers: a 448-row Q6 product took 4.6-4.8 ns a
/// unit below against 3.7-3.8 in tiles of four, so Q6 keeps those.) a 448 × 2048 ×
/// 2048 Q4 product on one thread of a Sapphire Rapids VM went from 3.57-3.67 to 3.35-3.53 ns per
/// (row, block, 16 columns) (`examples`, six alternations). The integer sums are exact either
/// way: the same bits.
pub(super) const LONG_TILE: usize = 8;
/// Rows from which a call takes this kernel: below it the transposition costs more than the
/// column kernels' reductions it saves.
pub(super) const MIN_ROWS: usize = 2;

/// One block of a group, transposed.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct Block16 {
    /// Vector `j`: weights `4j..4j + 4` of each column, as u8.
    pub(super) quads: [__m512i; 8],
    /// Each column's scale; Q6's two (weights 0..16, then 16..32).
    pub(super) scale: [__m512; 2],
    /// Each column's offset (0 where the kind has none; never read then).
    pub(super) offset: __m512,
}

thread_local! {
    /// The transposed group, reused by every call on this thread.
    static GROUP: RefCell<Vec<Block16>> = const { RefCell::new(Vec::new()) };
}

/// How a kind's block is corrected and combined, as a constant of `tile`: a runtime kind there
/// left a tile's rows rolled up with their accumulators on the stack (a store and a reload per
/// row and block, a fifth of a Q4_0 prefill's samples on the store).
const Q4: u8 = 0;
/// 8-bit weights flipped; a correction of `128 Σ q` per block; no offsets (IQ4's blocks too).
const Q8: u8 = 1;
/// As [`Q8`], with offsets.
const Q8_OFFSET: u8 = 2;
/// Q6_K's int8 weights flipped; two sums per block (weights 0..16, 16..32), each with its scale
/// and its correction.
const Q6: u8 = 3;

/// Whether a call of `rows` rows against `w` takes this kernel for its whole column groups.
/// `KVPARK_CPU_WIDE=off` keeps the 256-bit kernels (same bits: for measuring), and
/// `KVPARK_CPU_SIDE_BY_SIDE=off` turns it off with the other side-by-side kernels.
pub(super) fn takes(rows: usize, w: &Weights<'_>) -> bool {
    on() && rows >= MIN_ROWS && !matches!(w, Weights::Dense(_))
}

/// Whether this kernel may run at all (the switches of [`takes`]); a matrix packed at load
/// (`wide_packed.rs`) takes it for any number of rows.
pub(super) fn on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("KVPARK_CPU_WIDE").as_deref() != Ok("off"));
    on && super::side_by_side::enabled()
}

/// Each row's eight lane accumulators (every one written) added in `plain::hsum`'s tree,
/// sixteen columns at once, into its outputs `c0..c0 + COLUMNS`.
#[inline(always)]
pub(super) unsafe fn store_rows<const R: usize>(
    lanes: &[[MaybeUninit<__m512>; LANES]; R],
    r0: usize,
    y: &Output,
    n: usize,
    c0: usize,
) {
    for (r, l) in lanes.iter().enumerate() {
        // SAFETY: the caller wrote lane `l` of every row for each `l` in 0..LANES.
        let l = l.map(|v| v.assume_init());
        let v = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
            _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])),
        );
        let mut out = [0.0f32; COLUMNS];
        _mm512_storeu_ps(out.as_mut_ptr(), v);
        y.set_array((r0 + r) * n + c0, &out);
    }
}

/// Output columns `c0..c0 + COLUMNS` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and VNNI and FMA; `c0 + COLUMNS <= w.n()`; `a` was quantised
/// for `w` (`a.k == w.k()`).
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Weights<'_>, c0: usize, y: &Output) {
    let blocks = a.k / BLOCK;
    assert!(c0 + COLUMNS <= w.n() && a.k == w.k() && a.padded.is_multiple_of(LANES));
    assert!(a.q.len() == a.rows * a.k && a.d.len().min(a.sum.len()) == a.rows * a.padded);
    assert!(a.lo.len().min(a.hi.len()) == a.rows * a.padded);
    let next = NextGroup::new(&w, c0, COLUMNS, a.rows);
    GROUP.with_borrow_mut(|g| {
        if g.len() < blocks {
            // SAFETY: every field is plain SIMD data, for which all-zero bits are valid.
            g.resize(blocks, std::mem::zeroed());
        }
        let kind = match w {
            Weights::Q4(w) if w.packed => {
                super::wide_packed::split(Weights::Q4(w), c0, g);
                Q4
            }
            Weights::Q4(w) => {
                transpose_q4(w, c0, blocks, g, &next);
                Q4
            }
            Weights::Q8(w) if w.packed == Q8Packing::Q5Super => {
                // packed Q5_K: its quants as they are, scale and offset: the 4-bit kind's combine
                super::wide_packed::split(Weights::Q8(w), c0, g);
                Q4
            }
            Weights::Q8(w) if w.packed == Q8Packing::Q5Blocks => {
                // packed Q5_0, Q5_1: split into the row layout's flipped quants
                super::wide_packed::split(Weights::Q8(w), c0, g);
                if w.offset.is_some() {
                    Q8_OFFSET
                } else {
                    Q8
                }
            }
            Weights::Q8(w) => {
                transpose_q8(w, c0, blocks, g, &next);
                if w.offset.is_some() {
                    Q8_OFFSET
                } else {
                    Q8
                }
            }
            Weights::Q6(w) if w.packed => {
                super::wide_packed::split(Weights::Q6(w), c0, g);
                Q6
            }
            Weights::Q6(w) => {
                transpose_q6(w, c0, blocks, g, &next);
                Q6
            }
            Weights::Iq4(w) => {
                transpose_iq4(w, c0, blocks, g, &next);
                Q8
            }
            Weights::Dense(_) => unreachable!("matmul_i8 refuses dense matrices"),
        };
        let g = &g[..blocks];
        match kind {
            Q4 => tiles::<Q4>(a, g, y, w.n(), c0, &next),
            Q8 => tiles::<Q8>(a, g, y, w.n(), c0, &next),
            Q8_OFFSET => tiles::<Q8_OFFSET>(a, g, y, w.n(), c0, &next),
            _ => tiles::<Q6>(a, g, y, w.n(), c0, &next),
        }
    })
}

/// Every row of `a`, a tile at a time, against the transposed group `g` of kind `K`; the first
/// tile asks for `next` where the call's size says so.
#[inline(always)]
unsafe fn tiles<const K: u8>(
    a: &Activations<'_>,
    g: &[Block16],
    y: &Output,
    n: usize,
    c0: usize,
    next: &NextGroup,
) {
    let mut r0 = 0;
    while K != Q6 && r0 + LONG_TILE <= a.rows {
        tile::<LONG_TILE, K>(a, g, r0, y, n, c0, next);
        r0 += LONG_TILE;
    }
    while r0 + TILE <= a.rows {
        tile::<TILE, K>(a, g, r0, y, n, c0, next);
        r0 += TILE;
    }
    match a.rows - r0 {
        3 => tile::<3, K>(a, g, r0, y, n, c0, next),
        2 => tile::<2, K>(a, g, r0, y, n, c0, next),
        1 => tile::<1, K>(a, g, r0, y, n, c0, next),
        _ => {}
    }
}

/// Rows `r0..r0 + R` against the transposed group `g` of kind `K`.
#[inline(always)]
unsafe fn tile<const R: usize, const K: u8>(
    a: &Activations<'_>,
    g: &[Block16],
    r0: usize,
    y: &Output,
    n: usize,
    c0: usize,
    next: &NextGroup,
) {
    let xq: [*const i8; R] = std::array::from_fn(|r| a.q.as_ptr().add((r0 + r) * a.k));
    let at: [usize; R] = std::array::from_fn(|r| (r0 + r) * a.padded);
    // every lane is written below before it is read (zeroed first, it was a `memset` call per tile)
    let mut lanes = [[MaybeUninit::<__m512>::uninit(); LANES]; R];
    for l in 0..LANES {
        let mut acc = [_mm512_setzero_ps(); R];
        // a padding block (b >= blocks) would add +0 to a lane that is never -0: skipped
        for (b, blk) in g.iter().enumerate().skip(l).step_by(LANES) {
            if r0 == 0 {
                next.first_tile(b);
            }
            let u = blk.quads;
            for r in 0..R {
                let x = xq[r].add(b * BLOCK);
                // one chain of eight in a long tile (its other rows' chains overlap its
                // latency), else two chains of four (`s0 + s1` the block's sum; Q6's halves)
                let one_chain = R >= LONG_TILE && K != Q6;
                // the flipped kinds' chains start at -128 Σ q (of the block, or of each half):
                // they end at Σ w q, exact, with no correction after (`corrected`'s value)
                let bias = a.bias.as_ptr().add(at[r] + b).cast::<i32>();
                let (mut s0, mut s1) = match K {
                    Q4 => (_mm512_setzero_si512(), _mm512_setzero_si512()),
                    Q6 => (
                        _mm512_set1_epi32(*bias.add(1)),
                        _mm512_set1_epi32(*bias.add(2)),
                    ),
                    _ => (_mm512_set1_epi32(*bias), _mm512_setzero_si512()),
                };
                if one_chain {
                    for (j, u) in u.iter().enumerate() {
                        s0 = _mm512_dpbusd_epi32(s0, *u, quad(x, j));
                    }
                } else {
                    for j in 0..4 {
                        s0 = _mm512_dpbusd_epi32(s0, u[j], quad(x, j));
                        s1 = _mm512_dpbusd_epi32(s1, u[4 + j], quad(x, 4 + j));
                    }
                }
                let dots = if one_chain {
                    s0
                } else {
                    _mm512_add_epi32(s0, s1)
                };
                let d = _mm512_set1_ps(*a.d.as_ptr().add(at[r] + b));
                let acc = &mut acc[r];
                match K {
                    Q4 => {
                        let isum = _mm512_cvtepi32_ps(dots);
                        *acc = _mm512_fmadd_ps(_mm512_mul_ps(blk.scale[0], d), isum, *acc);
                        let sum = _mm512_set1_ps(*a.sum.as_ptr().add(at[r] + b));
                        *acc = _mm512_fmadd_ps(_mm512_mul_ps(blk.offset, d), sum, *acc);
                    }
                    Q8 | Q8_OFFSET => {
                        let sum = _mm512_set1_ps(*a.sum.as_ptr().add(at[r] + b));
                        let isum = _mm512_cvtepi32_ps(dots);
                        *acc = _mm512_fmadd_ps(_mm512_mul_ps(blk.scale[0], d), isum, *acc);
                        if K == Q8_OFFSET {
                            *acc = _mm512_fmadd_ps(_mm512_mul_ps(blk.offset, d), sum, *acc);
                        }
                    }
                    _ => {
                        let (lo, hi) = (_mm512_cvtepi32_ps(s0), _mm512_cvtepi32_ps(s1));
                        *acc = _mm512_fmadd_ps(_mm512_mul_ps(blk.scale[0], d), lo, *acc);
                        *acc = _mm512_fmadd_ps(_mm512_mul_ps(blk.scale[1], d), hi, *acc);
                    }
                }
            }
        }
        for (lanes, acc) in lanes.iter_mut().zip(acc) {
            lanes[l] = MaybeUninit::new(acc);
        }
    }
    store_rows(&lanes, r0, y, n, c0);
}

/// Activation quad `j` (bytes `4j..4j + 4` of the block at `x`) in every lane.
#[inline(always)]
pub(super) unsafe fn quad(x: *const i8, j: usize) -> __m512i {
    _mm512_set1_epi32((x.add(4 * j) as *const i32).read_unaligned())
}
