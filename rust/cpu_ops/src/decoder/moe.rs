//! A mixture of experts' MLP (Qwen3-MoE): a router scores every expert for each row, the
//! `top_k` best are picked (ties to the lower index), their softmax weights renormalised over
//! the picked ones where `norm_topk`, and the row's output is the weighted sum of the picked
//! experts' SwiGLUs, in the order of their rank.
//!
//! Rows are grouped by expert so that each expert's matrices are read once a step for all its
//! rows; the products are row-invariant (the crate's matmuls compute each row on its own), and
//! each row's sum runs over its own picks in a fixed order, so a row's bits depend on nothing
//! but that row: exact mode holds.

use super::layer::{matmul, swiglu, MlpBufs};
use super::{sized, Model};
use crate::int8::I8Scratch;
use crate::shape::ShapeError;
use crate::weights::Weights;

/// One expert: a SwiGLU MLP (gate/up fused by rows, as parts; down).
#[derive(Clone, Copy)]
pub struct Expert<'a> {
    pub gate_up: &'a [Weights<'a>],
    pub down: Weights<'a>,
}

/// A layer's mixture: the router `[experts, hidden]` and the experts.
#[derive(Clone, Copy)]
pub struct Moe<'a> {
    pub router: Weights<'a>,
    pub experts: &'a [Expert<'a>],
    pub top_k: usize,
    pub norm_topk: bool,
}

/// Buffers of the mixture, kept between steps.
#[derive(Default)]
pub(crate) struct MoeBufs {
    logits: Vec<f32>,
    picks: Vec<(usize, f32)>,
    rows: Vec<usize>,
    x: Vec<f32>,
    y: Vec<f32>,
    slots: Vec<f32>,
}

/// `out [rows, hidden]` = the mixture of `h [rows, hidden]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    model: &Model<'_>,
    moe: &Moe<'_>,
    h: &[f32],
    rows: usize,
    out: &mut [f32],
    bufs: &mut MoeBufs,
    mlp: &mut MlpBufs,
    i8: &mut I8Scratch,
) -> Result<(), ShapeError> {
    let hidden = model.shape.hidden;
    let (n, k) = (moe.experts.len(), moe.top_k);
    if n == 0 || k == 0 || k > n || moe.router.n() != n {
        return Err(ShapeError(format!(
            "{k} of {n} experts, a router of {}",
            moe.router.n()
        )));
    }
    let logits = sized(&mut bufs.logits, rows * n);
    matmul(model.dot, h, rows, moe.router, logits, i8)?;
    bufs.picks.clear();
    for row in logits.chunks_exact(n) {
        pick(row, k, moe.norm_topk, &mut bufs.picks);
    }
    let slots = sized(&mut bufs.slots, rows * k * hidden);
    for (e, expert) in moe.experts.iter().enumerate() {
        bufs.rows.clear();
        bufs.rows
            .extend((0..rows * k).filter(|&at| bufs.picks[at].0 == e));
        if bufs.rows.is_empty() {
            continue;
        }
        let m = bufs.rows.len();
        let x = sized(&mut bufs.x, m * hidden);
        for (dst, &at) in x.chunks_exact_mut(hidden).zip(&bufs.rows) {
            let r = at / k;
            dst.copy_from_slice(&h[r * hidden..(r + 1) * hidden]);
        }
        let y = sized(&mut bufs.y, m * hidden);
        let width = expert.down.k();
        swiglu(model, x, m, expert.gate_up, expert.down, width, y, mlp, i8)?;
        for (src, &at) in y.chunks_exact(hidden).zip(&bufs.rows) {
            slots[at * hidden..(at + 1) * hidden].copy_from_slice(src);
        }
    }
    for (r, o) in out.chunks_exact_mut(hidden).enumerate() {
        o.fill(0.0);
        for j in 0..k {
            let w = bufs.picks[r * k + j].1;
            let y = &slots[(r * k + j) * hidden..(r * k + j + 1) * hidden];
            o.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
        }
    }
    Ok(())
}

/// The `k` best experts of one row's router logits and their weights: the softmax over all
/// experts (maximum subtracted), renormalised over the picked ones where `norm`.
fn pick(logits: &[f32], k: usize, norm: bool, picks: &mut Vec<(usize, f32)>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let exps: Vec<f32> = logits.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // descending by logit (the softmax keeps the order), ties to the lower index
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let first = picks.len();
    picks.extend(order[..k].iter().map(|&e| (e, exps[e] / sum)));
    if norm {
        let total: f32 = picks[first..].iter().map(|p| p.1).sum();
        picks[first..].iter_mut().for_each(|p| p.1 /= total);
    }
}

#[cfg(test)]
mod tests {
    use super::pick;

    #[test]
    fn picks_the_best_and_renormalises() {
        let mut p = Vec::new();
        pick(&[0.5, 2.0, -1.0, 2.0], 2, true, &mut p);
        assert_eq!(p.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!((p[0].1 - 0.5).abs() < 1e-7 && (p[1].1 - 0.5).abs() < 1e-7);
        let mut q = Vec::new();
        pick(&[0.0, 0.0, 0.0, 0.0], 1, false, &mut q);
        assert_eq!(q, vec![(0, 0.25)]);
    }
}
