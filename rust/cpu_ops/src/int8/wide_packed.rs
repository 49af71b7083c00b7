//! The AVX-512 VNNI int8 kernel of `wide.rs` for a 4-bit or q6 matrix packed at load
//! (`crate::packed`), for any number of rows: each tile reads the group in place.
//!
//! Why: from the row layout `wide.rs` transposes every block of a group into a buffer before
//! its tiles run, every call; at eight rows of a Llama-1B-shaped Q4_K_M that phase (mostly
//! waiting on the weights' read, which only it did) took about as long as the products, and
//! one row could not pay for it at all (`one_row.rs` serves it). Packed, a block's four operand
//! vectors are four loads and the blocks lie in the order the tiles walk them (lane by lane of
//! `int8`'s combine), so the first tile streams the group from memory front to back while it
//! multiplies, and the others find it in cache. The arithmetic and its order are `wide.rs`'s
//! for the kind, so the bits are `plain.rs`'s (the tests check it).

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::wide::{quad, store_rows, Block16, COLUMNS, LONG_TILE, TILE};
use super::{Activations, LANES};
use crate::packed::Q6_BLOCK_BYTES;
use crate::packed::{position, q6_at, quads_at, super_at, value_at, PACK, Q6_BIAS, SUPER};
use crate::packed_q5::{q5_at, Q5_BLOCK_BYTES};
use crate::packed_q5_blocks::{q5b_at, q5b_packed_lengths, Q5B_BLOCK_BYTES};
use crate::threads::Output;
use crate::weights::{Q8Packing, Weights, BLOCK};

/// The kinds, as constants of `tile` (as in `wide.rs`, a runtime kind there would roll the
/// tile's rows up): 4-bit with offsets; q6 (int8 flipped, two scales a block).
const Q4: u8 = 0;
const Q6: u8 = 1;
/// Q5_K's q8 blocks packed compact (`crate::packed_q5`): combined as 4-bit weights are.
const Q5: u8 = 2;
/// Q5_0's and Q5_1's (`crate::packed_q5_blocks`): the five bits as Q5's, a scale (and offset) a
/// block read as 4-bit weights' are; `Σ q x = Σ u x + low Σ x` exact, then combined as the row
/// layout's q8 kind (`wide::tile`'s `Q8`, `Q8_OFFSET`): the same bits.
const Q5_BLOCKS: u8 = 3;
/// As [`Q5_BLOCKS`], with offsets (Q5_1's).
const Q5_BLOCKS_OFFSET: u8 = 4;

/// `wide::group` for a matrix packed at load (`crate::packed`): its blocks already lie as the
/// operand vectors and in the order the tiles walk them, so each tile reads the group in place,
/// front to back, with no transposition and no buffer (the first tile from memory, the others
/// from cache).
///
/// # Safety
/// As `wide::group`; `w` is a packed 4-bit or q6 matrix and `c0` starts one of its groups.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Weights<'_>, c0: usize, y: &Output) {
    let (n, blocks) = (w.n(), a.k / BLOCK);
    assert!(w.packed() && PACK == COLUMNS && c0.is_multiple_of(PACK) && c0 + COLUMNS <= n);
    assert!(a.k == w.k() && a.padded.is_multiple_of(LANES) && a.q.len() == a.rows * a.k);
    assert!(a.d.len().min(a.sum.len()).min(a.lo.len()).min(a.hi.len()) == a.rows * a.padded);
    let g = packed(w, c0, blocks);
    match w {
        Weights::Q4(_) => tiles::<Q4>(a, &g, y, n, c0),
        Weights::Q8(w) => match (w.packed, w.offset.is_some()) {
            (Q8Packing::Q5Blocks, true) => tiles::<Q5_BLOCKS_OFFSET>(a, &g, y, n, c0),
            (Q8Packing::Q5Blocks, false) => tiles::<Q5_BLOCKS>(a, &g, y, n, c0),
            _ => tiles::<Q5>(a, &g, y, n, c0),
        },
        _ => tiles::<Q6>(a, &g, y, n, c0),
    }
}

