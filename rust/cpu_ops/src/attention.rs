//! Decode attention straight from the paged KV pool: one query row per sequence against its
//! cells, read in place through the sequence's cell list (no gather into a padded batch).
//!
//! Per (sequence, KV head): the scores of the query heads that share the head (GQA), a softmax
//! in f32 with the maximum subtracted, then the weighted sum of V. Tasks are split over the
//! threads of [`crate::set_threads`]. Not row-invariant work splitting is irrelevant here: each
//! task's arithmetic is fixed, but the order of the sums is this file's, not torch's.

use crate::threads::{parallel, Output};
use crate::ShapeError;

/// The pool's K or V values: f32, or bf16 (the upper half of an f32's bits, widened exactly by a
/// shift), `[cells, kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub enum KvValues<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl KvValues<'_> {
    fn len(&self) -> usize {
        match self {
            KvValues::F32(x) => x.len(),
            KvValues::Bf16(x) => x.len(),
        }
    }
}

/// One stored K or V value, widened to f32 where it is used.
trait KvElem: Copy {
    fn widen(self) -> f32;
}

impl KvElem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl KvElem for u16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

/// One step's decode rows and where their cells lie.
#[derive(Clone, Copy, Debug)]
pub struct DecodeAttention<'a> {
    /// `[rows, heads, head_dim]`: the step's query rows (rope applied).
    pub q: &'a [f32],
    /// `[cells, kv_heads, head_dim]` each: the whole pool, this step's K and V already stored;
    /// both of one kind.
    pub k: KvValues<'a>,
    pub v: KvValues<'a>,
    /// `[seqs, stride]`: each sequence's cells in logical order (entries past its context unused).
    pub cells: &'a [i64],
    pub stride: usize,
    /// `[seqs]`: cells each sequence attends to (its context, this step's row included).
    pub context: &'a [i64],
    /// `[seqs]`: each sequence's query row in `q` (distinct).
    pub rows: &'a [i64],
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

fn bad(msg: String) -> ShapeError {
    ShapeError(msg)
}

impl DecodeAttention<'_> {
    fn check(&self, out_len: usize) -> Result<(), ShapeError> {
        let (h, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        if h == 0 || kv == 0 || d == 0 || h % kv != 0 {
            return Err(bad(format!("{h} heads do not share {kv} KV heads evenly")));
        }
        let row = h * d;
        if !self.q.len().is_multiple_of(row) || out_len != self.q.len() {
            return Err(bad(format!(
                "q has {} values, out {out_len}: not rows of {row}",
                self.q.len()
            )));
        }
        let n_rows = self.q.len() / row;
        let cell = kv * d;
        let same_kind = matches!(
            (self.k, self.v),
            (KvValues::F32(_), KvValues::F32(_)) | (KvValues::Bf16(_), KvValues::Bf16(_))
        );
        if !same_kind || self.k.len() != self.v.len() || !self.k.len().is_multiple_of(cell) {
            return Err(bad(format!(
                "K and V must be whole cells of {cell} values, of one kind"
            )));
        }
        let n_cells = self.k.len() / cell;
        let seqs = self.rows.len();
        if self.context.len() != seqs || self.cells.len() != seqs * self.stride {
            return Err(bad(format!(
                "{seqs} rows but {} contexts and {} cells",
                self.context.len(),
                self.cells.len()
            )));
        }
        let mut used = vec![false; n_rows];
        for b in 0..seqs {
            let (r, ctx) = (self.rows[b], self.context[b]);
            if r < 0 || r as usize >= n_rows || std::mem::replace(&mut used[r as usize], true) {
                return Err(bad(format!("query row {r} is out of range or given twice")));
            }
            if ctx < 1 || ctx as usize > self.stride {
                return Err(bad(format!("context {ctx} is not in 1..={}", self.stride)));
            }
            let list = &self.cells[b * self.stride..b * self.stride + ctx as usize];
            if list.iter().any(|&c| c < 0 || c as usize >= n_cells) {
                return Err(bad(format!(
                    "a cell of sequence {b} is outside the pool of {n_cells}"
                )));
            }
        }
        Ok(())
    }
}

