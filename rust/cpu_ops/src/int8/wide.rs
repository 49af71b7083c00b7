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
//! per-thread buffer ([`Block16`]): vector `j` holds weights `4j..4j + 4` of each column as u8
//! (Q4's nibbles as they are; Q8's and Q6's int8 with the sign bit flipped, `w + 128`), and the
//! columns' scales and offsets are one vector each. Then each tile of [`TILE`] rows walks the
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

use super::{Activations, LANES};
use crate::iq4::IQ4_TABLE;
use crate::threads::Output;
use crate::weights::{Iq4Weights, Q4Weights, Q6Weights, Q8Packing, Q8Weights, Weights, BLOCK};

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
                transpose_q4(w, c0, blocks, g);
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
                transpose_q8(w, c0, blocks, g);
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
                transpose_q6(w, c0, blocks, g);
                Q6
            }
            Weights::Iq4(w) => {
                transpose_iq4(w, c0, blocks, g);
                Q8
            }
            Weights::Dense(_) => unreachable!("matmul_i8 refuses dense matrices"),
        };
        let g = &g[..blocks];
        match kind {
            Q4 => tiles::<Q4>(a, g, y, w.n(), c0),
            Q8 => tiles::<Q8>(a, g, y, w.n(), c0),
            Q8_OFFSET => tiles::<Q8_OFFSET>(a, g, y, w.n(), c0),
            _ => tiles::<Q6>(a, g, y, w.n(), c0),
        }
    })
}

/// Every row of `a`, a tile at a time, against the transposed group `g` of kind `K`.
#[inline(always)]
unsafe fn tiles<const K: u8>(a: &Activations<'_>, g: &[Block16], y: &Output, n: usize, c0: usize) {
    let mut r0 = 0;
    while K != Q6 && r0 + LONG_TILE <= a.rows {
        tile::<LONG_TILE, K>(a, g, r0, y, n, c0);
        r0 += LONG_TILE;
    }
    while r0 + TILE <= a.rows {
        tile::<TILE, K>(a, g, r0, y, n, c0);
        r0 += TILE;
    }
    match a.rows - r0 {
        3 => tile::<3, K>(a, g, r0, y, n, c0),
        2 => tile::<2, K>(a, g, r0, y, n, c0),
        1 => tile::<1, K>(a, g, r0, y, n, c0),
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
) {
    let xq: [*const i8; R] = std::array::from_fn(|r| a.q.as_ptr().add((r0 + r) * a.k));
    let at: [usize; R] = std::array::from_fn(|r| (r0 + r) * a.padded);
    // every lane is written below before it is read (zeroed first, it was a `memset` call per tile)
    let mut lanes = [[MaybeUninit::<__m512>::uninit(); LANES]; R];
    for l in 0..LANES {
        let mut acc = [_mm512_setzero_ps(); R];
        // a padding block (b >= blocks) would add +0 to a lane that is never -0: skipped
        for (b, blk) in g.iter().enumerate().skip(l).step_by(LANES) {
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

/// The sixteen columns' value of each of `blocks` blocks from `p` (`[n, blocks * per]`, column
/// `c`'s block `b` at `c * blocks * per + b * per + h`).
#[inline(always)]
unsafe fn gather(
    p: *const f32,
    c0: usize,
    blocks: usize,
    per: usize,
    b: usize,
    h: usize,
) -> __m512 {
    let stride = (blocks * per) as i32;
    let index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride),
    );
    let base = p.add(c0 * blocks * per + b * per + h);
    _mm512_i32gather_ps::<4>(index, base)
}

/// Asks for the next group's `bytes` (contiguous after this group's) to be fetched, a share
/// per block so the requests spread over the transposition.
#[inline(always)]
fn prefetch_next(p: *const u8, group_bytes: usize, b: usize, blocks: usize) {
    let share = group_bytes.div_ceil(blocks).next_multiple_of(64);
    let next = p.wrapping_add(group_bytes);
    for line in (b * share..((b + 1) * share).min(group_bytes)).step_by(64) {
        // SAFETY: a prefetch never faults, and wrapping_add forms the address without UB.
        unsafe { _mm_prefetch(next.wrapping_add(line) as *const i8, _MM_HINT_T0) };
    }
}

/// [`prefetch_next`] for the next group's per-block values (scales, offsets): `per` f32 a
/// block and column, the group's at `p + c0 * blocks * per`. Without it the next group's
/// transposition waited on them from memory: eight chats of a Llama-1B-shaped Q4_K_M in
/// process 83-86 → 92-94 tok/s with them asked for too (builds alternated three times).
#[inline(always)]
fn prefetch_next_values(p: *const f32, c0: usize, blocks: usize, per: usize, b: usize) {
    let group = p.wrapping_add(c0 * blocks * per) as *const u8;
    prefetch_next(group, COLUMNS * blocks * per * 4, b, blocks);
}

/// Q4: column `c`'s block `b` is 16 bytes, byte `i` holding weight `i` (low nibble) and `i + 16`.
#[inline(always)]
unsafe fn transpose_q4(w: Q4Weights<'_>, c0: usize, blocks: usize, g: &mut [Block16]) {
    let qs = w.qs.as_ptr();
    let group = qs.add(c0 * blocks * 16);
    let mask = _mm512_set1_epi8(0x0f);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        prefetch_next(group, COLUMNS * blocks * 16, b, blocks);
        prefetch_next_values(w.scale.as_ptr(), c0, blocks, 1, b);
        prefetch_next_values(w.offset.as_ptr(), c0, blocks, 1, b);
        let col = |c: usize| _mm_loadu_si128(group.add((c * blocks + b) * 16) as *const __m128i);
        // v[i] holds columns i, i + 4, i + 8, i + 12 in its four 128-bit lanes; a 4 x 4
        // transpose of u32 in every lane then gives vector t = quad t of columns 0..16
        let v: [__m512i; 4] = std::array::from_fn(|i| {
            let v = _mm512_castsi128_si512(col(i));
            let v = _mm512_inserti32x4::<1>(v, col(i + 4));
            let v = _mm512_inserti32x4::<2>(v, col(i + 8));
            _mm512_inserti32x4::<3>(v, col(i + 12))
        });
        let t = transpose4(v);
        for (i, t) in t.iter().enumerate() {
            blk.quads[i] = _mm512_and_si512(*t, mask); // weights 4i..4i + 4
            blk.quads[4 + i] = _mm512_and_si512(_mm512_srli_epi16::<4>(*t), mask);
            // 16 + 4i..
        }
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 1, b, 0);
        blk.offset = gather(w.offset.as_ptr(), c0, blocks, 1, b, 0);
    }
}

