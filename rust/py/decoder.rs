//! `_CpuDecoder`: a whole CPU decode step in one call (kvpark_cpu_ops::decoder), ending in the
//! logits of the rows asked for (`step`) or in their final-norm hidden states (`hidden`).
//!
//! Built once by kvpark.runner.cpu_decoder from the addresses of the model's tensors and the
//! KV pool's; that runner keeps every tensor alive and in place for the decoder's lifetime and
//! checks each one's dtype, size and contiguity before it hands the address over.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use kvpark_cpu_ops::decoder::{
    self, Act, Dot, Expert, KvCells, Layer, Mlp, Model, Moe, Out, Rope, Shape, Step, Workspace,
};
use kvpark_cpu_ops::Scores;

use super::decoder_specs::{
    check_matrix, check_parts, find_lows, layer_parts, maybe, slice, weights, Features, LayerParts,
    LayerSpec, Matrix,
};
use super::errors::cpu_ops_err;

#[derive(Clone, Copy)]
enum KvDtype {
    F32,
    Bf16,
    F16,
}

#[pyclass(name = "_CpuDecoder", module = "kvpark._core", frozen)]
pub(super) struct PyCpuDecoder {
    shape: Shape,
    embed: Matrix,
    norm: usize,
    head: Matrix,
    ropes: Vec<(usize, usize)>,
    rope_values: usize,
    layers: Vec<LayerSpec>,
    kv_values: usize,
    /// values in a sliding layer's K (and V) pool where the sliding layers keep their own
    /// cell space (the window's), else `kv_values`
    window_kv_values: usize,
    kv_dtype: KvDtype,
    dot: Dot,
    workspace: Mutex<Workspace>,
}

