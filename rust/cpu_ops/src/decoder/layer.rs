//! One transformer layer over a step's rows, in place on the residual stream `x`.

use super::{sized, Act, Dot, KvCells, Layer, Mlp, Model, Shape, Step, Workspace};
use crate::attention::{decode_attention_with, DecodeAttention};
use crate::dense::bf16_pairs;
use crate::int8::{matmul_i8, matmul_i8_parts, I8Kernel, I8Scratch};
use crate::norm::rms_norm;
use crate::product::product;
use crate::row_split::{for_rows, SharedRows};
use crate::shape::ShapeError;
use crate::weights::Weights;

/// `y = x @ W.T` on the thread team, in the arithmetic `dot` names for block matrices.
pub(crate) fn matmul(
    dot: Dot,
    x: &[f32],
    rows: usize,
    w: Weights<'_>,
    y: &mut [f32],
    scratch: &mut I8Scratch,
) -> Result<(), ShapeError> {
    match (dot, w) {
        (_, Weights::Q4(_) | Weights::Q8(_) | Weights::Q6(_) | Weights::Iq4(_))
            if dot.int8_blocks() =>
        {
            matmul_i8(x, rows, w, y, I8Kernel::best(), scratch)
        }
        (Dot::Int8Bf16, Weights::Dense(d)) if bf16_pairs::applies(&d) => {
            bf16_pairs::matmul_bf16_pairs(x, rows, d, y, bf16_pairs::PairKernel::best())
        }
        // any other dense matrix takes f32 rows whatever the block dot (int8 needs blocks)
        _ => product(x, rows, w, y, true),
    }
}

/// `y = x @ W.T` for a fused matrix given as its parts (rows in order): one part straight into
/// `y`; several each into `part`, then into its columns of every row of `y`. Each output value
/// is its part's product, bit for bit: the split changes nothing but where it is written.
fn matmul_parts(
    dot: Dot,
    x: &[f32],
    rows: usize,
    parts: &[Weights<'_>],
    y: &mut [f32],
    part: &mut Vec<f32>,
    scratch: &mut I8Scratch,
) -> Result<(), ShapeError> {
    if let [one] = parts {
        return matmul(dot, x, rows, *one, y, scratch);
    }
    let blocks = |w: &Weights<'_>| !matches!(w, Weights::Dense(_));
    if dot.int8_blocks() && parts.iter().all(blocks) {
        return matmul_i8_parts(x, rows, parts, y, I8Kernel::best(), scratch, part);
    }
    let width: usize = parts.iter().map(|w| w.n()).sum();
    if rows == 0 || y.len() != rows * width {
        return Err(ShapeError(format!(
            "{} outputs for {rows} rows of {width}",
            y.len()
        )));
    }
    let mut col = 0;
    for w in parts {
        let n = w.n();
        let out = sized(part, rows * n);
        matmul(dot, x, rows, *w, out, scratch)?;
        for (r, src) in out.chunks_exact(n).enumerate() {
            y[r * width + col..r * width + col + n].copy_from_slice(src);
        }
        col += n;
    }
    Ok(())
}

fn add_bias(y: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
}

/// NEOX rope of one head in place: dimension i turns with i + d/2. The products and the sum in
/// torch's order (`x * cos + roll(x) * signed_sin`, model/ops/rope.py), so the bits are its.
fn rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (a, b) = head.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] + x2 * -sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// Norm (Qwen3) and rope of `heads` heads of one row, in place.
fn heads_in_place(
    x: &mut [f32],
    norm: Option<&[f32]>,
    s: &Shape,
    cos: &[f32],
    sin: &[f32],
    tmp: &mut [f32],
) -> Result<(), ShapeError> {
    if let Some(w) = norm {
        tmp.copy_from_slice(x);
        rms_norm(tmp, w, s.eps, x)?;
    }
    for head in x.chunks_exact_mut(s.head_dim) {
        rope(head, cos, sin);
    }
    Ok(())
}