/// Rows from which a call splits each block once into `wide.rs`'s buffer ([`split`]) and runs
/// its tiles there, rather than splitting it again in every tile: a 448-token prefill of the
/// default model lost 7 % to the repeated splits, while eight rows gained from reading in place.
pub(super) const SPLIT_ROWS: usize = 16;

/// `wide.rs`'s transposed group from a packed one: each block's operand vectors (q4's nibbles
/// split, q6's int8 flipped) and values, for a call of many rows ([`SPLIT_ROWS`]).
///
/// # Safety
/// As [`group`]; `g` holds the matrix's blocks a column.
#[inline(always)]
pub(super) unsafe fn split(w: Weights<'_>, c0: usize, g: &mut [Block16]) {
    let blocks = w.k() / BLOCK;
    let p = packed(w, c0, blocks);
    let mask = _mm512_set1_epi8(0x0f);
    for (b, blk) in g.iter_mut().enumerate().take(blocks) {
        let at = position(blocks, b);
        if let Weights::Q4(_) = w {
            let src = p.qs.add(at * 256);
            for j in 0..4 {
                let t = _mm512_loadu_si512(src.add(64 * j).cast());
                blk.quads[j] = _mm512_and_si512(t, mask);
                blk.quads[4 + j] = _mm512_and_si512(_mm512_srli_epi16::<4>(t), mask);
            }
            blk.scale[0] = _mm512_loadu_ps(p.scale.add(at * PACK));
            blk.offset = _mm512_loadu_ps(p.offset.add(at * PACK));
        } else if let Weights::Q8(w) = w {
            if w.packed == Q8Packing::Q5Blocks {
                // wide.rs's q8 operands are `q + 128`: the stored `q - low` plus `low + 128`
                let src = p.qs.add(at * Q5B_BLOCK_BYTES);
                let add = _mm512_set1_epi8(p.low.wrapping_add(i8::MIN));
                blk.quads = q5_quads(src);
                for u in &mut blk.quads {
                    *u = _mm512_add_epi8(*u, add); // a loop: a closure loses the target features
                }
                blk.scale[0] = _mm512_loadu_ps(p.scale.add(at * PACK));
                if !p.offset.is_null() {
                    blk.offset = _mm512_loadu_ps(p.offset.add(at * PACK));
                }
                continue;
            }
            // wide.rs's 4-bit kind takes the five-bit quants as they are (u8, no offset to undo)
            let src = p.qs.add(at * Q5_BLOCK_BYTES);
            blk.quads = q5_quads(src);
            (blk.scale[0], blk.offset) = q5_values(src, &p, b);
        } else {
            // wide.rs's q6 operands are `q + 128`: the stored `q + 32` less 96
            let src = p.qs.add(at * Q6_BLOCK_BYTES);
            blk.quads = q6_quads(src, _mm512_set1_epi8(96));
            (blk.scale[0], blk.scale[1]) = q6_scales(src, p.scale.add(b / SUPER * PACK));
        }
    }
}

/// A packed q6 block's eight quad vectors (`u_t = q + 32` of weights `4t..4t + 4` of each column)
/// from its bytes at `src` (`crate::packed`'s layout), plus `add` (wrapping).
#[inline(always)]
unsafe fn q6_quads(src: *const u8, add: __m512i) -> [__m512i; 8] {
    let (nibble, top) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
    let mut u = [_mm512_setzero_si512(); 8];
    // plain loops, not closures: a closure does not inherit this function's target features
    let h = [
        _mm512_loadu_si512(src.add(256).cast()),
        _mm512_loadu_si512(src.add(320).cast()),
    ];
    for j in 0..4 {
        let l = _mm512_loadu_si512(src.add(64 * j).cast());
        u[j] = _mm512_and_si512(l, nibble);
        u[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(l), nibble);
    }
    // bits 2m, 2m + 1 of `h[j]` are the top bits of quad j + 2m: moved to bits 4, 5
    let high = [
        _mm512_slli_epi16::<4>(h[0]),
        _mm512_slli_epi16::<4>(h[1]),
        _mm512_slli_epi16::<2>(h[0]),
        _mm512_slli_epi16::<2>(h[1]),
        h[0],
        h[1],
        _mm512_srli_epi16::<2>(h[0]),
        _mm512_srli_epi16::<2>(h[1]),
    ];
    for t in 0..8 {
        let q = _mm512_or_si512(u[t], _mm512_and_si512(high[t], top));
        u[t] = _mm512_add_epi8(q, add);
    }
    u
}

