//! The AVX-512 VNNI int8 kernel of `wide.rs` for a 4-bit matrix packed at load
//! (`crate::packed`), for any number of rows: each tile reads the group in place.
//!
//! Why: from the row layout `wide.rs` transposes every block of a group into a buffer before
//! its tiles run, every call; at eight rows of a Llama-1B-shaped Q4_K_M that phase (mostly
//! waiting on the weights' read, which only it did) took about as long as the products, and
//! one row could not pay for it at all (`one_row.rs` serves it). Packed, a block's four operand
//! vectors are four loads and the blocks lie in the order the tiles walk them (lane by lane of
//! `int8`'s combine), so the first tile streams the group from memory front to back while it
//! multiplies, and the others find it in cache. The arithmetic and its order are `wide.rs`'s
//! for Q4, so the bits are `plain.rs`'s (the tests check it).

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::wide::{quad, store_rows, COLUMNS, TILE};
use super::{Activations, LANES};
use crate::packed::{quads_at, value_at, PACK};
use crate::threads::Output;
use crate::weights::{Q4Weights, BLOCK};

/// `wide::group` for a 4-bit matrix packed at load (`crate::packed`): its blocks already lie as
/// the operand vectors and in the order the tiles walk them, so each tile reads the group in
/// place, front to back, with no transposition and no buffer (the first tile from memory, the
/// others from cache).
///
/// # Safety
/// As `wide::group`; `w.packed` and `c0` starts a packed group.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Q4Weights<'_>, c0: usize, y: &Output) {
    let blocks = a.k / BLOCK;
    assert!(w.packed && PACK == COLUMNS && c0.is_multiple_of(PACK) && c0 + COLUMNS <= w.n);
    assert!(a.k == w.k && a.padded.is_multiple_of(LANES) && a.q.len() == a.rows * a.k);
    assert!(a.d.len().min(a.sum.len()) == a.rows * a.padded);
    assert!(w.qs.len() == w.n * blocks * 16 && w.scale.len().min(w.offset.len()) == w.n * blocks);
    // the group's bytes and values lie where the row layout's would (c0 starts a group)
    let g = Packed {
        qs: w.qs.as_ptr().add(quads_at(blocks, c0, 0)),
        scale: w.scale.as_ptr().add(value_at(blocks, c0, 0)),
        offset: w.offset.as_ptr().add(value_at(blocks, c0, 0)),
        blocks,
    };
    let mut r0 = 0;
    while r0 + TILE <= a.rows {
        tile::<TILE>(a, &g, r0, y, w.n, c0);
        r0 += TILE;
    }
    match a.rows - r0 {
        3 => tile::<3>(a, &g, r0, y, w.n, c0),
        2 => tile::<2>(a, &g, r0, y, w.n, c0),
        1 => tile::<1>(a, &g, r0, y, w.n, c0),
        _ => {}
    }
}

/// A packed group's quants, scales and offsets (each block's at its position), and its blocks.
struct Packed {
    qs: *const u8,
    scale: *const f32,
    offset: *const f32,
    blocks: usize,
}

/// Bytes ahead of the block being read whose lines the first tile asks for: the hardware
/// streams a sequential read too, but starts over at each group.
const PACKED_AHEAD: usize = 4096;

/// Rows `r0..r0 + R` against the packed group `g`: `wide::tile`'s arithmetic for Q4, the
/// operand vectors split from the group's bytes as they are read.
#[inline(always)]
unsafe fn tile<const R: usize>(
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
    let (per_lane, longer) = (g.blocks / LANES, g.blocks % LANES);
    let mut p = 0; // the block's position in the group
    let mut lanes = [[MaybeUninit::<__m512>::uninit(); LANES]; R];
    for l in 0..LANES {
        let mut acc = [_mm512_setzero_ps(); R];
        for j in 0..per_lane + usize::from(l < longer) {
            let b = l + j * LANES;
            let src = g.qs.add(p * 4 * 4 * PACK);
            if r0 == 0 {
                let ahead = src.wrapping_add(PACKED_AHEAD);
                for line in 0..4 {
                    _mm_prefetch(ahead.wrapping_add(64 * line).cast(), _MM_HINT_T0);
                }
                for v in [g.scale, g.offset] {
                    let ahead = v.wrapping_add(p * PACK + PACKED_AHEAD / 4);
                    _mm_prefetch(ahead.cast(), _MM_HINT_T0);
                }
            }
            let t: [__m512i; 4] =
                std::array::from_fn(|i| _mm512_loadu_si512(src.add(64 * i).cast()));
            let u: [__m512i; 8] = std::array::from_fn(|j| {
                if j < 4 {
                    _mm512_and_si512(t[j], mask) // weights 4j..4j + 4
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(t[j - 4]), mask) // 16 + ..
                }
            });
            let scale = _mm512_loadu_ps(g.scale.add(p * PACK));
            let offset = _mm512_loadu_ps(g.offset.add(p * PACK));
            for r in 0..R {
                let x = xq[r].add(b * BLOCK);
                let mut s0 = _mm512_setzero_si512();
                let mut s1 = _mm512_setzero_si512();
                for j in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, u[j], quad(x, j));
                    s1 = _mm512_dpbusd_epi32(s1, u[4 + j], quad(x, 4 + j));
                }
                let d = _mm512_set1_ps(*a.d.as_ptr().add(at[r] + b));
                let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, d), isum, acc[r]);
                let sum = _mm512_set1_ps(*a.sum.as_ptr().add(at[r] + b));
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(offset, d), sum, acc[r]);
            }
            p += 1;
        }
        for (lanes, acc) in lanes.iter_mut().zip(acc) {
            lanes[l] = MaybeUninit::new(acc);
        }
    }
    store_rows(&lanes, r0, y, n, c0);
}