pub(super) fn run(
    model: &Model<'_>,
    layer: &Layer<'_>,
    k_cells: &mut KvCells<'_>,
    v_cells: &mut KvCells<'_>,
    step: &Step<'_>,
    x: &mut [f32],
    ws: &mut Workspace,
) -> Result<(), ShapeError> {
    let s = &model.shape;
    let t = step.tokens.len();
    let (d, half) = (s.head_dim, s.head_dim / 2);
    let (nq, nkv) = (s.heads * d, s.kv_heads * d);
    let qkv_w = s.qkv();
    if k_cells.len() != v_cells.len() || !k_cells.len().is_multiple_of(nkv) {
        return Err(ShapeError(format!(
            "K/V pools of {} and {} values for cells of {nkv}",
            k_cells.len(),
            v_cells.len()
        )));
    }
    let n_cells = (k_cells.len() / nkv) as i64;
    let slots = step.slots_of(layer.sliding);
    if let Some(c) = slots.iter().find(|&&c| c < 0 || c >= n_cells) {
        return Err(ShapeError(format!(
            "slot {c} is outside the pool of {n_cells} cells"
        )));
    }

    // attention: norm, QKV, rope, store K and V, attend
    let h = sized(&mut ws.h, t * s.hidden);
    rms_norm(x, layer.attn_norm, s.eps, h)?;
    let qkv = sized(&mut ws.qkv, t * qkv_w);
    matmul_parts(
        model.dot,
        h,
        t,
        layer.qkv,
        qkv,
        &mut ws.mlp.part,
        &mut ws.i8,
    )?;
    add_bias(qkv, layer.qkv_bias);
    let q = sized(&mut ws.q, t * nq);
    let rope = model.ropes[layer.rope];
    // each row's norm and rope on the thread its rows fall to; then K and V into the pool
    let (qkv_rows, q_rows) = (SharedRows::new(qkv, qkv_w), SharedRows::new(q, nq));
    let failed = std::sync::Mutex::new(None);
    for_rows(t, qkv_w, &|rows| {
        // the Qwen3 head norms' copy (no allocation where the model has none)
        let normed = layer.q_norm.is_some() || layer.k_norm.is_some();
        let mut tmp = vec![0.0f32; if normed { nq.max(nkv) } else { 0 }];
        let w = tmp.len();
        // SAFETY: for_rows hands each range of rows to one thread.
        let (qkv, q) = unsafe { (qkv_rows.rows(rows.clone()), q_rows.rows(rows.clone())) };
        let each = qkv.chunks_exact_mut(qkv_w).zip(q.chunks_exact_mut(nq));
        for (r, (row, q)) in rows.zip(each) {
            let p = step.positions[r] as usize;
            let (cos, sin) = (
                &rope.cos[p * half..(p + 1) * half],
                &rope.sin[p * half..(p + 1) * half],
            );
            let (qr, kv) = row.split_at_mut(nq);
            let kr = &mut kv[..nkv];
            let done = heads_in_place(qr, layer.q_norm, s, cos, sin, &mut tmp[..nq.min(w)])
                .and_then(|()| {
                    heads_in_place(kr, layer.k_norm, s, cos, sin, &mut tmp[..nkv.min(w)])
                });
            if let Err(e) = done {
                *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                return;
            }
            q.copy_from_slice(qr);
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    let q = &ws.q[..t * nq];
    for (r, row) in qkv.chunks_exact(qkv_w).enumerate() {
        let cell = slots[r] as usize;
        k_cells.store(cell, &row[nq..nq + nkv]);
        v_cells.store(cell, &row[nq + nkv..]);
    }
    let att = sized(&mut ws.att, t * nq);
    let e = if layer.sliding {
        &ws.windowed
    } else {
        &ws.full
    };
    let a = DecodeAttention {
        q,
        k: k_cells.values(),
        v: v_cells.values(),
        cells: &e.cells,
        stride: e.stride,
        context: &e.context,
        rows: &e.rows,
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: d,
    };
    decode_attention_with(a, s.scores, att)?;
    let proj = sized(&mut ws.proj, t * s.hidden);
    matmul(model.dot, att, t, layer.o, proj, &mut ws.i8)?;
    add_bias(proj, layer.o_bias);
    residual_add(x, proj, layer.post_attn_norm, s, &mut ws.h)?;

    // MLP: norm, then gate/up, act(gate) * up, down (or the mixture of experts)
    let h = sized(&mut ws.h, t * s.hidden);
    rms_norm(x, layer.mlp_norm, s.eps, h)?;
    let proj = sized(&mut ws.proj, t * s.hidden);
    match layer.mlp {
        Mlp::Dense { gate_up, down } => swiglu(
            model,
            h,
            t,
            gate_up,
            down,
            s.intermediate,
            proj,
            &mut ws.mlp,
            &mut ws.i8,
        )?,
        Mlp::Experts(moe) => super::moe::run(
            model,
            &moe,
            h,
            t,
            proj,
            &mut ws.moe,
            &mut ws.mlp,
            &mut ws.i8,
        )?,
    }
    residual_add(x, proj, layer.post_mlp_norm, s, &mut ws.h)
}

/// An MLP's buffers, kept between steps.
#[derive(Default)]
pub(crate) struct MlpBufs {
    gate_up: Vec<f32>,
    act: Vec<f32>,
    part: Vec<f32>,
}

/// `out [rows, hidden]` = down(act(gate) * up) of `x [rows, hidden]`, `width` the MLP's.
#[allow(clippy::too_many_arguments)]
pub(super) fn swiglu(
    model: &Model<'_>,
    x: &[f32],
    rows: usize,
    gate_up: &[Weights<'_>],
    down: Weights<'_>,
    width: usize,
    out: &mut [f32],
    bufs: &mut MlpBufs,
    i8: &mut I8Scratch,
) -> Result<(), ShapeError> {
    let gu = sized(&mut bufs.gate_up, rows * 2 * width);
    matmul_parts(model.dot, x, rows, gate_up, gu, &mut bufs.part, i8)?;
    let act = sized(&mut bufs.act, rows * width);
    let (shared, kind) = (SharedRows::new(act, width), model.shape.act);
    for_rows(rows, 2 * width, &|r| {
        // SAFETY: for_rows hands each range of rows to one thread.
        let act = unsafe { shared.rows(r.clone()) };
        let gu = &gu[r.start * 2 * width..r.end * 2 * width];
        for (row, o) in gu.chunks_exact(2 * width).zip(act.chunks_exact_mut(width)) {
            let (gate, up) = row.split_at(width);
            match kind {
                Act::Silu => super::silu::silu_mul(gate, up, o),
                Act::GeluTanh => super::gelu::gelu_mul(gate, up, o),
            }
        }
    });
    matmul(model.dot, &bufs.act[..rows * width], rows, down, out, i8)
}

/// `x += y`, or `x += norm(y)` where the layer norms its outputs (Gemma's sandwich norms).
fn residual_add(
    x: &mut [f32],
    y: &[f32],
    norm: Option<&[f32]>,
    s: &Shape,
    buf: &mut Vec<f32>,
) -> Result<(), ShapeError> {
    let y = match norm {
        None => y,
        Some(w) => {
            let normed = sized(buf, y.len());
            rms_norm(y, w, s.eps, normed)?;
            normed
        }
    };
    let d = s.hidden;
    let shared = SharedRows::new(x, d);
    for_rows(y.len() / d, d, &|r| {
        // SAFETY: for_rows hands each range of rows to one thread.
        let x = unsafe { shared.rows(r.clone()) };
        let y = &y[r.start * d..r.end * d];
        x.iter_mut().zip(y).for_each(|(x, p)| *x += p);
    });
    Ok(())
}
