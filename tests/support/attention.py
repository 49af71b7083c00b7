"""Attention steps for the op tests: a tiny architecture, steps whose sequences' cells are
scattered over shuffled pages, and a float64 reference for each row."""

from __future__ import annotations

import random

import torch

from kvpark.model.arch import ModelArch
from kvpark.model.ops.metadata import AttentionMetadata

PAGE = 4


def tiny_arch(n_heads: int = 6, n_kv_heads: int = 2, head_dim: int = 8, **kw: object) -> ModelArch:
    base: dict[str, object] = dict(
        arch="llama",
        n_layers=2,
        hidden_size=n_heads * head_dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        intermediate_size=32,
        vocab_size=50,
        rope_theta=10000.0,
        rms_eps=1e-6,
        max_position=256,
        tie_embeddings=True,
    )
    base.update(kw)
    return ModelArch(**base)  # type: ignore[arg-type]


def make_step(
    seqs: list[tuple[int, int]], n_pages: int, seed: int
) -> tuple[AttentionMetadata, list[list[int]]]:
    """seqs: (rows this step, context after the step). Cells are scattered over shuffled pages."""
    pages = list(range(n_pages))
    random.Random(seed).shuffle(pages)
    starts, cells, slots = [0], [], []
    for n_rows, ctx in seqs:
        table = [pages.pop() for _ in range((ctx + PAGE - 1) // PAGE)]
        seq_cells = [table[p // PAGE] * PAGE + p % PAGE for p in range(ctx)]
        cells.append(seq_cells)
        slots += seq_cells[ctx - n_rows :]
        starts.append(starts[-1] + n_rows)
    width = max(c for _, c in seqs)
    index = torch.zeros(len(seqs), width, dtype=torch.int64)
    for b, c in enumerate(cells):
        index[b, : len(c)] = torch.tensor(c)
    meta = AttentionMetadata(
        torch.tensor(slots), starts, [c for _, c in seqs], index, max(n for n, _ in seqs)
    )
    return meta, cells


def reference(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    meta: AttentionMetadata,
    cells: list[list[int]],
) -> torch.Tensor:
    """Each row attends to its sequence's cells 0..its position, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_flat.shape[1]
    for b, seq_cells in enumerate(cells):
        first, end = meta.query_start[b], meta.query_start[b + 1]
        ctx = meta.context_lens[b]
        for r in range(first, end):
            pos = ctx - (end - r)
            idx = torch.tensor(seq_cells[: pos + 1])
            k = k_flat[idx].double().repeat_interleave(group, dim=1)  # [L, heads, D]
            v = v_flat[idx].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[r].double(), k) / q.shape[-1] ** 0.5
            out[r] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


STEPS = {
    "decode": [(1, 5), (1, 17), (1, 1), (1, 30)],
    "one prompt": [(12, 12)],
    "prompt chunk after context": [(7, 20)],
    "ragged prompts": [(3, 3), (9, 14), (5, 5)],
    "mixed": [(1, 9), (11, 11), (1, 2), (4, 21)],
}
