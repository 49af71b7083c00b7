//! A whole decode step of a Llama-family model in one call: embedding, then per layer RMSNorm,
//! the fused QKV projection, rope, the K/V store, paged attention, the output projection and
//! residual, RMSNorm, gate/up, `silu(gate) * up`, down and residual; then the final norm of the
//! rows wanted, and the head for their logits ([`Out::Logits`]) or nothing more, for their hidden
//! states ([`Out::Hidden`], what an embedding pools).
//!
//! Gemma, Phi-3 and Mistral are this model with switches ([`Shape`], [`Layer`]): scaled
//! embedding, GeGLU, norms after attention and MLP, score scale and soft-caps, sliding-window
//! layers (each row's entry cut to the window's last cells) and a rope table per layer kind.
//!
//! Why: through torch, a decode step of the default model is ~30 layers × ~15 ops, each a
//! dispatch, an allocation and (for the block matmuls) a crossing into this crate; at one row
//! that overhead is as large as the arithmetic. Here Python hands over the step once, every
//! buffer lives in a [`Workspace`] that only grows, and the matmuls and the attention run on the
//! crate's one thread team (`threads.rs`) while the elementwise work stays on the caller.
//!
//! Row invariance (exact mode): every op is computed row by row (the matmuls, as the crate doc
//! says; norm, rope, silu and the stores elementwise or per row), and each row's attention is an
//! entry of its own over its sequence's cells up to its position, so a prompt row gets the bits it
//! would get as a decode row, and no row's bits depend on the others, the split or the threads.

mod embed;
mod gelu;
mod kv;
mod layer;
mod moe;
mod silu;

use crate::attention::Scores;
use crate::int8::I8Scratch;
use crate::norm::rms_norm;
use crate::shape::ShapeError;
use crate::weights::Weights;
pub use kv::{bf16_bits, f16_bits, KvCells};
pub use moe::{Expert, Moe};

/// The model's sizes.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub eps: f32,
    /// the gate's activation in the MLP
    pub act: Act,
    /// every embedding row times this (Gemma: sqrt(hidden)); 1 leaves the rows as they are
    pub embed_scale: f32,
    /// how attention scores are made (scale, Gemma 2's soft-cap)
    pub scores: Scores,
    /// logits -> `c * tanh(logits / c)` (Gemma 2's final soft-cap)
    pub final_softcap: Option<f32>,
    /// cells a sliding layer's row attends to, its own included (0: no layer slides)
    pub window: usize,
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// `silu(gate) * up` (SwiGLU: Llama, Qwen, Phi-3)
    Silu,
    /// `gelu_tanh(gate) * up` (GeGLU: Gemma)
    GeluTanh,
}

impl Shape {
    pub(crate) fn qkv(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// One transformer layer's weights (Hugging Face's layout, Q/K/V and gate/up fused by rows).
/// A fused matrix is its parts' rows in order: one part where they are of one kind, several
/// where they are not (a Q4_K_M file's Q4_K attn_q and attn_k beside its Q6_K attn_v), each
/// multiplied in its own kind into its columns of the output.
#[derive(Clone, Copy)]
pub struct Layer<'a> {
    pub attn_norm: &'a [f32],
    pub qkv: &'a [Weights<'a>],
    pub qkv_bias: Option<&'a [f32]>,
    /// Qwen3's per-head norms of q and k, before rope.
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    pub o: Weights<'a>,
    pub o_bias: Option<&'a [f32]>,
    pub mlp_norm: &'a [f32],
    pub mlp: Mlp<'a>,
    /// Gemma's norms of the attention's and the MLP's outputs, before each residual add.
    pub post_attn_norm: Option<&'a [f32]>,
    pub post_mlp_norm: Option<&'a [f32]>,
    /// whether this layer attends over [`Shape::window`] cells only
    pub sliding: bool,
    /// which of [`Model::ropes`] this layer turns with
    pub rope: usize,
}