/// A packed q5 block's eight quad vectors (its quants, 0..32, of weights `4t..4t + 4` of each
/// column) from its bytes at `src` (`crate::packed_q5`'s layout).
#[inline(always)]
unsafe fn q5_quads(src: *const u8) -> [__m512i; 8] {
    let (nibble, top) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x10));
    let mut u = [_mm512_setzero_si512(); 8];
    // plain loops, not closures: a closure does not inherit this function's target features
    let h = _mm512_loadu_si512(src.add(256).cast());
    for j in 0..4 {
        let l = _mm512_loadu_si512(src.add(64 * j).cast());
        u[j] = _mm512_and_si512(l, nibble);
        u[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(l), nibble);
    }
    // bit t of `h` is quad t's fifth bit: moved to bit 4
    let high = [
        _mm512_slli_epi16::<4>(h),
        _mm512_slli_epi16::<3>(h),
        _mm512_slli_epi16::<2>(h),
        _mm512_slli_epi16::<1>(h),
        h,
        _mm512_srli_epi16::<1>(h),
        _mm512_srli_epi16::<2>(h),
        _mm512_srli_epi16::<3>(h),
    ];
    for t in 0..8 {
        u[t] = _mm512_or_si512(u[t], _mm512_and_si512(high[t], top));
    }
    u
}

/// A packed q5 block's scale and offset vectors (`d * sc`, `dmin * m` of each column): its int8
/// `sc` and `m` after the quants at `src`, the columns' `d` and `dmin` for block `b` in `p`.
#[inline(always)]
unsafe fn q5_values(src: *const u8, p: &Packed, b: usize) -> (__m512, __m512) {
    let (d, dmin) = (
        p.scale.add(b / SUPER * PACK),
        p.offset.add(b / SUPER * PACK),
    );
    let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(src.add(320).cast()));
    let m = _mm512_cvtepi8_epi32(_mm_loadu_si128(src.add(336).cast()));
    (
        _mm512_mul_ps(_mm512_loadu_ps(d), _mm512_cvtepi32_ps(sc)),
        _mm512_mul_ps(_mm512_loadu_ps(dmin), _mm512_cvtepi32_ps(m)),
    )
}

/// A packed q6 block's two scale vectors (`d * sc` of each column, weights 0..16 and 16..32):
/// its int8 `sc` after the quants at `src`, its columns' `d` at `d`.
#[inline(always)]
unsafe fn q6_scales(src: *const u8, d: *const f32) -> (__m512, __m512) {
    let d = _mm512_loadu_ps(d);
    let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(src.add(384).cast()));
    let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(src.add(400).cast()));
    (
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)),
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)),
    )
}

/// A q6 half block's `Σ u q` (`u = w + 32`, the packed quants) as f32 less `32 Σ q` (`sum`):
/// `Σ w q`, exact (every value an integer below `2^24`), the bits of converting it.
#[inline(always)]
unsafe fn unbiased(dots: __m512i, sum: __m512) -> __m512 {
    let bias = _mm512_set1_ps(f32::from(Q6_BIAS));
    _mm512_fnmadd_ps(sum, bias, _mm512_cvtepi32_ps(dots))
}

/// A packed group's quants, scales and offsets (each block's at its position; no offsets for
/// q6 and Q5_0: null), its blocks and the `low` its q5 quants are stored less (Q5_0's, Q5_1's).
struct Packed {
    qs: *const u8,
    scale: *const f32,
    offset: *const f32,
    blocks: usize,
    low: i8,
}