/// `out[row of b, h]` = softmax(q . K / sqrt(d)) V over sequence b's cells, for every sequence
/// and head; other rows of `out` are left as they are.
pub fn decode_attention(a: DecodeAttention<'_>, out: &mut [f32]) -> Result<(), ShapeError> {
    a.check(out.len())?;
    let out = Output::new(out);
    let tasks = a.rows.len() * a.kv_heads;
    let work: usize =
        a.context.iter().map(|&c| c as usize).sum::<usize>() * a.kv_heads * a.head_dim;
    let simd = crate::avx2::available();
    parallel(tasks, work, &|range| {
        let mut scratch = Vec::new();
        for task in range {
            match (a.k, a.v, simd) {
                // SAFETY: AVX2 and FMA are present (checked by avx2::available).
                (KvValues::F32(k), KvValues::F32(v), true) => unsafe {
                    task_avx2(&a, k, v, task, &out, &mut scratch)
                },
                (KvValues::Bf16(k), KvValues::Bf16(v), true) => unsafe {
                    task_avx2(&a, k, v, task, &out, &mut scratch)
                },
                (KvValues::F32(k), KvValues::F32(v), false) => {
                    one_task(&a, k, v, task, &out, &mut scratch)
                }
                (KvValues::Bf16(k), KvValues::Bf16(v), false) => {
                    one_task(&a, k, v, task, &out, &mut scratch)
                }
                _ => unreachable!("check() refuses K and V of two kinds"),
            }
        }
    });
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2<T: KvElem>(
    a: &DecodeAttention<'_>,
    k: &[T],
    v: &[T],
    task: usize,
    out: &Output<'_>,
    s: &mut Vec<f32>,
) {
    one_task(a, k, v, task, out, s)
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn task_avx2<T: KvElem>(
    a: &DecodeAttention<'_>,
    k: &[T],
    v: &[T],
    task: usize,
    out: &Output<'_>,
    s: &mut Vec<f32>,
) {
    one_task(a, k, v, task, out, s)
}

/// Sequence `task / kv_heads`, KV head `task % kv_heads`: its `group` query heads. The same
/// arithmetic for f32 and bf16 values: each is widened to f32 (exactly) where it is read.
#[inline(always)]
fn one_task<T: KvElem>(
    a: &DecodeAttention<'_>,
    k_all: &[T],
    v_all: &[T],
    task: usize,
    out: &Output<'_>,
    scores: &mut Vec<f32>,
) {
    let (kv, d) = (a.kv_heads, a.head_dim);
    let group = a.heads / kv;
    let (b, g) = (task / kv, task % kv);
    let ctx = a.context[b] as usize;
    let row = a.rows[b] as usize;
    let cells = &a.cells[b * a.stride..b * a.stride + ctx];
    let scale = 1.0 / (d as f32).sqrt();
    let q_at = |j: usize| (row * a.heads + g * group + j) * d;
    // One buffer per thread for the scores and the accumulator: no allocation per task.
    scores.clear();
    scores.resize(group * (ctx + d), 0.0);
    let (scores, acc) = scores.split_at_mut(group * ctx);
    for (c, &cell) in cells.iter().enumerate() {
        if let Some(&ahead) = cells.get(c + PREFETCH_CELLS) {
            prefetch_row(k_all, (ahead as usize * kv + g) * d, d);
        }
        let k = &k_all[(cell as usize * kv + g) * d..][..d];
        for j in 0..group {
            scores[j * ctx + c] = dot(&a.q[q_at(j)..][..d], k) * scale;
        }
    }
    for j in 0..group {
        let s = &mut scores[j * ctx..(j + 1) * ctx];
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0.0;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let inv = 1.0 / sum;
        s.iter_mut().for_each(|x| *x *= inv);
    }
    for (c, &cell) in cells.iter().enumerate() {
        if let Some(&ahead) = cells.get(c + PREFETCH_CELLS) {
            prefetch_row(v_all, (ahead as usize * kv + g) * d, d);
        }
        let v = &v_all[(cell as usize * kv + g) * d..][..d];
        for j in 0..group {
            let p = scores[j * ctx + c];
            for (o, x) in acc[j * d..(j + 1) * d].iter_mut().zip(v) {
                *o += p * x.widen();
            }
        }
    }
    for j in 0..group {
        for (i, x) in acc[j * d..(j + 1) * d].iter().enumerate() {
            out.set(q_at(j) + i, *x);
        }
    }
}

/// Cells ahead whose K (or V) row is requested before it is read: a sequence's cells lie in
/// pages scattered over the pool, where the hardware prefetcher cannot follow.
const PREFETCH_CELLS: usize = 6;

/// Asks for the cache lines of `values[at..at + len]`; a no-op off x86-64.
#[inline(always)]
fn prefetch_row<T>(values: &[T], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let row = &values[at..at + len];
        let per_line = 64 / std::mem::size_of::<T>();
        for line in (0..len).step_by(per_line) {
            // SAFETY: the address lies inside `row`, and a prefetch never faults anyway.
            unsafe { _mm_prefetch(row.as_ptr().add(line) as *const i8, _MM_HINT_T0) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (values, at, len);
}

#[inline(always)]
fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y.widen())
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i].widen();
        }
    }
    lanes.iter().sum::<f32>() + tail
}