/// A layer's MLP: dense (gate/up fused by rows, as parts; down), or a mixture of experts.
#[derive(Clone, Copy)]
pub enum Mlp<'a> {
    Dense {
        gate_up: &'a [Weights<'a>],
        down: Weights<'a>,
    },
    Experts(Moe<'a>),
}

/// A rope table: `[positions, head_dim / 2]` each, cos and sin by position.
#[derive(Clone, Copy)]
pub struct Rope<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// How the products multiply the blocks, and whether BF16 matrices take bf16 activations.
/// Other dense matrices ignore it: int8 activations are defined only against blocks, so their
/// products always take f32 rows ([`crate::dense`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dot {
    /// f32 activations times each block expanded to f32 ([`crate::matmul_q4`]), and times
    /// every dense matrix.
    F32,
    /// activations rounded to int8 per block, integer dot products ([`crate::int8`]).
    Int8,
    /// [`Dot::Int8`], and activations rounded to bf16 against BF16 matrices of whole chunks
    /// ([`crate::dense::bf16_pairs`]).
    Int8Bf16,
}

impl Dot {
    /// Whether block products take int8 activations.
    pub fn int8_blocks(self) -> bool {
        matches!(self, Dot::Int8 | Dot::Int8Bf16)
    }
}

/// The whole model.
pub struct Model<'a> {
    pub shape: Shape,
    pub dot: Dot,
    /// `[vocab, hidden]`: the token embedding (a tied head's), dense or in blocks, looked up row
    /// by row.
    pub embed: Weights<'a>,
    pub layers: Vec<Layer<'a>>,
    pub norm: &'a [f32],
    pub head: Weights<'a>,
    /// the rope tables, all of one size: the global one, and the sliding layers' (Gemma 3)
    pub ropes: Vec<Rope<'a>>,
}

/// One step's rows, as the scheduler's plan gives them: items (a sequence's consecutive rows,
/// a prompt chunk or one decode token), each with its page table.
pub struct Step<'a> {
    /// `[rows]`: the token of each row, its position in its sequence and the cell it writes.
    pub tokens: &'a [i64],
    pub positions: &'a [i64],
    pub slots: &'a [i64],
    /// `[items]`: rows of each item, in row order.
    pub item_rows: &'a [usize],
    /// each item's pages; cell `c` of a sequence is `table[c / page_size] * page_size + c % ps`.
    pub page_tables: &'a [Vec<i64>],
    /// The sliding layers' own cell space, where they keep theirs apart from the global
    /// layers' (a model mixing the two, as Gemma's): each row's cell and each item's pages
    /// there (pages behind the window `-1`). Both empty: the sliding layers share `slots` and
    /// `page_tables`.
    pub window_slots: &'a [i64],
    pub window_tables: &'a [Vec<i64>],
    pub page_size: usize,
    /// rows whose output ([`Out`]) is computed, in the order of the output.
    pub out_rows: &'a [i64],
}

/// What a step writes for its [`Step::out_rows`].
pub enum Out<'a> {
    /// `[out rows, vocab]`: their logits.
    Logits(&'a mut [f32]),
    /// `[out rows, hidden]`: their hidden states after the final norm, the head's input.
    Hidden(&'a mut [f32]),
}

/// Buffers a step needs, kept between steps (they only grow).
#[derive(Default)]
pub struct Workspace {
    pub(crate) x: Vec<f32>,
    pub(crate) h: Vec<f32>,
    pub(crate) qkv: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) att: Vec<f32>,
    pub(crate) proj: Vec<f32>,
    /// the MLP's and the mixture's buffers
    pub(crate) mlp: layer::MlpBufs,
    pub(crate) moe: moe::MoeBufs,
    /// every row's attention entry over its whole context, and over its window's cells
    pub(crate) full: Entries,
    pub(crate) windowed: Entries,
    pub(crate) i8: I8Scratch,
}

/// One attention entry per row (`attention::DecodeAttention`'s cells, stride, context, rows).
#[derive(Default)]
pub(crate) struct Entries {
    pub(crate) cells: Vec<i64>,
    pub(crate) context: Vec<i64>,
    pub(crate) rows: Vec<i64>,
    pub(crate) stride: usize,
}