/// The packed group of `w` that starts at column `c0`.
///
/// # Safety
/// `w` is a packed 4-bit or q6 matrix of `blocks` blocks a column, of the lengths its shape
/// says, and `c0` starts one of its groups.
#[inline(always)]
unsafe fn packed(w: Weights<'_>, c0: usize, blocks: usize) -> Packed {
    let n = w.n();
    // the group's bytes and values lie where the row layout's would (c0 starts a group)
    match w {
        Weights::Q4(w) => {
            assert!(w.qs.len() == n * blocks * 16);
            assert!(w.scale.len().min(w.offset.len()) == n * blocks);
            let at = value_at(blocks, c0, 0, 1, 0);
            Packed {
                qs: w.qs.as_ptr().add(quads_at(blocks, c0, 0, 4)),
                scale: w.scale.as_ptr().add(at),
                offset: w.offset.as_ptr().add(at),
                blocks,
                low: 0,
            }
        }
        Weights::Q8(w) if w.packed == Q8Packing::Q5Blocks => {
            let (qs, values) = q5b_packed_lengths(n, w.k);
            assert!(w.qs.len() == qs && w.scale.len() == values);
            assert!(w.offset.is_none_or(|o| o.len() == values));
            let at = value_at(blocks, c0, 0, 1, 0);
            Packed {
                qs: w.qs.as_ptr().add(q5b_at(blocks, c0, 0)).cast(),
                scale: w.scale.as_ptr().add(at),
                offset: w.offset.map_or(std::ptr::null(), |o| o.as_ptr().add(at)),
                blocks,
                low: w.low.expect("a packed q5 matrix has its low"),
            }
        }
        Weights::Q8(w) => {
            let (qs, d) = crate::packed_q5::q5_packed_lengths(n, w.k);
            let dmin = w.offset.expect("a packed q5 matrix has offsets");
            assert!(w.qs.len() == qs && w.scale.len() == d && dmin.len() == d);
            Packed {
                qs: w.qs.as_ptr().add(q5_at(blocks, c0, 0)).cast(),
                scale: w.scale.as_ptr().add(super_at(blocks, c0, 0)),
                offset: dmin.as_ptr().add(super_at(blocks, c0, 0)),
                blocks,
                low: 0,
            }
        }
        Weights::Q6(w) => {
            let (qs, d) = crate::packed::q6_packed_lengths(n, w.k);
            assert!(w.qs.len() == qs && w.scale.len() == d);
            Packed {
                qs: w.qs.as_ptr().add(q6_at(blocks, c0, 0)).cast(),
                scale: w.scale.as_ptr().add(super_at(blocks, c0, 0)),
                offset: std::ptr::null(),
                blocks,
                low: 0,
            }
        }
        _ => unreachable!("only q4, q6 and q5 (q8 blocks) matrices are packed"),
    }
}

/// Bytes ahead of the block being read whose lines the first tile asks for: the hardware
/// streams a sequential read too, but starts over at each group.
const PACKED_AHEAD: usize = 4096;

