//! The attention kernel proper: one task is a block of entries (`runs.rs`) and a run of KV heads,
//! and reads each of the union's K rows, then V rows, once for every entry and query head of
//! the block that attends to it.
//!
//! # Arithmetic: one order, every path
//! Per entry and query head, over the entry's own cells `c` in their order:
//!
//! ```text
//! s_c  = dot(q, k_c) * scale            (then cap * tanh(s_c / cap) where a soft-cap is set)
//! dot  : lane[i % 16] = fma(q_i, k_i, lane[i % 16]) for i in 0..d in order (one rounding each),
//!        a_j = lane_j + lane_{j+8}, then ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
//! m    = the largest s_c (f32::max, in order)
//! e_c  = exp(s_c - m)                   (the crate's polynomial exp, decoder/silu.rs)
//! p_c  = e_c * (1 / Σ e_c)              (the sum as the dot's: e_c into lane c % 16, then the tree)
//! out  = Σ p_c v_c                      (per value, in cell order, an fma each from +0)
//! ```
//!
//! Plain Rust (`f32::mul_add`); the SIMD paths are this same code compiled with AVX2, FMA or
//! AVX-512 enabled (the compiler vectorises the 16-lane dot, the sums, the exp and the weighted
//! sum without reordering a single operation; `mul_add` is always one fused operation, never a
//! product and a sum), so every path gives the plain bits, and no block, head split or thread
//! split changes an entry's result.
//!
//! Why fused: a product then a sum was two vector operations where one does, in the dot and the
//! weighted sum alike, which are most of the kernel's arithmetic; and one rounding where there
//! were two. With it (and the sum of the `e_c` in lanes instead of one chain of dependent adds,
//! and four query heads' weighted sums at a time on AVX-512) one layer of a 448-row prompt took
//! 5.8-6.2 ms where it took 7.3-8.0 (one thread, AVX-512; 7.3-7.4 against 8.1-8.7 on AVX2), and
//! eight sequences' decode 10 % less.

use super::dot::{weighted_heads, Dot, HEADS, LANES};
use super::kv_values::Rows;
use super::runs::{Block, BLOCK_ENTRIES};
use super::{DecodeAttention, Scores};
use crate::exp::exp;
use crate::threads::Output;

/// Entries of a block from which its scores come sixteen cells at a time ([`Dot::dots16`]),
/// where the level has it: every block (one row's decode attention a few per cent faster too).
const WIDE_ENTRIES: usize = 1;
/// Cells ahead whose K (or V) rows are requested before they are read: a sequence's cells lie
/// in pages scattered over the pool, where the hardware prefetcher cannot follow.
const PREFETCH_CELLS: usize = 6;

/// V values (of a task's cells and KV heads) above which one entry's weighted sums read the
/// rows straight from the pool instead of from a widened copy: as many f32 as half the core's
/// L2 holds. The copy lets the sums stay in registers across the cells, and eight sequences'
/// decode attention took 14-36 % less time with it (AVX2 and AVX-512, contexts of 150 to 1000,
/// f16 pool); but a copy larger than L2 is written and read from further down: at 16,000 cells
/// it took 1.45x the time. Half the L2, because the pool's rows and the K tile pass through it
/// too: on a 2 MiB L2 (`examples/attention_speed.rs`, a pool per layer, two threads) the copy won
/// up to 1 MiB (eight sequences at 400 and 1,000 cells 10-15 % faster than streaming, one at
/// 1,500 cells 10-20 %), was even at one sequence of 4,000 cells (1 MiB) and lost past it
/// (eight at 2,000 cells, 1.5 MiB, 4-7 % slower; one at 16,000, 4 MiB, 25 %). A fixed 256 KiB
/// had streamed every decode row past 341 cells of three KV heads on every machine.
pub(super) fn stream_v_values() -> usize {
    crate::cache::l2_bytes() / 2 / std::mem::size_of::<f32>()
}

/// One thread's buffers, kept across its tasks.
#[derive(Default)]
pub(super) struct Scratch {
    union: Vec<i64>,
    /// `[entries, heads, cells]`: scores, then probabilities
    scores: Vec<f32>,
    /// `[cells, kv heads of the task, d]`: the union's V rows widened
    acc: Vec<f32>,
    /// `[kv heads of the task, d]`: one cell's K or V rows widened
    wide: Vec<f32>,
    /// `[16 cells, kv heads of the task, d]`: a tile of the union's K rows
    kt: Vec<f32>,
}

/// A score from its dot: times the scale, then soft-capped where the model caps.
#[inline(always)]
fn make_score(dot: f32, sc: Scores) -> f32 {
    let score = dot * sc.scale;
    match sc.softcap {
        None => score,
        Some(cap) => cap * (score / cap).tanh(),
    }
}