#[pymethods]
impl PyCpuDecoder {
    /// `shape`: (hidden, heads, kv_heads, head_dim, intermediate, vocab); `kv_values`: values in
    /// each layer's K (and V) pool; `kv_dtype`: "float32", "bfloat16" or "float16"; `rope_values`: values
    /// in each cos and sin table of `ropes` ((cos, sin) addresses, [positions, head_dim / 2]
    /// each); `dot`: "int8", "int8+bf16" or "float32" (kvpark_cpu_ops::decoder::Dot); `features`: the
    /// architecture's switches ([`Features`]: act 's' silu or 'g' gelu_tanh);
    /// `window_kv_values`: values in each sliding layer's K (and V) pool when the sliding
    /// layers keep a cell space of their own (0: `kv_values`, they share the cells).
    #[new]
    #[pyo3(signature = (shape, eps, embed, norm, head, ropes, rope_values, layers, kv_values, kv_dtype, dot, features, window_kv_values = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        shape: (usize, usize, usize, usize, usize, usize),
        eps: f32,
        embed: Matrix,
        norm: usize,
        head: Matrix,
        ropes: Vec<(usize, usize)>,
        rope_values: usize,
        layers: Vec<LayerSpec>,
        kv_values: usize,
        kv_dtype: &str,
        dot: &str,
        features: Features,
        window_kv_values: usize,
    ) -> PyResult<Self> {
        let (hidden, heads, kv_heads, head_dim, intermediate, vocab) = shape;
        let cap = |c: f32| (c > 0.0).then_some(c);
        let act = match features.act {
            's' => Act::Silu,
            'g' => Act::GeluTanh,
            other => return Err(PyValueError::new_err(format!("activation {other:?}"))),
        };
        let shape = Shape {
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            vocab,
            eps,
            act,
            embed_scale: features.embed_scale,
            scores: Scores {
                scale: features.attn_scale,
                softcap: cap(features.attn_softcap),
            },
            final_softcap: cap(features.final_softcap),
            window: features.window,
        };
        if ropes.is_empty() || ropes.iter().any(|&(c, s)| c == 0 || s == 0) {
            return Err(PyValueError::new_err(
                "no rope table, or one without values",
            ));
        }
        if let Some(i) = layers
            .iter()
            .position(|l| l.rope >= ropes.len() || (l.sliding && features.window == 0))
        {
            return Err(PyValueError::new_err(format!(
                "layer {i} names a rope table it lacks or slides without a window"
            )));
        }
        let kv_dtype = match kv_dtype {
            "float32" => KvDtype::F32,
            "bfloat16" => KvDtype::Bf16,
            "float16" => KvDtype::F16,
            other => return Err(PyValueError::new_err(format!("a {other} KV pool"))),
        };
        let dot = match dot {
            "float32" => Dot::F32,
            "int8" => Dot::Int8,
            "int8+bf16" => Dot::Int8Bf16,
            other => return Err(PyValueError::new_err(format!("block dot {other:?}"))),
        };
        let qkv = (heads + 2 * kv_heads) * head_dim;
        check_matrix("head", &head, vocab, hidden)?;
        check_matrix("embedding", &embed, vocab, hidden)?;
        for (i, l) in layers.iter().enumerate() {
            check_parts(&format!("layer {i} qkv"), &l.qkv, qkv, hidden)?;
            check_matrix(&format!("layer {i} o"), &l.o, hidden, heads * head_dim)?;
            match (&l.router, &l.down) {
                (None, Some(down)) => {
                    check_parts(
                        &format!("layer {i} gate_up"),
                        &l.gate_up,
                        2 * intermediate,
                        hidden,
                    )?;
                    check_matrix(&format!("layer {i} down"), down, hidden, intermediate)?;
                }
                (Some(router), None) => {
                    let n = l.experts.len();
                    check_matrix(&format!("layer {i} router"), router, n, hidden)?;
                    if l.top_k == 0 || l.top_k > n {
                        return Err(PyValueError::new_err(format!(
                            "layer {i}: {} experts a row of {n}",
                            l.top_k
                        )));
                    }
                    for (e, x) in l.experts.iter().enumerate() {
                        let w = x.down.k;
                        check_parts(
                            &format!("layer {i} expert {e} gate_up"),
                            &x.gate_up,
                            2 * w,
                            hidden,
                        )?;
                        check_matrix(&format!("layer {i} expert {e} down"), &x.down, hidden, w)?;
                    }
                }
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "layer {i}: a dense MLP or a router, one of them"
                    )))
                }
            }
            if l.attn_norm == 0 || l.mlp_norm == 0 || l.k_cells == 0 || l.v_cells == 0 {
                return Err(PyValueError::new_err(format!(
                    "layer {i} lacks a norm or its K/V"
                )));
            }
        }
        let (mut head, mut layers) = (head, layers);
        // SAFETY: the checks above held: every matrix's tensors are live, of its kind's sizes.
        unsafe { find_lows(&mut head, &mut layers) };
        Ok(Self {
            shape,
            embed,
            norm,
            head,
            ropes,
            rope_values,
            layers,
            kv_values,
            window_kv_values: if window_kv_values == 0 {
                kv_values
            } else {
                window_kv_values
            },
            kv_dtype,
            dot,
            workspace: Mutex::new(Workspace::default()),
        })
    }

    /// Runs one step (see kvpark_cpu_ops::decoder::Step) and writes the logits of `logit_rows`
    /// into the f32 `[len(logit_rows), vocab]` buffer at `logits`; `window_slots` and
    /// `window_tables`: the sliding layers' own cells (Step), empty where they share them.
    #[pyo3(signature = (tokens, positions, slots, item_rows, page_tables, page_size, logit_rows, logits, window_slots = Vec::new(), window_tables = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        py: Python<'_>,
        tokens: Vec<i64>,
        positions: Vec<i64>,
        slots: Vec<i64>,
        item_rows: Vec<usize>,
        page_tables: Vec<Vec<i64>>,
        page_size: usize,
        logit_rows: Vec<i64>,
        logits: usize,
        window_slots: Vec<i64>,
        window_tables: Vec<Vec<i64>>,
    ) -> PyResult<()> {
        let step = Step {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            item_rows: &item_rows,
            page_tables: &page_tables,
            window_slots: &window_slots,
            window_tables: &window_tables,
            page_size,
            out_rows: &logit_rows,
        };
        self.run(py, &step, logits, self.shape.vocab, Out::Logits)
    }

    /// As `step`, but writes the hidden states of `rows` after the model's final norm (the
    /// head's input) into the f32 `[len(rows), hidden]` buffer at `out`.
    #[pyo3(signature = (tokens, positions, slots, item_rows, page_tables, page_size, rows, out, window_slots = Vec::new(), window_tables = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn hidden(
        &self,
        py: Python<'_>,
        tokens: Vec<i64>,
        positions: Vec<i64>,
        slots: Vec<i64>,
        item_rows: Vec<usize>,
        page_tables: Vec<Vec<i64>>,
        page_size: usize,
        rows: Vec<i64>,
        out: usize,
        window_slots: Vec<i64>,
        window_tables: Vec<Vec<i64>>,
    ) -> PyResult<()> {
        let step = Step {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            item_rows: &item_rows,
            page_tables: &page_tables,
            window_slots: &window_slots,
            window_tables: &window_tables,
            page_size,
            out_rows: &rows,
        };
        self.run(py, &step, out, self.shape.hidden, Out::Hidden)
    }
}

