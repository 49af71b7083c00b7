//! Attention straight from the paged KV pool: each query row (an "entry": a decode row, or one
//! row of a prompt chunk) against its sequence's cells up to its position, read in place through
//! the cell list (no gather into a padded batch).
//!
//! Per (entry, KV head): the scores of the query heads that share the head (GQA), a softmax in
//! f32 with the maximum subtracted, then the weighted sum of V, in the one order `block.rs`
//! fixes. A prompt chunk's consecutive rows go in blocks that read each K and V row once for all
//! of them (`runs.rs`). Tasks are split over the threads of [`crate::set_threads`]; no block,
//! split or instruction set changes an entry's bits.

mod block;
mod dot;
mod kv_values;
mod runs;
#[cfg(test)]
mod tests;

use crate::shape::ShapeError;
use crate::threads::{parallel, team_size, Output};
use block::Scratch;
use dot::{Avx2Dot, Avx512Dot, PlainDot};
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
    run_at(a, sc, out, Level::best(simd))
}

/// [`decode_attention`] compiled for `level`, which the CPU must have (`Level::available`).
fn run_at(
    a: DecodeAttention<'_>,
    sc: Scores,
    out: &mut [f32],
    level: Level,
) -> Result<(), ShapeError> {
    a.check(out.len())?;
    match (a.k, a.v) {
        (KvValues::F32(k), KvValues::F32(v)) => tasks(&a, sc, InPlace(k), InPlace(v), level, out),
        (KvValues::Bf16(k), KvValues::Bf16(v)) => tasks(&a, sc, InPlace(k), InPlace(v), level, out),
        (KvValues::F16(k), KvValues::F16(v)) => match (F16cRows::new(k), F16cRows::new(v)) {
            (Some(k), Some(v)) if level != Level::Plain => tasks(&a, sc, k, v, level, out),
            _ => tasks(&a, sc, F16Plain(k), F16Plain(v), level, out),
        },
        _ => unreachable!("check() refuses K and V of two kinds"),
    }
    Ok(())
}

/// Every entry's attention, split over the kernel threads. The entries are cut into blocks
/// (`runs.rs`: a prompt chunk's consecutive rows share one read of each K and V row); a task is
/// a block and a run of KV heads: all of them where there are enough blocks to keep the threads
/// busy, so that a task reads each cell's K (then V) heads together, one contiguous run of the
/// pool; one head where there are few, so that a single row still spreads over the threads.
/// Either way each (entry, query head) does the same arithmetic (`block.rs`): the split never
/// changes the bits.
fn tasks<R: Rows>(a: &DecodeAttention<'_>, sc: Scores, k: R, v: R, level: Level, out: &mut [f32]) {
    let out = Output::new(out);
    let blocks = runs::blocks(a);
    let heads_per_task = if blocks.len() >= WHOLE_CELL_TASKS_PER_THREAD * team_size() {
        a.kv_heads
    } else {
        1
    };
    let per_block = a.kv_heads / heads_per_task;
    let work: usize =
        a.context.iter().map(|&c| c as usize).sum::<usize>() * a.kv_heads * a.head_dim;
    parallel(blocks.len() * per_block, work, &|range| {
        SCRATCH.with_borrow_mut(|scratch| {
            for t in range {
                let (block, first) = (&blocks[t / per_block], t % per_block * heads_per_task);
                let heads = first..first + heads_per_task;
                match level {
                    // SAFETY: each level is chosen only where the CPU has its features (`run`).
                    Level::Avx512 => unsafe {
                        task_avx512(a, sc, k, v, block, heads, &out, scratch)
                    },
                    Level::Avx2 => unsafe { task_avx2(a, sc, k, v, block, heads, &out, scratch) },
                    Level::Plain => {
                        block::task::<R, PlainDot>(a, sc, k, v, block, heads, &out, scratch)
                    }
                }
            }
        })
    });
}

thread_local! {
    /// Each thread's buffers, kept across tasks and calls: made afresh for each piece of a call,
    /// their allocation and zeroing were ~2 % of an eight-row decode step's time.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Blocks per thread from which a task takes all of a block's KV heads.
const WHOLE_CELL_TASKS_PER_THREAD: usize = 2;

/// Which compilation of `block::task` runs: the same operations in the same order, vectorised
/// for wider registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    Plain,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX-512F on top of them.
    Avx512,
}

impl Level {
    /// The widest level this CPU runs under `KVPARK_CPU_ISA`, or plain where `simd` is off.
    fn best(simd: bool) -> Level {
        let f = crate::isa::effective();
        match f.level() {
            _ if !simd || !cfg!(target_arch = "x86_64") || !f.f16c => Level::Plain,
            crate::isa::Isa::Avx512 => Level::Avx512,
            crate::isa::Isa::Avx2 => Level::Avx2,
            crate::isa::Isa::Plain => Level::Plain,
        }
    }

    /// Every level this CPU runs, whatever `KVPARK_CPU_ISA` says: the tests compare them all.
    #[cfg(test)]
    fn available() -> Vec<Level> {
        let f = crate::isa::Features::detect();
        let x86 = cfg!(target_arch = "x86_64") && f.f16c;
        let mut levels = vec![Level::Plain];
        if x86 && f.level() >= crate::isa::Isa::Avx2 {
            levels.push(Level::Avx2);
        }
        if x86 && f.level() >= crate::isa::Isa::Avx512 {
            levels.push(Level::Avx512);
        }
        levels
    }
}

/// `block::task` compiled for a SIMD level (on x86-64; elsewhere it is `block::task`).
macro_rules! simd_task {
    ($(#[$doc:meta])* $name:ident, $dot:ty, $features:literal) => {
        $(#[$doc])*
        #[cfg_attr(target_arch = "x86_64", target_feature(enable = $features))]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name<R: Rows>(
            a: &DecodeAttention<'_>,
            sc: Scores,
            k: R,
            v: R,
            block: &runs::Block,
            heads: std::ops::Range<usize>,
            out: &Output<'_>,
            s: &mut Scratch,
        ) {
            block::task::<R, $dot>(a, sc, k, v, block, heads, out, s)
        }
    };
}

simd_task!(
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    task_avx2,
    Avx2Dot,
    "avx2,fma,f16c"
);
simd_task!(
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and AVX-512F.
    task_avx512,
    Avx512Dot,
    "avx2,fma,f16c,avx512f"
);
