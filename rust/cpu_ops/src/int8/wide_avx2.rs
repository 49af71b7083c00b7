//! The AVX2 int8 kernel for several rows of the signed block kinds (Q8, Q6, IQ4): `wide.rs` on
//! 256-bit vectors and without VNNI, eight output columns side by side in one vector, a tile of
//! rows against each block's operands.
//!
//! Why: before it, those kinds' rows took the column kernels (`simd.rs`, `q6.rs`, IQ4 expanded
//! into q8 blocks first), which end every (row, block, column) in a horizontal reduction: two
//! thirds of an AVX2 Q8_0 prefill, at a third of the rate of 4-bit weights. Here each of a block's
//! operand vectors is loaded once for a tile of [`TILE`] rows, and the rows' activations come as
//! broadcasts (docs/cpu-kernels.md has the rates). 4-bit weights keep `side_by_side.rs`, which is
//! as fast for them: their block is eight `vpmaddubsw` summed in i16 and one widening, bound by
//! the multiplier ports either way.
//!
//! AVX2's u8 × i8 `vpmaddubsw` does not fit signed weights: `w + 128` by `q` saturates its i16
//! pairs, and `|w|` by `q · sign(w)` costs a `vpsignb` and a widening per quad (three multiplier
//! port operations per 32 products). (Weights that span fewer than 32 values do fit, as `w -
//! low`: [`Q5`].) So both sides go in as i16 and `vpmaddwd` multiplies pairs
//! into i32 directly, one instruction per 16 products: the quantiser keeps an i16 copy of the
//! activations for this kernel (`I8Scratch`), and per call each group of eight columns is
//! transposed once into a per-thread buffer ([`Block8`]): vector `m` of a block holds two
//! weights of each column as an i16 pair (`4t, 4t + 2` for `m = 2t`, `4t + 1, 4t + 3` for `m = 2t
//! + 1`: [`transpose::set_pairs`] says why; the i16 activations come in the same order), IQ4's nibbles
//! looked up in its table first.
//! Every product and sum is an exact integer (at most `32 · 128 · 127` a block), and the float
//! combine is `int8`'s, block by block in lane order (blocks `l, l + 8, ...` into accumulator `l`,
//! the eight added in `plain::hsum`'s tree): the bits are `plain.rs`'s (the tests check it).

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use super::group_fetch::NextGroup;
use super::{Activations, LANES};
use crate::threads::Output;
use crate::weights::{Weights, BLOCK};

mod transpose;
use transpose::{transpose_iq4, transpose_q6, transpose_q8};

/// Columns per group: the eight i32 (or f32) lanes of a 256-bit vector.
pub(super) const COLUMNS: usize = 8;
/// Rows multiplied together against one block's operands (each row holds an integer and a float
/// accumulator: with an operand and a broadcast, 10 of the 16 registers).
const TILE: usize = 4;
/// Rows from which a call takes this kernel for Q6 and IQ4: below it the transposition costs
/// more than the column kernels' reductions it saves.
pub(super) const MIN_ROWS: usize = 2;
/// The same for Q8, whose column kernel has no de-interleaving or table to pay for. Timed on two
/// threads, weights from memory (SmolLM2's shapes): at five rows this one took 0.8x its time for
/// gate-up and the head, 1.1x for down (k = 1536); at three and four it lost more on down than it
/// gained on the rest; at six and up it won on every shape (at prompt sizes 2-2.8x its rate).
const MIN_ROWS_Q8: usize = 5;

/// One block of a group, transposed.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub(super) struct Block8 {
    /// Vector `m`: two weights of each column ([`transpose::set_pairs`]), an i16 pair per i32 lane. The narrow
    /// kinds ([`Q5`]) hold quads in the first eight instead: vector `t`, weights `4t..4t + 4` of
    /// each column less the matrix's `low`, as u8.
    pub(super) pairs: [__m256i; 16],
    /// Each column's scale; Q6's two (weights 0..16, then 16..32).
    pub(super) scale: [__m256; 2],
    /// Each column's offset (0 where the kind has none; never read then).
    pub(super) offset: __m256,
}

thread_local! {
    /// The transposed group, reused by every call on this thread.
    static GROUP: RefCell<Vec<Block8>> = const { RefCell::new(Vec::new()) };
}

