//! The plain values `_CpuDecoder` is built from (a matrix's addresses, a layer's, an expert's,
//! the architecture's switches), their checks, and the step-time views over them
//! (kvpark_cpu_ops::decoder's weights): what decoder.rs wraps.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use kvpark_cpu_ops::{
    narrow_low, DenseValues, DenseWeights, Iq4Weights, Q4Weights, Q6Weights, Q8Packing, Q8Weights,
    Weights, BLOCK, Q6_GROUP,
};

/// A matrix `[n, k]`: kind '4' (qs [n, k/2] u8, scale and offset [n, k/32] f32), '8' (qs [n, k]
/// i8, scale [n, k/32] f32, offset 0 for none or [n, k/32] f32), '6' (Q6_K unpacked: qs [n, k]
/// i8, scale [n, k/16] f32, offset 0) or 'i' (IQ4: qs [n, k/2] u8 nibbles into the IQ4 table,
/// scale [n, k/32] f32, offset 0) in blocks, 'p' and 'P' ('4' and '6' packed at load:
/// kvpark_cpu_ops::packed, '6' compact), 'Q' (Q5_K's '8' with offsets packed compact:
/// kvpark_cpu_ops::packed_q5, `scale` and `offset` its `d` and `dmin`), 'B' (Q5_0's or Q5_1's
/// '8' packed compact: kvpark_cpu_ops::packed_q5_blocks, its quants stored less -16 without
/// offsets, less 0 with them); or dense,
/// `qs` the address of its [n, k] values and `scale`, `offset` 0: 'f' (f32), 'h' (f16 bits) or
/// 'b' (bf16 bits). Dense products take f32 activations whatever the block dot.
#[derive(FromPyObject, Clone, Copy)]
#[pyo3(from_item_all)]
pub(super) struct Matrix {
    pub(super) kind: char,
    pub(super) qs: usize,
    pub(super) scale: usize,
    pub(super) offset: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    /// Kinds '8' and '6': `Q8Weights::low`, `Q6Weights::low`, found once when the decoder is
    /// built ([`Matrix::find_low`]).
    #[pyo3(default)]
    pub(super) low: Option<i8>,
}

impl Matrix {
    /// Sets `low` for a q8 matrix whose quants span fewer than 32 values (Q5_0, Q5_1), a q6 one
    /// whose span fewer than 64 (Q6_K, Q3_K).
    ///
    /// # Safety
    /// The matrix's tensors are live, of the sizes its kind and shape say.
    pub(super) unsafe fn find_low(&mut self) {
        let span = match self.kind {
            '8' => 32,
            '6' => 64,
            // a packed q6 matrix's quants are in -32..32 (pack_q6 refuses others), stored compact
            'P' => {
                self.low = Some(-kvpark_cpu_ops::packed::Q6_BIAS);
                return;
            }
            _ => return,
        };
        self.low = narrow_low(slice(self.qs, self.n * self.k), span);
    }
}

/// [`Matrix::find_low`] for every matrix of the layers and the head: one pass over the model's
/// q8 quants, when the decoder is built.
///
/// # Safety
/// As [`Matrix::find_low`], for each of them.
pub(super) unsafe fn find_lows(head: &mut Matrix, layers: &mut [LayerSpec]) {
    head.find_low();
    for l in layers {
        let experts = l.experts.iter_mut().flat_map(|x| {
            let down = std::iter::once(&mut x.down);
            x.gate_up.iter_mut().chain(down)
        });
        let parts = l.qkv.iter_mut().chain(&mut l.gate_up).chain(experts);
        let single = [Some(&mut l.o), l.down.as_mut(), l.router.as_mut()];
        for m in parts.chain(single.into_iter().flatten()) {
            m.find_low();
        }
    }
}

/// One layer: addresses of f32 vectors (0 where the model has none) and its matrices; a fused
/// one (qkv, gate_up) as its parts, rows in order (one part, or several of different kinds).
#[derive(FromPyObject, Clone)]
#[pyo3(from_item_all)]
pub(super) struct LayerSpec {
    pub(super) attn_norm: usize,
    pub(super) qkv: Vec<Matrix>,
    pub(super) qkv_bias: usize,
    pub(super) q_norm: usize,
    pub(super) k_norm: usize,
    pub(super) o: Matrix,
    pub(super) o_bias: usize,
    pub(super) mlp_norm: usize,
    /// a dense MLP's (empty and None in a mixture of experts' layer)
    pub(super) gate_up: Vec<Matrix>,
    pub(super) down: Option<Matrix>,
    /// a mixture of experts: the router `[experts, hidden]` (None for a dense MLP), each
    /// expert's matrices, how many a row takes, and whether their weights are renormalised
    pub(super) router: Option<Matrix>,
    pub(super) experts: Vec<ExpertSpec>,
    pub(super) top_k: usize,
    pub(super) norm_topk: bool,
    pub(super) k_cells: usize,
    pub(super) v_cells: usize,
    pub(super) post_attn_norm: usize,
    pub(super) post_mlp_norm: usize,
    pub(super) sliding: bool,
    pub(super) rope: usize,
}

/// One expert of a mixture: its gate/up parts and down, `[2 * width, hidden]`, `[hidden, width]`.
#[derive(FromPyObject, Clone)]
#[pyo3(from_item_all)]
pub(super) struct ExpertSpec {
    pub(super) gate_up: Vec<Matrix>,
    pub(super) down: Matrix,
}

