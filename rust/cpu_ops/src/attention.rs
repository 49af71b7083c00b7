//! Decode attention straight from the paged KV pool: one query row per sequence against its
//! cells, read in place through the sequence's cell list (no gather into a padded batch).
//!
//! Per (sequence, KV head): the scores of the query heads that share the head (GQA), a softmax
//! in f32 with the maximum subtracted, then the weighted sum of V. Tasks are split over the
//! threads of [`crate::set_threads`]. Not row-invariant work splitting is irrelevant here: each
//! task's arithmetic is fixed, but the order of the sums is this file's, not torch's.

mod kv_values;
#[cfg(test)]
mod tests;

use crate::shape::ShapeError;
use crate::threads::{parallel, team_size, Output};
pub(crate) use kv_values::f16_to_f32;
pub use kv_values::KvValues;
use kv_values::{F16Plain, F16cRows, InPlace, Rows};

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

/// How a score is made of `q . k`: times `scale`, then, where `softcap` is set, squashed to
/// `softcap * tanh(score / softcap)` (Gemma 2's attention logit soft-capping).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scores {
    pub scale: f32,
    pub softcap: Option<f32>,
}

impl Scores {
    /// `1 / sqrt(head_dim)`, no cap: every Llama-family model's.
    pub fn standard(head_dim: usize) -> Self {
        Scores {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
        }
    }
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
        if !self.k.same_kind(&self.v)
            || self.k.len() != self.v.len()
            || !self.k.len().is_multiple_of(cell)
        {
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
    let scores = Scores::standard(a.head_dim);
    run(a, scores, out, crate::isa::avx2())
}

/// [`decode_attention`] with its scores made as `scores` says.
pub fn decode_attention_with(
    a: DecodeAttention<'_>,
    scores: Scores,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    run(a, scores, out, crate::isa::avx2())
}

/// [`decode_attention`] with the SIMD paths on (where the CPU has them) or off: the same bits.
fn run(a: DecodeAttention<'_>, sc: Scores, out: &mut [f32], simd: bool) -> Result<(), ShapeError> {
    a.check(out.len())?;
    match (a.k, a.v) {
        (KvValues::F32(k), KvValues::F32(v)) => tasks(&a, sc, InPlace(k), InPlace(v), simd, out),
        (KvValues::Bf16(k), KvValues::Bf16(v)) => tasks(&a, sc, InPlace(k), InPlace(v), simd, out),
        (KvValues::F16(k), KvValues::F16(v)) => match (F16cRows::new(k), F16cRows::new(v)) {
            (Some(k), Some(v)) if simd => tasks(&a, sc, k, v, simd, out),
            _ => tasks(&a, sc, F16Plain(k), F16Plain(v), simd, out),
        },
        _ => unreachable!("check() refuses K and V of two kinds"),
    }
    Ok(())
}

/// Every sequence's attention, split over the kernel threads. A task is one sequence's run of
/// KV heads: all of them where there are enough sequences to keep the threads busy, so that a
/// task reads each cell's K (then V) heads together, one contiguous run of the pool; one head
/// where there are few sequences, so that one sequence still spreads over the threads. Either
/// way each (sequence, KV head) does the same arithmetic: the split never changes the bits.
fn tasks<R: Rows>(a: &DecodeAttention<'_>, sc: Scores, k: R, v: R, simd: bool, out: &mut [f32]) {
    let out = Output::new(out);
    let seqs = a.rows.len();
    let heads_per_task = if seqs >= WHOLE_CELL_TASKS_PER_THREAD * team_size() {
        a.kv_heads
    } else {
        1
    };
    let per_seq = a.kv_heads / heads_per_task;
    let work: usize =
        a.context.iter().map(|&c| c as usize).sum::<usize>() * a.kv_heads * a.head_dim;
    parallel(seqs * per_seq, work, &|range| {
        let mut scratch = Vec::new();
        for task in range {
            let (b, first) = (task / per_seq, task % per_seq * heads_per_task);
            let t = Task {
                b,
                heads: first..first + heads_per_task,
            };
            if simd && R::F16C {
                // SAFETY: AVX2 and FMA are present (isa::avx2), and F16C (R::F16C).
                unsafe { task_f16c(a, sc, k, v, t, &out, &mut scratch) }
            } else if simd {
                // SAFETY: AVX2 and FMA are present (isa::avx2).
                unsafe { task_avx2(a, sc, k, v, t, &out, &mut scratch) }
            } else {
                one_task(a, sc, k, v, t, &out, &mut scratch)
            }
        }
    });
}

/// Sequences per thread from which a task takes all of a sequence's KV heads.
const WHOLE_CELL_TASKS_PER_THREAD: usize = 2;

/// Sequence `b`'s KV heads `heads`.
#[derive(Clone)]
struct Task {
    b: usize,
    heads: std::ops::Range<usize>,
}

/// [`one_task`] compiled for a SIMD level (on x86-64; elsewhere it is `one_task`).
macro_rules! simd_task {
    ($(#[$doc:meta])* $name:ident, $features:literal) => {
        $(#[$doc])*
        #[cfg_attr(target_arch = "x86_64", target_feature(enable = $features))]
        unsafe fn $name<R: Rows>(
            a: &DecodeAttention<'_>,
            sc: Scores,
            k: R,
            v: R,
            task: Task,
            out: &Output<'_>,
            s: &mut Vec<f32>,
        ) {
            one_task(a, sc, k, v, task, out, s)
        }
    };
}

simd_task!(
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    task_avx2,
    "avx2,fma"
);
simd_task!(
    /// With F16C too, so that [`F16cRows`]' conversions are inlined.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    task_f16c,
    "avx2,fma,f16c"
);

/// Sequence `task.b`, KV heads `task.heads`: each head's `group` query heads. The same
/// arithmetic whatever the pool holds: each value is widened to f32 (exactly) where it is read.
#[inline(always)]
fn one_task<R: Rows>(
    a: &DecodeAttention<'_>,
    sc: Scores,
    k_all: R,
    v_all: R,
    task: Task,
    out: &Output<'_>,
    scratch: &mut Vec<f32>,
) {
    let (kv, d) = (a.kv_heads, a.head_dim);
    let group = a.heads / kv;
    let b = task.b;
    let (g0, n) = (task.heads.start, task.heads.len());
    let ctx = a.context[b] as usize;
    let row = a.rows[b] as usize;
    let cells = &a.cells[b * a.stride..b * a.stride + ctx];
    let scale = sc.scale;
    // query head j of the task's i-th KV head; score and accumulator rows are numbered alike
    let q_at = |i: usize, j: usize| (row * a.heads + (g0 + i) * group + j) * d;
    let at = |cell: i64| (cell as usize * kv + g0) * d;
    let heads = n * group;
    // One buffer per thread for the scores, the accumulator and a widened row: no allocation
    // per task.
    scratch.clear();
    scratch.resize(heads * (ctx + d) + d, 0.0);
    let (scores, rest) = scratch.split_at_mut(heads * ctx);
    let (acc, wide) = rest.split_at_mut(heads * d);
    for (c, &cell) in cells.iter().enumerate() {
        if let Some(&ahead) = cells.get(c + PREFETCH_CELLS) {
            k_all.prefetch(at(ahead), n * d);
        }
        for i in 0..n {
            let k = k_all.row(at(cell) + i * d, d, wide);
            for j in 0..group {
                let h = i * group + j;
                let s = dot(&a.q[q_at(i, j)..][..d], k) * scale;
                scores[h * ctx + c] = match sc.softcap {
                    None => s,
                    Some(cap) => cap * (s / cap).tanh(),
                };
            }
        }
    }
    for h in 0..heads {
        let s = &mut scores[h * ctx..(h + 1) * ctx];
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
            v_all.prefetch(at(ahead), n * d);
        }
        for i in 0..n {
            let v = v_all.row(at(cell) + i * d, d, wide);
            for j in 0..group {
                let h = i * group + j;
                let p = scores[h * ctx + c];
                for (o, x) in acc[h * d..(h + 1) * d].iter_mut().zip(v) {
                    *o += p * x;
                }
            }
        }
    }
    for i in 0..n {
        for j in 0..group {
            let h = i * group + j;
            for (e, x) in acc[h * d..(h + 1) * d].iter().enumerate() {
                out.set(q_at(i, j) + e, *x);
            }
        }
    }
}

/// Cells ahead whose K (or V) row is requested before it is read: a sequence's cells lie in
/// pages scattered over the pool, where the hardware prefetcher cannot follow.
const PREFETCH_CELLS: usize = 6;

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}