/// IQ4: Q4's nibbles, each looked up in the table (`vpshufb`) into its int8 weight and then
/// flipped as Q8's are: the q8 blocks the table gives, so the q8 kind's sums and correction.
#[inline(always)]
unsafe fn transpose_iq4(w: Iq4Weights<'_>, c0: usize, blocks: usize, g: &mut [Block16]) {
    let qs = w.qs.as_ptr();
    let group = qs.add(c0 * blocks * 16);
    let mask = _mm512_set1_epi8(0x0f);
    let flip = _mm512_set1_epi8(i8::MIN);
    let table = _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4_TABLE.as_ptr().cast()));
    let weights = |nibbles: __m512i| _mm512_xor_si512(_mm512_shuffle_epi8(table, nibbles), flip);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        prefetch_next(group, COLUMNS * blocks * 16, b, blocks);
        prefetch_next_values(w.scale.as_ptr(), c0, blocks, 1, b);
        let col = |c: usize| _mm_loadu_si128(group.add((c * blocks + b) * 16) as *const __m128i);
        let v: [__m512i; 4] = std::array::from_fn(|i| {
            let v = _mm512_castsi128_si512(col(i));
            let v = _mm512_inserti32x4::<1>(v, col(i + 4));
            let v = _mm512_inserti32x4::<2>(v, col(i + 8));
            _mm512_inserti32x4::<3>(v, col(i + 12))
        });
        for (i, t) in transpose4(v).iter().enumerate() {
            blk.quads[i] = weights(_mm512_and_si512(*t, mask));
            blk.quads[4 + i] = weights(_mm512_and_si512(_mm512_srli_epi16::<4>(*t), mask));
        }
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 1, b, 0);
    }
}

/// Q8: column `c`'s block `b` is 32 int8.
#[inline(always)]
unsafe fn transpose_q8(w: Q8Weights<'_>, c0: usize, blocks: usize, g: &mut [Block16]) {
    let values = [
        (w.scale.as_ptr(), 1),
        (w.offset.map_or(std::ptr::null(), |o| o.as_ptr()), 1),
    ];
    transpose_bytes(w.qs.as_ptr(), c0, blocks, g, values);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 1, b, 0);
        if let Some(o) = w.offset {
            blk.offset = gather(o.as_ptr(), c0, blocks, 1, b, 0);
        }
    }
}