/// The architecture's switches (kvpark_cpu_ops::decoder::Shape): `act` 's' (silu) or 'g' (gelu_tanh);
/// soft-caps 0 for none; `window` 0 where no layer slides.
#[derive(FromPyObject, Clone, Copy)]
#[pyo3(from_item_all)]
pub(super) struct Features {
    pub(super) act: char,
    pub(super) embed_scale: f32,
    pub(super) attn_scale: f32,
    pub(super) attn_softcap: f32,
    pub(super) final_softcap: f32,
    pub(super) window: usize,
}

/// # Safety
/// `at` holds `len` live values of `T` (0 only with `len` 0 is never passed here).
pub(super) unsafe fn slice<'a, T>(at: usize, len: usize) -> &'a [T] {
    std::slice::from_raw_parts(at as *const T, len)
}

/// # Safety
/// As for [`slice`]; 0 means none.
pub(super) unsafe fn maybe<'a>(at: usize, len: usize) -> Option<&'a [f32]> {
    (at != 0).then(|| slice(at, len))
}

/// A q6 matrix's quants (bytes) and scales: the row layout's, or compact where packed ('P').
fn q6_lengths(m: &Matrix) -> (usize, usize) {
    if m.kind == 'P' {
        kvpark_cpu_ops::q6_packed_lengths(m.n, m.k)
    } else {
        (m.n * m.k, m.n * m.k / Q6_GROUP)
    }
}

/// # Safety
/// The matrix's tensors are live, of the sizes its kind and shape say.
pub(super) unsafe fn weights<'a>(m: &Matrix) -> Weights<'a> {
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
        '4' | 'p' => Weights::Q4(Q4Weights {
            qs: slice(m.qs, m.n * m.k / 2),
            scale: slice(m.scale, blocks),
            offset: slice(m.offset, blocks),
            n: m.n,
            k: m.k,
            packed: m.kind == 'p',
        }),
        'i' => Weights::Iq4(Iq4Weights {
            qs: slice(m.qs, m.n * m.k / 2),
            scale: slice(m.scale, blocks),
            n: m.n,
            k: m.k,
        }),
        '6' | 'P' => Weights::Q6(Q6Weights {
            qs: slice(m.qs, q6_lengths(m).0),
            scale: slice(m.scale, q6_lengths(m).1),
            n: m.n,
            k: m.k,
            low: m.low,
            packed: m.kind == 'P',
        }),
        'Q' => {
            let (qs, values) = kvpark_cpu_ops::q5_packed_lengths(m.n, m.k);
            Weights::Q8(Q8Weights {
                qs: slice(m.qs, qs),
                scale: slice(m.scale, values),
                offset: maybe(m.offset, values),
                n: m.n,
                k: m.k,
                low: Some(0), // pack_q5 takes quants in 0..32 only
                packed: Q8Packing::Q5Super,
            })
        }
        'B' => {
            let (qs, values) = kvpark_cpu_ops::q5b_packed_lengths(m.n, m.k);
            Weights::Q8(Q8Weights {
                qs: slice(m.qs, qs),
                scale: slice(m.scale, values),
                offset: maybe(m.offset, values),
                n: m.n,
                k: m.k,
                // kvpark.model.block_packing stores Q5_0's `q + 16` and Q5_1's `q`
                low: Some(if m.offset == 0 { -16 } else { 0 }),
                packed: Q8Packing::Q5Blocks,
            })
        }
        _ => Weights::Q8(Q8Weights {
            qs: slice(m.qs, m.n * m.k),
            scale: slice(m.scale, blocks),
            offset: maybe(m.offset, blocks),
            n: m.n,
            k: m.k,
            low: m.low,
            packed: Q8Packing::Rows,
        }),
    }
}

pub(super) fn check_matrix(name: &str, m: &Matrix, n: usize, k: usize) -> PyResult<()> {
    let dense = matches!(m.kind, 'f' | 'h' | 'b');
    let fits = m.n == n && m.k == k && k > 0 && m.qs != 0;
    let kind = if dense {
        m.scale == 0 && m.offset == 0
    } else {
        let offset = match m.kind {
            '4' => m.offset != 0,
            'p' => m.offset != 0 && n % kvpark_cpu_ops::PACK == 0,
            'P' => m.offset == 0 && n % kvpark_cpu_ops::PACK == 0,
            'Q' => m.offset != 0 && n % kvpark_cpu_ops::PACK == 0,
            'B' => n % kvpark_cpu_ops::PACK == 0,
            '6' | 'i' => m.offset == 0,
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
pub(super) fn check_parts(name: &str, parts: &[Matrix], n: usize, k: usize) -> PyResult<()> {
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

/// A layer's matrices as weights, the fused ones as their parts (what [`Layer`] borrows).
pub(super) struct LayerParts<'a> {
    pub(super) qkv: Vec<Weights<'a>>,
    pub(super) gate_up: Vec<Weights<'a>>,
    pub(super) down: Option<Weights<'a>>,
    pub(super) router: Option<Weights<'a>>,
    pub(super) expert_gate_up: Vec<Vec<Weights<'a>>>,
    pub(super) expert_down: Vec<Weights<'a>>,
}

/// # Safety
/// As for [`weights`], for every matrix of the layer.
pub(super) unsafe fn layer_parts<'a>(l: &LayerSpec) -> LayerParts<'a> {
    let parts = |ms: &[Matrix]| ms.iter().map(|m| weights(m)).collect::<Vec<_>>();
    LayerParts {
        qkv: parts(&l.qkv),
        gate_up: parts(&l.gate_up),
        down: l.down.as_ref().map(|m| weights(m)),
        router: l.router.as_ref().map(|m| weights(m)),
        expert_gate_up: l.experts.iter().map(|x| parts(&x.gate_up)).collect(),
        expert_down: l.experts.iter().map(|x| weights(&x.down)).collect(),
    }
}
