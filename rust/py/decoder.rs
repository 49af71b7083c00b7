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
    self, Act, Dot, KvCells, Layer, Model, Out, Rope, Shape, Step, Workspace,
};
use kvpark_cpu_ops::{
    DenseValues, DenseWeights, Q4Weights, Q6Weights, Q8Weights, Scores, Weights, BLOCK, Q6_GROUP,
};

use super::errors::cpu_ops_err;

/// A matrix `[n, k]`: kind '4' (qs [n, k/2] u8, scale and offset [n, k/32] f32), '8' (qs [n, k]
/// i8, scale [n, k/32] f32, offset 0 for none or [n, k/32] f32) or '6' (Q6_K unpacked: qs [n, k]
/// i8, scale [n, k/16] f32, offset 0) in blocks; or dense,
/// `qs` the address of its [n, k] values and `scale`, `offset` 0: 'f' (f32), 'h' (f16 bits) or
/// 'b' (bf16 bits). Dense products take f32 activations whatever the block dot.
#[derive(FromPyObject, Clone, Copy)]
#[pyo3(from_item_all)]
struct Matrix {
    kind: char,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    k: usize,
}

/// One layer: addresses of f32 vectors (0 where the model has none) and its matrices; a fused
/// one (qkv, gate_up) as its parts, rows in order (one part, or several of different kinds).
#[derive(FromPyObject, Clone)]
#[pyo3(from_item_all)]
struct LayerSpec {
    attn_norm: usize,
    qkv: Vec<Matrix>,
    qkv_bias: usize,
    q_norm: usize,
    k_norm: usize,
    o: Matrix,
    o_bias: usize,
    mlp_norm: usize,
    gate_up: Vec<Matrix>,
    down: Matrix,
    k_cells: usize,
    v_cells: usize,
    post_attn_norm: usize,
    post_mlp_norm: usize,
    sliding: bool,
    rope: usize,
}

/// The architecture's switches (kvpark_cpu_ops::decoder::Shape): `act` 's' (silu) or 'g' (gelu_tanh);
/// soft-caps 0 for none; `window` 0 where no layer slides.
#[derive(FromPyObject, Clone, Copy)]
#[pyo3(from_item_all)]
struct Features {
    act: char,
    embed_scale: f32,
    attn_scale: f32,
    attn_softcap: f32,
    final_softcap: f32,
    window: usize,
}

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
    kv_dtype: KvDtype,
    dot: Dot,
    workspace: Mutex<Workspace>,
}

/// # Safety
/// `at` holds `len` live values of `T` (0 only with `len` 0 is never passed here).
unsafe fn slice<'a, T>(at: usize, len: usize) -> &'a [T] {
    std::slice::from_raw_parts(at as *const T, len)
}

/// # Safety
/// As for [`slice`]; 0 means none.
unsafe fn maybe<'a>(at: usize, len: usize) -> Option<&'a [f32]> {
    (at != 0).then(|| slice(at, len))
}

/// # Safety
/// The matrix's tensors are live, of the sizes its kind and shape say.
unsafe fn weights<'a>(m: &Matrix) -> Weights<'a> {
    let blocks = m.n * m.k / BLOCK;
    let dense = |values| {
        Weights::Dense(DenseWeights {
            values,
            n: m.n,
            k: m.k,
        })
    };
    match m.kind {
        'f' => dense(DenseValues::F32(slice(m.qs, m.n * m.k))),
        'h' => dense(DenseValues::F16(slice(m.qs, m.n * m.k))),
        'b' => dense(DenseValues::Bf16(slice(m.qs, m.n * m.k))),
        '4' => Weights::Q4(Q4Weights {
            qs: slice(m.qs, m.n * m.k / 2),
            scale: slice(m.scale, blocks),
            offset: slice(m.offset, blocks),
            n: m.n,
            k: m.k,
        }),
        '6' => Weights::Q6(Q6Weights {
            qs: slice(m.qs, m.n * m.k),
            scale: slice(m.scale, m.n * m.k / Q6_GROUP),
            n: m.n,
            k: m.k,
        }),
        _ => Weights::Q8(Q8Weights {
            qs: slice(m.qs, m.n * m.k),
            scale: slice(m.scale, blocks),
            offset: maybe(m.offset, blocks),
            n: m.n,
            k: m.k,
        }),
    }
}

fn check_matrix(name: &str, m: &Matrix, n: usize, k: usize) -> PyResult<()> {
    let dense = matches!(m.kind, 'f' | 'h' | 'b');
    let fits = m.n == n && m.k == k && k > 0 && m.qs != 0;
    let kind = if dense {
        m.scale == 0 && m.offset == 0
    } else {
        let offset = match m.kind {
            '4' => m.offset != 0,
            '6' => m.offset == 0,
            _ => m.kind == '8',
        };
        k % BLOCK == 0 && m.scale != 0 && offset
    };
    if !fits || !kind {
        return Err(PyValueError::new_err(format!(
            "{name}: a kind {:?} [{}, {}] matrix where [{n}, {k}] is wanted",
            m.kind, m.n, m.k
        )));
    }
    Ok(())
}