/// How a kind's block is combined, a constant of `tile` (as in `wide.rs`: a runtime kind leaves a
/// tile's accumulators on the stack). Signed 8-bit weights (IQ4's blocks too), no offsets.
const Q8: u8 = 1;
/// As [`Q8`], with offsets.
const Q8_OFFSET: u8 = 2;
/// Q6_K's int8 weights: two sums per block (weights 0..16, 16..32), each with its scale.
const Q6: u8 = 3;
/// As [`Q8`], for weights that span fewer than 32 values ([`Q8Weights::low`](crate::weights::Q8Weights::low): Q5_0 and Q5_1 as
/// q8 blocks): `w - low` in 0..32 goes into `vpmaddubsw` as u8 against the activations' i8, four
/// operand vectors summed in i16 (each lane then holds eight products, at most 8 · 31 · 127 =
/// 31,496 in magnitude) before one `vpmaddwd`: per (row, block) eight `vpmaddubsw`, six `vpaddw`,
/// two `vpmaddwd` and two `vpaddd` where the full range takes sixteen `vpmaddwd` and sixteen
/// `vpaddd`. `Σ w q = Σ (w - low) q + low Σ q`, every term an integer below 2^24, so the sum
/// converted and corrected in one fma is exact: the plain bits.
const Q5: u8 = 4;
/// As [`Q5`], with offsets.
const Q5_OFFSET: u8 = 5;
/// [`Q6`] for weights that span fewer than 64 values ([`Q6Weights::low`](crate::weights::Q6Weights::low): Q6_K's, Q3_K's): as
/// [`Q5`], with two operand vectors summed in i16 (at most 4 · 63 · 127 = 32,004 a lane) before
/// each `vpmaddwd`, and each half's sum corrected by `low` times the activations' half sum.
const Q6_NARROW: u8 = 6;

/// Whether a call of `rows` rows against `w` takes this kernel for its whole column groups.
/// `KVPARK_CPU_WIDE=off` keeps the column kernels (same bits: for measuring), and so does
/// `KVPARK_CPU_SIDE_BY_SIDE=off`.
pub(super) fn takes(a: &Activations<'_>, w: &Weights<'_>) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("KVPARK_CPU_WIDE").as_deref() != Ok("off"));
    let least = match w {
        Weights::Q6(_) | Weights::Iq4(_) => MIN_ROWS,
        Weights::Q8(w) if w.low.is_some() => MIN_ROWS,
        Weights::Q8(_) => MIN_ROWS_Q8,
        Weights::Q4(_) | Weights::Dense(_) => return false,
    };
    on && super::side_by_side::enabled() && a.rows >= least && a.q16.len() == a.rows * a.k
}

/// Output columns `c0..c0 + COLUMNS` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX2 and FMA; `c0 + COLUMNS <= w.n()`; `a` was quantised for `w`
/// (`a.k == w.k()`).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Weights<'_>, c0: usize, y: &Output) {
    let blocks = a.k / BLOCK;
    assert!(c0 + COLUMNS <= w.n() && a.k == w.k() && a.padded.is_multiple_of(LANES));
    assert!(a.q16.len() == a.rows * a.k && a.d.len().min(a.sum.len()) == a.rows * a.padded);
    // the narrow kinds read the i8 quants and Q6's the half sums
    assert!(a.q.len() == a.rows * a.k && a.lo.len().min(a.hi.len()) == a.rows * a.padded);
    let next = NextGroup::new(&w, c0, COLUMNS, a.rows);
    GROUP.with_borrow_mut(|g| {
        if g.len() < blocks {
            // SAFETY: every field is plain SIMD data, for which all-zero bits are valid.
            g.resize(blocks, std::mem::zeroed());
        }
        let kind = match w {
            Weights::Q4(_) | Weights::Dense(_) => unreachable!("`takes` refuses them"),
            Weights::Q8(w) => {
                transpose_q8(w, c0, blocks, g, &next);
                match (w.low.is_some(), w.offset.is_some()) {
                    (true, true) => Q5_OFFSET,
                    (true, false) => Q5,
                    (false, true) => Q8_OFFSET,
                    (false, false) => Q8,
                }
            }
            Weights::Q6(w) => {
                transpose_q6(w, c0, blocks, g, &next);
                if w.low.is_some() {
                    Q6_NARROW
                } else {
                    Q6
                }
            }
            Weights::Iq4(w) => {
                transpose_iq4(w, c0, blocks, g, &next);
                Q8
            }
        };
        let g = &g[..blocks];
        let low = match w {
            Weights::Q8(w) => w.low.unwrap_or(0),
            Weights::Q6(w) => w.low.unwrap_or(0),
            _ => 0,
        };
        match kind {
            Q8 => tiles::<Q8>(a, g, y, w.n(), c0, low, Some(&next)),
            Q8_OFFSET => tiles::<Q8_OFFSET>(a, g, y, w.n(), c0, low, Some(&next)),
            Q5 => tiles::<Q5>(a, g, y, w.n(), c0, low, Some(&next)),
            Q5_OFFSET => tiles::<Q5_OFFSET>(a, g, y, w.n(), c0, low, Some(&next)),
            Q6_NARROW => tiles::<Q6_NARROW>(a, g, y, w.n(), c0, low, Some(&next)),
            _ => tiles::<Q6>(a, g, y, w.n(), c0, low, Some(&next)),
        }
    })
}