/// Q6: 32 int8 per block as Q8, and two scales per block.
#[inline(always)]
unsafe fn transpose_q6(w: Q6Weights<'_>, c0: usize, blocks: usize, g: &mut [Block16]) {
    let values = [(w.scale.as_ptr(), 2), (std::ptr::null(), 0)];
    transpose_bytes(w.qs.as_ptr(), c0, blocks, g, values);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        blk.scale[0] = gather(w.scale.as_ptr(), c0, blocks, 2, b, 0);
        blk.scale[1] = gather(w.scale.as_ptr(), c0, blocks, 2, b, 1);
    }
}

/// 32 int8 per column block into eight vectors of u8 quads, the sign bits flipped; the next
/// group's quants and its `values` (each an array's start and f32 per block, or null) asked for.
#[inline(always)]
unsafe fn transpose_bytes(
    qs: *const i8,
    c0: usize,
    blocks: usize,
    g: &mut [Block16],
    values: [(*const f32, usize); 2],
) {
    let group = qs.add(c0 * blocks * BLOCK);
    let flip = _mm512_set1_epi8(i8::MIN);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        prefetch_next(group as *const u8, COLUMNS * blocks * BLOCK, b, blocks);
        for (p, per) in values.into_iter().filter(|(p, _)| !p.is_null()) {
            prefetch_next_values(p, c0, blocks, per, b);
        }
        let col =
            |c: usize| _mm256_loadu_si256(group.add((c * blocks + b) * BLOCK) as *const __m256i);
        // v[i] holds column i in its low half and i + 8 in its high half; an 8 x 8 transpose of
        // u32 per half then gives vector j = quad j of columns 0..8 | 8..16
        let v: [__m512i; 8] = std::array::from_fn(|i| {
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(col(i)), col(i + 8))
        });
        for (j, t) in transpose8(v).iter().enumerate() {
            blk.quads[j] = _mm512_xor_si512(*t, flip);
        }
    }
}

/// Per 128-bit lane, the transpose of the 4 x 4 matrix of u32 whose rows are the four vectors.
#[inline(always)]
unsafe fn transpose4(v: [__m512i; 4]) -> [__m512i; 4] {
    let lo01 = _mm512_unpacklo_epi32(v[0], v[1]);
    let hi01 = _mm512_unpackhi_epi32(v[0], v[1]);
    let lo23 = _mm512_unpacklo_epi32(v[2], v[3]);
    let hi23 = _mm512_unpackhi_epi32(v[2], v[3]);
    [
        _mm512_unpacklo_epi64(lo01, lo23),
        _mm512_unpackhi_epi64(lo01, lo23),
        _mm512_unpacklo_epi64(hi01, hi23),
        _mm512_unpackhi_epi64(hi01, hi23),
    ]
}

/// Per 256-bit half, the transpose of the 8 x 8 matrix of u32 whose rows are the eight vectors.
#[inline(always)]
unsafe fn transpose8(r: [__m512i; 8]) -> [__m512i; 8] {
    // within each 128-bit lane: elements 0 and 1 (then 2 and 3) of rows 0-3 and of rows 4-7
    let t01 = transpose4([r[0], r[1], r[2], r[3]]);
    let t45 = transpose4([r[4], r[5], r[6], r[7]]);
    // per 256-bit half: the low 128 bits of rows 0-3 with those of rows 4-7 (quads 0..4), then
    // the high 128 bits (quads 4..8); lanes 0, 2 of the 512-bit result from `a`, 1, 3 from `b`
    let low = |a: __m512i, b: __m512i| {
        _mm512_permutex2var_epi64(a, _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), b)
    };
    let high = |a: __m512i, b: __m512i| {
        _mm512_permutex2var_epi64(a, _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15), b)
    };
    [
        low(t01[0], t45[0]),
        low(t01[1], t45[1]),
        low(t01[2], t45[2]),
        low(t01[3], t45[3]),
        high(t01[0], t45[0]),
        high(t01[1], t45[1]),
        high(t01[2], t45[2]),
        high(t01[3], t45[3]),
    ]
}
