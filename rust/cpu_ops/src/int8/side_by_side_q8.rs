//! The VNNI int8 kernel for several rows of 8-bit weights (the default model's Q8_0 head): eight
//! output columns side by side in one vector, as `side_by_side.rs` does for 4-bit ones.
//!
//! Why: column by column (`simd.rs`) every (row, block) ends in a horizontal reduction, and at
//! eight rows the head took longer through int8 than through the float32 path (5.6 against 4.2 ms
//! on 2 threads, `examples/int8_speed.rs`).
//!
//! `vpdpbusd` multiplies u8 by i8, and both the weights and the activations are signed. The
//! weights go in as `w + 128` (the sign bit flipped: a u8), so a block's dot is
//! `Σ (w_i + 128) q_i = Σ w_i q_i + 128 Σ q_i`, and `128 sum_b` (the activations' own block sum,
//! an exact integer under 2^13) is taken back: every integer is exact, so `isum_b` is the plain
//! kernel's and the float combine, the same operations in the same order, gives its bits. AVX2
//! keeps `simd.rs`: `vpmaddubsw`'s i16 pair sums would saturate at `2 * 255 * 127`.

use std::arch::x86_64::*;

use super::side_by_side::{combine, store_row, GROUP};
use super::{Activations, LANES};
use crate::threads::Output;
use crate::weights::{Q8Weights, BLOCK};

/// Blocks of a column the stack scratch holds (k up to 2048); longer rows keep `simd.rs`. (On
/// VNNI this kernel runs only with `wide.rs` off, `KVPARK_CPU_WIDE=off`: a measuring switch.)
const MAX_BLOCKS: usize = 64;

/// One group's blocks, transposed: per block eight vectors, vector `j` holding weights
/// `4j..4j + 4` of each of the eight columns (as u8, `w + 128`), and the columns' scales and
/// offsets as one vector each.
struct Group {
    quads: [[__m256i; 8]; MAX_BLOCKS],
    scale: [__m256; MAX_BLOCKS],
    offset: [__m256; MAX_BLOCKS],
}

/// Whether a call of `rows` rows against `w` takes this kernel (on VNNI) for its column groups.
pub(super) fn takes(rows: usize, w: &Q8Weights<'_>) -> bool {
    super::side_by_side::enabled()
        && rows >= super::side_by_side::MIN_ROWS
        && w.k / BLOCK <= MAX_BLOCKS
}

/// Output columns `c0..c0 + GROUP` of every row of `a` into `y` (`[rows, n]`).
///
/// # Safety
/// The CPU has AVX2, FMA and AVX-512 F, BW, VL and VNNI; `c0 + GROUP <= w.n`; [`takes`] holds.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn group(a: &Activations<'_>, w: Q8Weights<'_>, c0: usize, y: &Output) {
    let blocks = a.k / BLOCK;
    assert!(c0 + GROUP <= w.n && blocks <= MAX_BLOCKS && a.k == w.k);
    assert!(w.qs.len() == w.n * blocks * BLOCK && w.scale.len() == w.n * blocks);
    assert!(w.offset.is_none_or(|o| o.len() == w.scale.len()) && a.padded.is_multiple_of(LANES));
    assert!(a.q.len() == a.rows * a.k && a.d.len().min(a.sum.len()) == a.rows * a.padded);
    let has_offset = w.offset.is_some();
    let mut g = std::mem::MaybeUninit::<Group>::uninit();
    let g = g.as_mut_ptr();
    transpose(w, c0, blocks, g);
    let g = &*g; // every block below `blocks` was written
    for r in 0..a.rows {
        let xq = a.q.as_ptr().add(r * a.k);
        let (d, sum) = (
            a.d.as_ptr().add(r * a.padded),
            a.sum.as_ptr().add(r * a.padded),
        );
        let mut acc = [_mm256_setzero_ps(); LANES];
        for b0 in (0..a.padded).step_by(LANES) {
            for (l, acc) in acc.iter_mut().enumerate() {
                let b = b0 + l;
                // a padding block updates its lane with zeros, as `plain.rs` does
                let (isum, scale, offset) = if b < blocks {
                    let x = xq.add(b * BLOCK);
                    let mut dots = _mm256_setzero_si256();
                    for j in 0..8 {
                        let s = _mm256_set1_epi32((x.add(4 * j) as *const i32).read_unaligned());
                        dots = _mm256_dpbusd_epi32(dots, g.quads[b][j], s);
                    }
                    // Σ q of the block is an exact integer (|Σ q| <= 32 * 127) held as an f32
                    let bias = _mm256_set1_epi32(128 * (*sum.add(b) as i32));
                    let isum = _mm256_cvtepi32_ps(_mm256_sub_epi32(dots, bias));
                    (isum, g.scale[b], g.offset[b])
                } else {
                    let zero = _mm256_setzero_ps();
                    (zero, zero, zero)
                };
                let offset = has_offset.then_some(offset);
                combine(acc, isum, scale, offset, *d.add(b), *sum.add(b));
            }
        }
        store_row(&acc, y, r * w.n + c0);
    }
}