/// The largest value of `row` (NaNs ignored; `-inf` for none), as `f32::max` folds it in order:
/// sixteen lanes' maxima first, which the compiler vectorises. The same value but for the sign
/// of a zero, which no `exp(s - max)` tells apart.
#[inline(always)]
fn max_of(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (m, x) in lanes.iter_mut().zip(chunk) {
            *m = m.max(*x);
        }
    }
    let tail = chunks.remainder().iter();
    tail.chain(&lanes).fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// The sum of `row` in the dot's order: value `i` into lane `i % 16` (from +0), then the lanes'
/// tree. Sixteen independent sums, which the compiler vectorises, where one running sum in
/// order waited on each add's latency (a tenth of a 448-token prompt's attention).
#[inline(always)]
fn sum_of(row: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (s, x) in lanes.iter_mut().zip(chunk) {
            *s += x;
        }
    }
    for (s, x) in lanes.iter_mut().zip(chunks.remainder()) {
        *s += x;
    }
    crate::lane_tree::fold(&lanes)
}

/// `v` at least `len` long: grown with zeros where shorter, its values otherwise left as they are
/// (the caller writes each before reading it).
#[inline(always)]
fn at_least(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

/// Entries `block` against KV heads `heads`: their query heads' outputs into `out`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn task<R: Rows, D: Dot>(
    a: &DecodeAttention<'_>,
    sc: Scores,
    k_all: R,
    v_all: R,
    block: &Block,
    heads: std::ops::Range<usize>,
    out: &Output<'_>,
    s: &mut Scratch,
) {
    let (kv, d, group) = (a.kv_heads, a.head_dim, a.heads / a.kv_heads);
    let (g0, n) = (heads.start, heads.len());
    let entries = block.entries.len();
    debug_assert!(entries <= BLOCK_ENTRIES);
    block.union(a, &mut s.union);
    let cells = s.union.len();
    let q_heads = n * group; // per entry

    // every score is written before it is read (each entry's own cells only), so the buffers only
    // grow: clearing them was a `memset` a task, a tenth of an eight-row decode's attention
    at_least(&mut s.scores, entries * q_heads * cells);
    at_least(&mut s.wide, n * d);
    let ranges: [std::ops::Range<usize>; BLOCK_ENTRIES] = std::array::from_fn(|i| {
        if i < entries {
            block.range(a, block.entries.start + i)
        } else {
            0..0
        }
    });
    // query head j of the task's i-th KV head, for entry b; its scores and sums are numbered
    // (entry, i * group + j)
    let q_at =
        |b: usize, i: usize, j: usize| (a.rows[b] as usize * a.heads + (g0 + i) * group + j) * d;
    let at = |cell: i64| (cell as usize * kv + g0) * d;

    if D::WIDE && entries >= WIDE_ENTRIES {
        // sixteen cells' K rows at a time (widened where stored narrower), then each query's
        // scores of the cells it attends to among them, sixteen dots at once
        let row_len = n * d;
        // a tile's rows past its last cell hold stale values: their dots are computed and dropped
        at_least(&mut s.kt, LANES * row_len);
        let mut dots = [0.0f32; LANES];
        for tile in 0..cells.div_ceil(LANES) {
            let first = tile * LANES;
            let last = (first + LANES).min(cells);
            for c in first..last {
                if let Some(&ahead) = s.union.get(c + PREFETCH_CELLS) {
                    k_all.prefetch(at(ahead), row_len);
                    // its V row too, so that the weighted sums below find it in cache rather than
                    // wait on memory again: eight sequences' decode attention over 125 cells each,
                    // a pool per layer, took ~4 % less (AVX-512, alternated)
                    v_all.prefetch(at(ahead), row_len);
                }
                k_all.row_into(at(s.union[c]), row_len, &mut s.kt[(c - first) * row_len..]);
            }
            for (e, range) in ranges.iter().enumerate().take(entries) {
                let (from, to) = (first.max(range.start), last.min(range.end));
                if from >= to {
                    continue;
                }
                let b = block.entries.start + e;
                for i in 0..n {
                    for j in 0..group {
                        let q = &a.q[q_at(b, i, j)..][..d];
                        // SAFETY: the caller runs `D` only where the CPU has its instructions.
                        unsafe { D::dots16(q, &s.kt[i * d..], row_len, &mut dots) };
                        let row = &mut s.scores[(e * q_heads + i * group + j) * cells..][..cells];
                        let made = row[from..to]
                            .iter_mut()
                            .zip(&dots[from - first..to - first]);
                        match sc.softcap {
                            None => made.for_each(|(r, x)| *r = x * sc.scale),
                            Some(_) => made.for_each(|(r, x)| *r = make_score(*x, sc)),
                        }
                    }
                }
            }
        }
    } else {
        // each K row once, for every entry whose range holds it
        for c in 0..cells {
            if let Some(&ahead) = s.union.get(c + PREFETCH_CELLS) {
                k_all.prefetch(at(ahead), n * d);
            }
            let k = k_all.row(at(s.union[c]), n * d, &mut s.wide);
            for (e, range) in ranges.iter().enumerate().take(entries) {
                if !range.contains(&c) {
                    continue;
                }
                let b = block.entries.start + e;
                for i in 0..n {
                    for j in 0..group {
                        // SAFETY: the caller runs `D` only where the CPU has its instructions.
                        let dot = unsafe { D::dot(&a.q[q_at(b, i, j)..][..d], &k[i * d..][..d]) };
                        let h = e * q_heads + i * group + j;
                        s.scores[h * cells + c] = make_score(dot, sc);
                    }
                }
            }
        }
    }
    // each (entry, head)'s softmax over its own cells
    for (e, range) in ranges.iter().enumerate().take(entries) {
        for h in 0..q_heads {
            let row = &mut s.scores[(e * q_heads + h) * cells..][..cells][range.clone()];
            let max = max_of(row);
            for x in row.iter_mut() {
                *x = exp(*x - max);
            }
            let inv = 1.0 / sum_of(row);
            row.iter_mut().for_each(|x| *x *= inv);
        }
    }
    if entries == 1 && cells * n * d > stream_v_values() {
        // one entry with a long context: each V row straight from the pool into every head's
        // sums (kept in memory), so the rows are read once rather than widened into a copy
        // larger than the core's L2 and read again
        s.acc.clear();
        s.acc.resize(q_heads * d, 0.0);
        for c in 0..cells {
            if let Some(&ahead) = s.union.get(c + PREFETCH_CELLS) {
                v_all.prefetch(at(ahead), n * d);
            }
            let v = v_all.row(at(s.union[c]), n * d, &mut s.wide);
            for i in 0..n {
                for j in 0..group {
                    let h = i * group + j;
                    let p = s.scores[h * cells + c];
                    for (o, x) in s.acc[h * d..][..d].iter_mut().zip(&v[i * d..][..d]) {
                        *o = p.mul_add(*x, *o);
                    }
                }
            }
        }
        let b = block.entries.start;
        for i in 0..n {
            for j in 0..group {
                out.set_run(q_at(b, i, j), &s.acc[(i * group + j) * d..][..d]);
            }
        }
        return;
    }
    // weighted sums: the union's V rows widened once, then each (entry, query head) over its
    // cells, sixteen values of the output at a time (kept in registers across the cells)
    at_least(&mut s.acc, cells * n * d); // every row written below
    for c in 0..cells {
        if let Some(&ahead) = s.union.get(c + PREFETCH_CELLS) {
            v_all.prefetch(at(ahead), n * d);
        }
        v_all.row_into(at(s.union[c]), n * d, &mut s.acc[c * n * d..]);
    }
    let whole = d - d % LANES;
    for (e, range) in ranges.iter().enumerate().take(entries) {
        let b = block.entries.start + e;
        let probs =
            |i: usize, j: usize| &s.scores[(e * q_heads + i * group + j) * cells..][..cells];
        for i in 0..n {
            // the query heads of a KV head up to four at a time (they read the same V rows),
            // four runs of sixteen values each: independent sums, so that the products of one
            // cell overlap the additions of the last
            for j in (0..group).step_by(HEADS) {
                let count = (group - j).min(HEADS);
                let p = std::array::from_fn(|h| probs(i, j + h.min(count - 1)));
                let mut t = 0;
                while t < whole {
                    let m = ((whole - t) / LANES).min(4);
                    let mut sums = [[[0.0f32; LANES]; 4]; HEADS];
                    let v = &s.acc[i * d + t..];
                    // SAFETY: the caller runs `D` only where the CPU has its instructions.
                    unsafe { weighted_heads::<D>(p, count, v, n * d, range.clone(), m, &mut sums) };
                    for (jj, sums) in sums.iter().enumerate().take(count) {
                        for (u, sum) in sums.iter().enumerate().take(m) {
                            out.set_array(q_at(b, i, j + jj) + t + u * LANES, sum);
                        }
                    }
                    t += m * LANES;
                }
                for jj in (j..j + count).filter(|_| whole < d) {
                    let rest = d - whole;
                    let mut sums = [0.0f32; LANES];
                    for c in range.clone() {
                        let (p, v) = (probs(i, jj)[c], &s.acc[(c * n + i) * d + whole..][..rest]);
                        for (o, x) in sums.iter_mut().zip(v) {
                            *o = p.mul_add(*x, *o);
                        }
                    }
                    out.set_run(q_at(b, i, jj) + whole, &sums[..rest]);
                }
            }
        }
    }
}
