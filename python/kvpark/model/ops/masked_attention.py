"""Attention with what the fused kernels of the torch path do not do: a sliding window (a row
sees only the last ``window`` positions of its sequence, itself included), a score scale other
than ``head_dim ** -0.5`` and Gemma 2's soft-cap of the scores (``c * tanh(s / c)``).

``prepare`` lists each row's cells once per step and window (``MaskedPlan``); ``masked_attention``
then gathers them from the pool and does the softmax in float32. The default op set runs all
rows as one padded batch; the exact set (``row_invariant``) runs each row alone over exactly
its own cells, so its bits depend on nothing but that row (docs/exact.md). Models whose
attention is plain (``ModelArch.plain_attention``) never come here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpark.model.ops.metadata import AttentionMetadata

Tensor = torch.Tensor


@dataclass(frozen=True)
class MaskedPlan:
    cells: Tensor  # [T, L] int64: each row's cells, oldest first, padded with cell 0
    lens: list[int]  # [T]: cells each row attends to
    mask: Tensor  # [T, L] bool: True where a cell is the row's
    scale: float
    softcap: float | None
    row_invariant: bool


def prepare(
    meta: AttentionMetadata,
    window: int | None,
    scale: float,
    softcap: float | None,
    row_invariant: bool,
) -> MaskedPlan:
    """Every row's cells: its sequence's up to its position, the last ``window`` of them."""
    per_row: list[Tensor] = []
    for b in range(meta.n_seqs):
        n_rows = meta.query_start[b + 1] - meta.query_start[b]
        ctx = meta.context_lens[b]
        for r in range(n_rows):
            end = ctx - n_rows + r + 1
            start = 0 if window is None else max(0, end - window)
            per_row.append(meta.cell_index[b, start:end])
    lens = [len(c) for c in per_row]
    width = max(lens, default=1)
    device = meta.cell_index.device
    cells = torch.zeros((len(per_row), width), dtype=torch.int64, device=device)
    mask = torch.zeros((len(per_row), width), dtype=torch.bool, device=device)
    for i, c in enumerate(per_row):
        cells[i, : len(c)] = c
        mask[i, : len(c)] = True
    return MaskedPlan(cells, lens, mask, scale, softcap, row_invariant)


def masked_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: MaskedPlan) -> Tensor:
    """q [T, heads, D] against the pool's cells [pages, page_size, kv_heads, D] -> [T, heads, D]."""
    n_kv, d = k_cache.shape[-2], k_cache.shape[-1]
    k_all, v_all = k_cache.view(-1, n_kv, d), v_cache.view(-1, n_kv, d)
    if not plan.row_invariant:
        return _attend(q, k_all, v_all, plan.cells, plan.mask, plan)
    rows = []
    for r, n in enumerate(plan.lens):  # each row alone, over exactly its cells
        rows.append(
            _attend(
                q[r : r + 1],
                k_all,
                v_all,
                plan.cells[r : r + 1, :n],
                plan.mask[r : r + 1, :n],
                plan,
            )
        )
    return torch.cat(rows)


def _attend(
    q: Tensor, k_all: Tensor, v_all: Tensor, cells: Tensor, mask: Tensor, plan: MaskedPlan
) -> Tensor:
    t, heads, d = q.shape
    n_kv = k_all.shape[1]
    group = heads // n_kv
    k = k_all[cells].float()  # [T, L, kv, D]
    v = v_all[cells].float()
    qg = q.float().view(t, n_kv, group, d)
    scores = torch.einsum("tkgd,tlkd->tkgl", qg, k) * plan.scale
    if plan.softcap is not None:
        scores = torch.tanh(scores / plan.softcap) * plan.softcap
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.einsum("tkgl,tlkd->tkgd", p, v)
    return out.reshape(t, heads, d).to(q.dtype)