impl PyCpuDecoder {
    /// Runs `step` through the model behind the addresses, its output (`wrap`: which one, of
    /// `per_row` values a row) into the f32 `[out rows, per_row]` buffer at `out`.
    fn run<'o>(
        &self,
        py: Python<'_>,
        step: &Step<'_>,
        out: usize,
        per_row: usize,
        wrap: fn(&'o mut [f32]) -> Out<'o>,
    ) -> PyResult<()> {
        let s = self.shape;
        let d = s.head_dim;
        // SAFETY: the runner keeps every tensor behind these addresses alive and unmoved, with
        // the sizes checked in `new` and by the runner (module doc); `out` is a fresh buffer
        // of exactly this size, and nothing else touches the K/V pools during a step.
        let fused: Vec<LayerParts<'_>> = self
            .layers
            .iter()
            .map(|l| unsafe { layer_parts(l) })
            .collect();
        let experts: Vec<Vec<Expert<'_>>> = fused
            .iter()
            .map(|p| {
                p.expert_gate_up
                    .iter()
                    .zip(&p.expert_down)
                    .map(|(gate_up, &down)| Expert { gate_up, down })
                    .collect()
            })
            .collect();
        let (model, mut kv, out) = unsafe {
            let layers = self
                .layers
                .iter()
                .zip(&fused)
                .zip(&experts)
                .map(|((l, p), experts)| Layer {
                    attn_norm: slice(l.attn_norm, s.hidden),
                    qkv: &p.qkv,
                    qkv_bias: maybe(l.qkv_bias, p.qkv.iter().map(|w| w.n()).sum()),
                    q_norm: maybe(l.q_norm, d),
                    k_norm: maybe(l.k_norm, d),
                    o: weights(&l.o),
                    o_bias: maybe(l.o_bias, s.hidden),
                    mlp_norm: slice(l.mlp_norm, s.hidden),
                    mlp: match (p.router, p.down) {
                        (Some(router), _) => Mlp::Experts(Moe {
                            router,
                            experts,
                            top_k: l.top_k,
                            norm_topk: l.norm_topk,
                        }),
                        (None, down) => Mlp::Dense {
                            gate_up: &p.gate_up,
                            down: down.expect("checked in new: a dense MLP has its down"),
                        },
                    },
                    post_attn_norm: maybe(l.post_attn_norm, s.hidden),
                    post_mlp_norm: maybe(l.post_mlp_norm, s.hidden),
                    sliding: l.sliding,
                    rope: l.rope,
                })
                .collect();
            let model = Model {
                shape: s,
                dot: self.dot,
                embed: weights(&self.embed),
                layers,
                norm: slice(self.norm, s.hidden),
                head: weights(&self.head),
                ropes: self
                    .ropes
                    .iter()
                    .map(|&(cos, sin)| Rope {
                        cos: slice(cos, self.rope_values),
                        sin: slice(sin, self.rope_values),
                    })
                    .collect(),
            };
            let cells = |at: usize, n: usize| -> KvCells<'_> {
                match self.kv_dtype {
                    KvDtype::F32 => KvCells::F32(std::slice::from_raw_parts_mut(at as *mut f32, n)),
                    KvDtype::Bf16 => {
                        KvCells::Bf16(std::slice::from_raw_parts_mut(at as *mut u16, n))
                    }
                    KvDtype::F16 => KvCells::F16(std::slice::from_raw_parts_mut(at as *mut u16, n)),
                }
            };
            let kv: Vec<_> = self
                .layers
                .iter()
                .map(|l| {
                    let n = if l.sliding {
                        self.window_kv_values
                    } else {
                        self.kv_values
                    };
                    (cells(l.k_cells, n), cells(l.v_cells, n))
                })
                .collect();
            let out =
                std::slice::from_raw_parts_mut(out as *mut f32, step.out_rows.len() * per_row);
            (model, kv, out)
        };
        let out = wrap(out);
        py.detach(|| {
            let mut ws = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
            decoder::forward(&model, &mut kv, step, &mut ws, out)
        })
        .map_err(cpu_ops_err)
    }
}