/// Every row of `a`, a tile at a time, against the packed group `g` of kind `K`.
#[inline(always)]
unsafe fn tiles<const K: u8>(a: &Activations<'_>, g: &Packed, y: &Output, n: usize, c0: usize) {
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

/// Rows `r0..r0 + R` against the packed group `g`: `wide::tile`'s arithmetic for kind `K`, the
/// operand vectors taken from the group's bytes as they are read (q4's nibbles split, q6's
/// int8 flipped to u8).
#[inline(always)]
unsafe fn tile<const R: usize, const K: u8>(
    a: &Activations<'_>,
    g: &Packed,
    r0: usize,
    y: &Output,
    n: usize,
    c0: usize,
) {
    let xq: [*const i8; R] = std::array::from_fn(|r| a.q.as_ptr().add((r0 + r) * a.k));
    let at: [usize; R] = std::array::from_fn(|r| (r0 + r) * a.padded);
    let mask = _mm512_set1_epi8(0x0f);
    // a block's bytes in the group: q4 four vectors (its scales and offsets apart); q6 and q5
    // their six or five bits a quant and int8 scales (and offsets: the columns' `d` and `dmin`
    // apart, one a run of SUPER blocks)
    let bytes = match K {
        Q4 => 256,
        Q5 => Q5_BLOCK_BYTES,
        Q5_BLOCKS | Q5_BLOCKS_OFFSET => Q5B_BLOCK_BYTES,
        _ => Q6_BLOCK_BYTES,
    };
    let blocks_values = K == Q4 || K == Q5_BLOCKS || K == Q5_BLOCKS_OFFSET;
    let low = _mm512_set1_ps(f32::from(g.low));
    let (per_lane, longer) = (g.blocks / LANES, g.blocks % LANES);
    let mut p = 0; // the block's position in the group
    let mut lanes = [[MaybeUninit::<__m512>::uninit(); LANES]; R];
    for l in 0..LANES {
        let mut acc = [_mm512_setzero_ps(); R];
        for j in 0..per_lane + usize::from(l < longer) {
            let b = l + j * LANES;
            let src = g.qs.add(p * bytes);
            if r0 == 0 {
                let ahead = src.wrapping_add(PACKED_AHEAD);
                for line in (0..bytes).step_by(64) {
                    _mm_prefetch(ahead.wrapping_add(line).cast(), _MM_HINT_T0);
                }
                if blocks_values {
                    for v in [g.scale, g.offset].into_iter().filter(|v| !v.is_null()) {
                        let ahead = v.wrapping_add(p * PACK + PACKED_AHEAD / 4);
                        _mm_prefetch(ahead.cast(), _MM_HINT_T0);
                    }
                }
            }
            // plain loops, not closures: a closure does not inherit this function's target
            // features, and its intrinsics became calls
            let mut u = [_mm512_setzero_si512(); 8];
            let (scale, second);
            if K == Q4 {
                for j in 0..4 {
                    let t = _mm512_loadu_si512(src.add(64 * j).cast());
                    u[j] = _mm512_and_si512(t, mask); // weights 4j..4j + 4
                    u[4 + j] = _mm512_and_si512(_mm512_srli_epi16::<4>(t), mask);
                    // 16 + ..
                }
                scale = _mm512_loadu_ps(g.scale.add(p * PACK));
                second = _mm512_loadu_ps(g.offset.add(p * PACK));
            } else if K == Q5 {
                u = q5_quads(src);
                (scale, second) = q5_values(src, g, b);
            } else if K == Q5_BLOCKS || K == Q5_BLOCKS_OFFSET {
                u = q5_quads(src);
                scale = _mm512_loadu_ps(g.scale.add(p * PACK));
                second = if K == Q5_BLOCKS_OFFSET {
                    _mm512_loadu_ps(g.offset.add(p * PACK))
                } else {
                    scale // never read
                };
            } else {
                u = q6_quads(src, _mm512_setzero_si512());
                (scale, second) = q6_scales(src, g.scale.add(b / SUPER * PACK));
            }
            for r in 0..R {
                let x = xq[r].add(b * BLOCK);
                // as `wide::tile`: one chain of eight in a long tile, Q6's halves two of four
                let one_chain = R >= LONG_TILE && K != Q6;
                let mut s0 = _mm512_setzero_si512();
                let mut s1 = _mm512_setzero_si512();
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
                let whole = if one_chain {
                    s0
                } else {
                    _mm512_add_epi32(s0, s1)
                };
                let d = _mm512_set1_ps(*a.d.as_ptr().add(at[r] + b));
                if K == Q5_BLOCKS || K == Q5_BLOCKS_OFFSET {
                    let sum = _mm512_set1_ps(*a.sum.as_ptr().add(at[r] + b));
                    let dots = _mm512_cvtepi32_ps(whole);
                    let isum = _mm512_fmadd_ps(low, sum, dots);
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, d), isum, acc[r]);
                    if K == Q5_BLOCKS_OFFSET {
                        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(second, d), sum, acc[r]);
                    }
                } else if K != Q6 {
                    let isum = _mm512_cvtepi32_ps(whole);
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, d), isum, acc[r]);
                    let sum = _mm512_set1_ps(*a.sum.as_ptr().add(at[r] + b));
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(second, d), sum, acc[r]);
                } else {
                    let lo = unbiased(s0, _mm512_set1_ps(*a.lo.as_ptr().add(at[r] + b)));
                    let hi = unbiased(s1, _mm512_set1_ps(*a.hi.as_ptr().add(at[r] + b)));
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, d), lo, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(second, d), hi, acc[r]);
                }
            }
            p += 1;
        }
        for (lanes, acc) in lanes.iter_mut().zip(acc) {
            lanes[l] = MaybeUninit::new(acc);
        }
    }
    store_rows(&lanes, r0, y, n, c0);
}