/// Writes blocks `0..blocks` of columns `c0..c0 + GROUP` into `g`, transposed, the sign bits
/// flipped.
#[inline(always)]
unsafe fn transpose(w: Q8Weights<'_>, c0: usize, blocks: usize, g: *mut Group) {
    let qs = w.qs.as_ptr();
    let flip = _mm256_set1_epi8(i8::MIN);
    // the next group's bytes follow this one's: ask for them now, so that they arrive while this
    // group's rows are multiplied
    let next = (c0 + GROUP) * blocks;
    for line in (0..GROUP * blocks * BLOCK).step_by(64) {
        _mm_prefetch(qs.wrapping_add(next * BLOCK + line), _MM_HINT_T0);
    }
    for line in (0..GROUP * blocks * 4).step_by(64) {
        let scale = w.scale.as_ptr().wrapping_add(next).cast::<i8>();
        _mm_prefetch(scale.wrapping_add(line), _MM_HINT_T0);
        if let Some(o) = w.offset {
            let offset = o.as_ptr().wrapping_add(next).cast::<i8>();
            _mm_prefetch(offset.wrapping_add(line), _MM_HINT_T0);
        }
    }
    for b in 0..blocks {
        // row c of the 8 x 8 matrix of u32 quads: column c0 + c's block b
        let v: [__m256i; 8] = std::array::from_fn(|c| {
            _mm256_loadu_si256(qs.add(((c0 + c) * blocks + b) * BLOCK) as *const __m256i)
        });
        let quads = std::ptr::addr_of_mut!((*g).quads[b]) as *mut __m256i;
        for (j, t) in transpose8(v).iter().enumerate() {
            quads.add(j).write(_mm256_xor_si256(*t, flip));
        }
        let lanes = |p: *const f32| {
            let at = |c: usize| *p.add((c0 + c) * blocks + b);
            _mm256_setr_ps(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7))
        };
        std::ptr::addr_of_mut!((*g).scale[b]).write(lanes(w.scale.as_ptr()));
        let offset = match w.offset {
            Some(o) => lanes(o.as_ptr()),
            None => _mm256_setzero_ps(),
        };
        std::ptr::addr_of_mut!((*g).offset[b]).write(offset);
    }
}

/// The transpose of an 8 x 8 matrix of 32-bit elements, one row per vector.
#[inline(always)]
unsafe fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
    let (a, b) = (
        _mm256_unpacklo_epi32(r[0], r[1]),
        _mm256_unpackhi_epi32(r[0], r[1]),
    );
    let (c, d) = (
        _mm256_unpacklo_epi32(r[2], r[3]),
        _mm256_unpackhi_epi32(r[2], r[3]),
    );
    let (e, f) = (
        _mm256_unpacklo_epi32(r[4], r[5]),
        _mm256_unpackhi_epi32(r[4], r[5]),
    );
    let (g, h) = (
        _mm256_unpacklo_epi32(r[6], r[7]),
        _mm256_unpackhi_epi32(r[6], r[7]),
    );
    // within each 128-bit half: elements 0 and 1 (then 2 and 3) of rows 0-3 and of rows 4-7
    let (ac0, ac1) = (_mm256_unpacklo_epi64(a, c), _mm256_unpackhi_epi64(a, c));
    let (bd0, bd1) = (_mm256_unpacklo_epi64(b, d), _mm256_unpackhi_epi64(b, d));
    let (eg0, eg1) = (_mm256_unpacklo_epi64(e, g), _mm256_unpackhi_epi64(e, g));
    let (fh0, fh1) = (_mm256_unpacklo_epi64(f, h), _mm256_unpackhi_epi64(f, h));
    [
        _mm256_permute2x128_si256::<0x20>(ac0, eg0),
        _mm256_permute2x128_si256::<0x20>(ac1, eg1),
        _mm256_permute2x128_si256::<0x20>(bd0, fh0),
        _mm256_permute2x128_si256::<0x20>(bd1, fh1),
        _mm256_permute2x128_si256::<0x31>(ac0, eg0),
        _mm256_permute2x128_si256::<0x31>(ac1, eg1),
        _mm256_permute2x128_si256::<0x31>(bd0, fh0),
        _mm256_permute2x128_si256::<0x31>(bd1, fh1),
    ]
}