/// The narrow kinds' tiles over a group of Q5_0's or Q5_1's packed blocks split into
/// `g` (`wide_avx2_packed.rs`: quads `q - low`, scales, and offsets where `offset`).
///
/// # Safety
/// As [`group`], `g` holding every block of the columns.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn narrow_tiles(
    a: &Activations<'_>,
    g: &[Block8],
    y: &Output,
    n: usize,
    c0: usize,
    low: i8,
    offset: bool,
) {
    match offset {
        true => tiles::<Q5_OFFSET>(a, g, y, n, c0, low, None),
        false => tiles::<Q5>(a, g, y, n, c0, low, None),
    }
}

/// Every row of `a`, a tile at a time, against the transposed group `g` of kind `K`; the first
/// tile asks for `next` where the call's size says so.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tiles<const K: u8>(
    a: &Activations<'_>,
    g: &[Block8],
    y: &Output,
    n: usize,
    c0: usize,
    low: i8,
    next: Option<&NextGroup>,
) {
    let mut r0 = 0;
    while r0 + TILE <= a.rows {
        tile::<TILE, K>(a, g, r0, y, n, c0, low, next);
        r0 += TILE;
    }
    match a.rows - r0 {
        3 => tile::<3, K>(a, g, r0, y, n, c0, low, next),
        2 => tile::<2, K>(a, g, r0, y, n, c0, low, next),
        1 => tile::<1, K>(a, g, r0, y, n, c0, low, next),
        _ => {}
    }
}