/// A fused matrix's parts: each of `k` columns, `n` rows in all.
fn check_parts(name: &str, parts: &[Matrix], n: usize, k: usize) -> PyResult<()> {
    if parts.is_empty() || parts.iter().map(|m| m.n).sum::<usize>() != n {
        return Err(PyValueError::new_err(format!(
            "{name}: parts of {:?} rows where {n} are wanted",
            parts.iter().map(|m| m.n).collect::<Vec<_>>()
        )));
    }
    for (j, m) in parts.iter().enumerate() {
        check_matrix(&format!("{name} part {j}"), m, m.n, k)?;
    }
    Ok(())
}

#[pymethods]
impl PyCpuDecoder {
    /// `shape`: (hidden, heads, kv_heads, head_dim, intermediate, vocab); `kv_values`: values in
    /// each layer's K (and V) pool; `kv_dtype`: "float32", "bfloat16" or "float16"; `rope_values`: values
    /// in each cos and sin table of `ropes` ((cos, sin) addresses, [positions, head_dim / 2]
    /// each); `dot`: "int8" or "float32" (kvpark_cpu_ops::decoder::Dot); `features`: the
    /// architecture's switches ([`Features`]: act 's' silu or 'g' gelu_tanh).
    #[new]
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
            other => return Err(PyValueError::new_err(format!("block dot {other:?}"))),
        };
        let qkv = (heads + 2 * kv_heads) * head_dim;
        check_matrix("head", &head, vocab, hidden)?;
        check_matrix("embedding", &embed, vocab, hidden)?;
        for (i, l) in layers.iter().enumerate() {
            check_parts(&format!("layer {i} qkv"), &l.qkv, qkv, hidden)?;
            check_matrix(&format!("layer {i} o"), &l.o, hidden, heads * head_dim)?;
            check_parts(
                &format!("layer {i} gate_up"),
                &l.gate_up,
                2 * intermediate,
                hidden,
            )?;
            check_matrix(&format!("layer {i} down"), &l.down, hidden, intermediate)?;
            if l.attn_norm == 0 || l.mlp_norm == 0 || l.k_cells == 0 || l.v_cells == 0 {
                return Err(PyValueError::new_err(format!(
                    "layer {i} lacks a norm or its K/V"
                )));
            }
        }
        Ok(Self {
            shape,
            embed,
            norm,
            head,
            ropes,
            rope_values,
            layers,
            kv_values,
            kv_dtype,
            dot,
            workspace: Mutex::new(Workspace::default()),
        })
    }

    /// Runs one step (see kvpark_cpu_ops::decoder::Step) and writes the logits of `logit_rows`
    /// into the f32 `[len(logit_rows), vocab]` buffer at `logits`.
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
    ) -> PyResult<()> {
        let step = Step {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            item_rows: &item_rows,
            page_tables: &page_tables,
            page_size,
            out_rows: &logit_rows,
        };
        self.run(py, &step, logits, self.shape.vocab, Out::Logits)
    }

    /// As `step`, but writes the hidden states of `rows` after the model's final norm (the
    /// head's input) into the f32 `[len(rows), hidden]` buffer at `out`.
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
    ) -> PyResult<()> {
        let step = Step {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            item_rows: &item_rows,
            page_tables: &page_tables,
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
        // SAFETY: as below: the parts' tensors are live and of their checked sizes.
        let fused: Vec<(Vec<Weights<'_>>, Vec<Weights<'_>>)> = unsafe {
            self.layers
                .iter()
                .map(|l| {
                    let parts = |ms: &[Matrix]| ms.iter().map(|m| weights(m)).collect();
                    (parts(&l.qkv), parts(&l.gate_up))
                })
                .collect()
        };
        let (model, mut kv, out) = unsafe {
            let layers = self
                .layers
                .iter()
                .zip(&fused)
                .map(|(l, (qkv, gate_up))| Layer {
                    attn_norm: slice(l.attn_norm, s.hidden),
                    qkv,
                    qkv_bias: maybe(l.qkv_bias, qkv.iter().map(|w| w.n()).sum()),
                    q_norm: maybe(l.q_norm, d),
                    k_norm: maybe(l.k_norm, d),
                    o: weights(&l.o),
                    o_bias: maybe(l.o_bias, s.hidden),
                    mlp_norm: slice(l.mlp_norm, s.hidden),
                    gate_up,
                    down: weights(&l.down),
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
            let n = self.kv_values;
            let cells = |at: usize| -> KvCells<'_> {
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
                .map(|l| (cells(l.k_cells), cells(l.v_cells)))
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