/// Sets `buf` to `len` values, reusing its memory.
pub(crate) fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

fn bad(msg: String) -> ShapeError {
    ShapeError(msg)
}

impl Step<'_> {
    fn check(&self, shape: &Shape, positions: usize) -> Result<usize, ShapeError> {
        let t = self.tokens.len();
        if t == 0 || self.positions.len() != t || self.slots.len() != t {
            return Err(bad(format!(
                "{t} tokens, {} positions, {} slots",
                self.positions.len(),
                self.slots.len()
            )));
        }
        if self.item_rows.iter().sum::<usize>() != t
            || self.page_tables.len() != self.item_rows.len()
        {
            return Err(bad(format!("items do not cover the step's {t} rows")));
        }
        if let Some(tok) = self
            .tokens
            .iter()
            .find(|&&v| v < 0 || v as usize >= shape.vocab)
        {
            return Err(bad(format!(
                "token {tok} is outside the vocabulary of {}",
                shape.vocab
            )));
        }
        if let Some(p) = self
            .positions
            .iter()
            .find(|&&p| p < 0 || p as usize >= positions)
        {
            return Err(bad(format!(
                "position {p} is beyond the rope table ({positions})"
            )));
        }
        if self.out_rows.iter().any(|&r| r < 0 || r as usize >= t) {
            return Err(bad(format!("an output row is outside the step's {t} rows")));
        }
        if self.page_size == 0 {
            return Err(bad("page size 0".into()));
        }
        if !(self.window_slots.is_empty() && self.window_tables.is_empty())
            && (self.window_slots.len() != t || self.window_tables.len() != self.item_rows.len())
        {
            return Err(bad(format!(
                "{} window slots and {} window page tables for {t} rows",
                self.window_slots.len(),
                self.window_tables.len()
            )));
        }
        Ok(t)
    }

    /// Whether the sliding layers keep their cells in a space of their own.
    pub(crate) fn split(&self) -> bool {
        !self.window_slots.is_empty()
    }

    /// The cells a layer writes each row's K and V at: the window space's for a sliding layer
    /// of a split step.
    pub(crate) fn slots_of(&self, sliding: bool) -> &[i64] {
        if sliding && self.split() {
            self.window_slots
        } else {
            self.slots
        }
    }

    /// Every row as an attention entry of its own: its sequence's cells up to its position, the
    /// last `window` of them where `window` is not 0 (read through `tables`).
    fn entries(
        &self,
        window: usize,
        tables: &[Vec<i64>],
        e: &mut Entries,
    ) -> Result<(), ShapeError> {
        let ps = self.page_size;
        let first = |p: usize| {
            if window == 0 {
                0
            } else {
                (p + 1).saturating_sub(window)
            }
        };
        let stride = self
            .positions
            .iter()
            .map(|&p| p as usize + 1 - first(p as usize))
            .max()
            .unwrap_or(1);
        e.stride = stride;
        e.cells.clear();
        e.context.clear();
        e.rows.clear();
        let mut row = 0;
        for (n, table) in self.item_rows.iter().zip(tables) {
            for r in row..row + n {
                let end = self.positions[r] as usize + 1;
                if end.div_ceil(ps) > table.len() {
                    return Err(bad(format!(
                        "row {r} at position {} runs past its {} pages",
                        end - 1,
                        table.len()
                    )));
                }
                let start = first(end - 1);
                e.cells
                    .extend((start..end).map(|c| table[c / ps] * ps as i64 + (c % ps) as i64));
                e.cells.resize(e.cells.len() + stride - (end - start), 0);
                e.context.push((end - start) as i64);
                e.rows.push(r as i64);
            }
            row += n;
        }
        Ok(())
    }
}