/// Rows `r0..r0 + R` against the transposed group `g` of kind `K` (`low`: the narrow kinds').
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize, const K: u8>(
    a: &Activations<'_>,
    g: &[Block8],
    r0: usize,
    y: &Output,
    n: usize,
    c0: usize,
    low: i8,
    next: Option<&NextGroup>,
) {
    let next = next.filter(|_| r0 == 0);
    let narrow = K == Q5 || K == Q5_OFFSET;
    let narrow6 = K == Q6_NARROW;
    let xq: [*const i16; R] = std::array::from_fn(|r| a.q16.as_ptr().add((r0 + r) * a.k));
    let xq8: [*const i8; R] = std::array::from_fn(|r| a.q.as_ptr().add((r0 + r) * a.k));
    let low = _mm256_set1_ps(f32::from(low));
    let at: [usize; R] = std::array::from_fn(|r| (r0 + r) * a.padded);
    // every lane is written below before it is read: zeroing the array first was a `memset`
    // call per tile (~1 % of an eight-row decode step)
    let mut lanes = [[MaybeUninit::<__m256>::uninit(); LANES]; R];
    for l in 0..LANES {
        let mut acc = [_mm256_setzero_ps(); R];
        // a padding block (b >= blocks) would add +0 to a lane that is never -0: skipped
        for (b, blk) in g.iter().enumerate().skip(l).step_by(LANES) {
            // a row's block scale, broadcast where it is used: kept in registers for the tile
            // they would push the accumulators onto the stack
            let d = |r: usize| _mm256_set1_ps(*a.d.as_ptr().add(at[r] + b));
            if let Some(next) = next {
                next.first_tile(b);
            }
            // Q6 combines each half (weights 0..16, then 16..32) as soon as its pairs are in
            let mut dots = [_mm256_setzero_si256(); R];
            if narrow {
                // two halves of four quad vectors, each summed in i16 before its `vpmaddwd`
                for half in 0..2 {
                    let mut pairs = [_mm256_setzero_si256(); R];
                    for u in 0..4 {
                        let t = 4 * half + u;
                        let w = blk.pairs[t];
                        for r in 0..R {
                            let x = xq8[r].add(b * BLOCK + 4 * t) as *const i32;
                            let p = _mm256_maddubs_epi16(w, _mm256_set1_epi32(x.read_unaligned()));
                            pairs[r] = if u == 0 {
                                p
                            } else {
                                _mm256_add_epi16(pairs[r], p)
                            };
                        }
                    }
                    for r in 0..R {
                        let wide = _mm256_madd_epi16(pairs[r], _mm256_set1_epi16(1));
                        dots[r] = _mm256_add_epi32(dots[r], wide);
                    }
                }
            }
            if narrow6 {
                // each half (four quad vectors) as two i16 sums of two `vpmaddubsw`, then
                // combined with its scale, as Q6 does
                for half in 0..2 {
                    let mut sums = [_mm256_setzero_si256(); R];
                    for two in 0..2 {
                        let mut pairs = [_mm256_setzero_si256(); R];
                        for u in 0..2 {
                            let t = 4 * half + 2 * two + u;
                            let w = blk.pairs[t];
                            for r in 0..R {
                                let x = xq8[r].add(b * BLOCK + 4 * t) as *const i32;
                                let x = _mm256_set1_epi32(x.read_unaligned());
                                let p = _mm256_maddubs_epi16(w, x);
                                pairs[r] = if u == 0 {
                                    p
                                } else {
                                    _mm256_add_epi16(pairs[r], p)
                                };
                            }
                        }
                        for r in 0..R {
                            let wide = _mm256_madd_epi16(pairs[r], _mm256_set1_epi16(1));
                            sums[r] = _mm256_add_epi32(sums[r], wide);
                        }
                    }
                    let half_sums = if half == 0 { a.lo } else { a.hi };
                    for r in 0..R {
                        let q_sum = _mm256_set1_ps(*half_sums.as_ptr().add(at[r] + b));
                        let isum = _mm256_fmadd_ps(low, q_sum, _mm256_cvtepi32_ps(sums[r]));
                        let scale = _mm256_mul_ps(blk.scale[half], d(r));
                        acc[r] = _mm256_fmadd_ps(scale, isum, acc[r]);
                    }
                }
            }
            // in quarters of four pairs, each unrolled: the loop's counter and branch took ports
            // the multiplies and additions need
            for quarter in (0..4).filter(|_| !narrow && !narrow6) {
                for u in 0..4 {
                    let m = 4 * quarter + u;
                    let w = blk.pairs[m];
                    for r in 0..R {
                        let x = pair(xq[r].add(b * BLOCK), m);
                        dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(w, x));
                    }
                }
                if K == Q6 && quarter % 2 == 1 {
                    for r in 0..R {
                        let isum = _mm256_cvtepi32_ps(dots[r]);
                        let scale = _mm256_mul_ps(blk.scale[quarter / 2], d(r));
                        acc[r] = _mm256_fmadd_ps(scale, isum, acc[r]);
                        dots[r] = _mm256_setzero_si256();
                    }
                }
            }
            if K != Q6 && !narrow6 {
                for r in 0..R {
                    let mut isum = _mm256_cvtepi32_ps(dots[r]);
                    if narrow {
                        let sum = _mm256_set1_ps(*a.sum.as_ptr().add(at[r] + b));
                        isum = _mm256_fmadd_ps(low, sum, isum);
                    }
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(blk.scale[0], d(r)), isum, acc[r]);
                    if K == Q8_OFFSET || K == Q5_OFFSET {
                        let sum = _mm256_set1_ps(*a.sum.as_ptr().add(at[r] + b));
                        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(blk.offset, d(r)), sum, acc[r]);
                    }
                }
            }
        }
        for (lanes, acc) in lanes.iter_mut().zip(acc) {
            lanes[l] = MaybeUninit::new(acc);
        }
    }
    for (r, l) in lanes.iter().enumerate() {
        // SAFETY: the loop above wrote lane `l` of every row for each `l` in 0..LANES.
        let l = l.map(|v| v.assume_init());
        // plain::hsum's tree, eight columns at once
        let v = _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6])),
            _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7])),
        );
        let mut out = [0.0f32; COLUMNS];
        _mm256_storeu_ps(out.as_mut_ptr(), v);
        y.set_array((r0 + r) * n + c0, &out);
    }
}

/// Activation pair `m` of the block at `x` (values `2m, 2m + 1` of `q16`'s order: [`transpose::set_pairs`]'s
/// weights of vector `m`) in every lane.
#[inline(always)]
unsafe fn pair(x: *const i16, m: usize) -> __m256i {
    _mm256_set1_epi32((x.add(2 * m) as *const i32).read_unaligned())
}