/// Runs `step` through `model`, writing K and V into `kv` (`[layer] = (k, v)`) and the output
/// of `step.out_rows` into `out`. The rows' bits do not depend on which output is asked for:
/// the logits are the head's product of exactly the hidden states [`Out::Hidden`] gets.
pub fn forward(
    model: &Model<'_>,
    kv: &mut [(KvCells<'_>, KvCells<'_>)],
    step: &Step<'_>,
    ws: &mut Workspace,
    out: Out<'_>,
) -> Result<(), ShapeError> {
    let s = model.shape;
    let half = s.head_dim / 2;
    let rope_len = model.ropes.first().map_or(0, |r| r.cos.len());
    if !s.head_dim.is_multiple_of(2)
        || half == 0
        || rope_len == 0
        || !rope_len.is_multiple_of(half)
        || model
            .ropes
            .iter()
            .any(|r| r.cos.len() != rope_len || r.sin.len() != rope_len)
    {
        return Err(bad(format!(
            "rope tables do not fit a head of {}",
            s.head_dim
        )));
    }
    if let Some((i, l)) = model
        .layers
        .iter()
        .enumerate()
        .find(|(_, l)| l.rope >= model.ropes.len() || (l.sliding && s.window == 0))
    {
        return Err(bad(format!(
            "layer {i} names rope table {} of {} or slides without a window",
            l.rope,
            model.ropes.len()
        )));
    }
    let t = step.check(&s, rope_len / half)?;
    if model.embed.n() != s.vocab || model.embed.k() != s.hidden {
        return Err(bad(format!(
            "an embedding of [{}, {}]",
            model.embed.n(),
            model.embed.k()
        )));
    }
    if kv.len() != model.layers.len() {
        return Err(bad(format!(
            "{} layers but {} K/V pairs",
            model.layers.len(),
            kv.len()
        )));
    }
    let (what, got, per_row) = match &out {
        Out::Logits(o) => ("logits", o.len(), s.vocab),
        Out::Hidden(o) => ("hidden states", o.len(), s.hidden),
    };
    if got != step.out_rows.len() * per_row {
        return Err(bad(format!(
            "{what} hold {got} values, not {} rows of {per_row}",
            step.out_rows.len(),
        )));
    }
    // a model whose every layer slides never reads its whole context: the pages behind the
    // window may have left the pool (their page table entries are then -1)
    if model.layers.iter().any(|l| !l.sliding) {
        step.entries(0, step.page_tables, &mut ws.full)?;
    }
    if model.layers.iter().any(|l| l.sliding) {
        let tables = if step.split() {
            step.window_tables
        } else {
            step.page_tables
        };
        step.entries(s.window, tables, &mut ws.windowed)?;
    }
    let mut x = std::mem::take(&mut ws.x);
    let xs = sized(&mut x, t * s.hidden);
    for (row, &tok) in xs.chunks_exact_mut(s.hidden).zip(step.tokens) {
        embed::embed_row(model.embed, tok as usize, row);
        if s.embed_scale != 1.0 {
            row.iter_mut().for_each(|v| *v *= s.embed_scale);
        }
    }
    let result = (|| {
        for (layer, (k, v)) in model.layers.iter().zip(kv.iter_mut()) {
            layer::run(model, layer, k, v, step, xs, ws)?;
        }
        // the norm is row-wise: pick the wanted rows first
        let n = step.out_rows.len();
        let picked = sized(&mut ws.proj, n * s.hidden);
        for (i, &r) in step.out_rows.iter().enumerate() {
            let r = r as usize;
            picked[i * s.hidden..(i + 1) * s.hidden]
                .copy_from_slice(&xs[r * s.hidden..(r + 1) * s.hidden]);
        }
        match out {
            Out::Hidden(hidden) => rms_norm(picked, model.norm, s.eps, hidden),
            Out::Logits(logits) => {
                let normed = sized(&mut ws.h, n * s.hidden);
                rms_norm(picked, model.norm, s.eps, normed)?;
                layer::matmul(model.dot, normed, n, model.head, logits, &mut ws.i8)?;
                if let Some(cap) = s.final_softcap {
                    logits.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
                }
                Ok(())
            }
        }
    })();
    ws.x = x;
    result
}
