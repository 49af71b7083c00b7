"""Batch-invariant paged attention for exact mode: fixed query tiles and key chunks, one code path.

SDPA over a padded batch is not invariant: its result for a row changes with the padded length and
differs between a prompt row and the same row as a decode step (measured: SDPA picks its kernel
by shape). Here every shape
a row's numbers pass through is fixed, whatever else is in the step:

```
queries  a sequence's rows in tiles of Q_TILE rows, zero-padded:  [tiles, kv, group * Q_TILE, D]
keys     its cells in chunks of KEY_CHUNK, in logical order:      [tiles, kv, KEY_CHUNK, D]
per chunk j: scores = bmm(q, k_j^T); mask cells past each row's position to -inf; online softmax
             (running max m, running sum l, fp32 accumulator) updated with exp and bmm(p, v_j)
out      acc / l
```
A prompt row and a decode row take the same path: a decode row is a tile with one real row. A chunk
wholly past a row's position leaves its running state unchanged bit for bit (its p is 0 and its
rescale factor exp(0) is 1), so a row's result does not depend on how many chunks its tile visits.
``bmm`` is invariant to its batch dimension, so the tiles of all sequences are stacked into one call
per chunk index; tiles are sorted by how many chunks they visit, which makes the tiles active for
chunk j a prefix of the stack (a slice, no gather).

The transcendental ops (exp) run on tensors whose sizes are multiples of 32 elements, so with one or
two threads no row lands in the scalar tail of a vectorised loop (the scalar exp may differ from the
vector one by an ulp). More threads could split elsewhere; the runner caps exact mode at two on CPU.

Q_TILE and KEY_CHUNK are part of the numerics: changing them changes exact mode's bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpark.model.ops.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvpark.model.arch import ModelArch

Q_TILE = 4
KEY_CHUNK = 64


@dataclass(frozen=True)
class ChunkedPlan:
    """Built once per step; every layer reuses it."""

    n_tiles: int
    q_rows: torch.Tensor  # [n_tiles * Q_TILE] step row of each tile slot; T (a zero row) = padding
    head_rows: list[torch.Tensor]  # per chunk j: [active_j * kv_heads * KEY_CHUNK] pool rows
    masks: list[
        torch.Tensor
    ]  # per chunk j: [active_j, 1, 1, Q_TILE, KEY_CHUNK] bool, True = attend
    out_slots: torch.Tensor  # [T] the tile slot (tile * Q_TILE + i) holding each step row


def prepare(meta: AttentionMetadata, arch: ModelArch, dtype: torch.dtype) -> ChunkedPlan:
    """Tiles and chunk masks of one step; ``dtype`` (the KV pool's) does not change the plan."""
    n_kv, device = arch.n_kv_heads, meta.cell_index.device
    n_rows = meta.n_rows
    # (chunks visited, step rows, positions) per tile
    tiles: list[tuple[int, list[int], list[int]]] = []
    for b in range(meta.n_seqs):
        first, last = meta.query_start[b], meta.query_start[b + 1]
        start_pos = meta.context_lens[b] - (last - first)
        if last <= first or start_pos < 0:
            raise ValueError(f"bad step: sequence {b} has rows {first}..{last}")
        for t0 in range(first, last, Q_TILE):
            rows = list(range(t0, min(t0 + Q_TILE, last)))
            pos = [start_pos + r - first for r in rows]
            tiles.append((pos[-1] // KEY_CHUNK + 1, rows, pos))
    order = sorted(range(len(tiles)), key=lambda i: -tiles[i][0])
    q_rows: list[int] = []
    positions: list[list[int]] = []
    out_slots = [0] * n_rows
    cells_of_tile: list[int] = []  # sequence index of each tile, in stack order
    seq_of_row = [
        b for b in range(meta.n_seqs) for _ in range(meta.query_start[b + 1] - meta.query_start[b])
    ]
    for slot_tile, i in enumerate(order):
        _, rows, pos = tiles[i]
        for k, r in enumerate(rows):
            out_slots[r] = slot_tile * Q_TILE + k
        pad = Q_TILE - len(rows)
        q_rows += rows + [n_rows] * pad
        positions.append(pos + [pos[-1]] * pad)  # padding repeats the last row: never all masked
        cells_of_tile.append(seq_of_row[rows[0]])
    chunks_of = [tiles[i][0] for i in order]
    pos_t = torch.tensor(positions, dtype=torch.int64)  # [n_tiles, Q_TILE]
    seq_t = torch.tensor(cells_of_tile, dtype=torch.int64)
    heads = torch.arange(n_kv, dtype=torch.int64)
    offsets = torch.arange(KEY_CHUNK, dtype=torch.int64)
    cell_index = meta.cell_index.cpu()
    head_rows, masks = [], []
    for j in range(chunks_of[0]):
        active = sum(1 for c in chunks_of if c > j)
        logical = j * KEY_CHUNK + offsets  # [C]
        width = cell_index.shape[1]
        # Cells past the sequence's context (or the index's width) read cell 0: finite, masked.
        safe = logical.clamp(max=width - 1)
        cells = cell_index.index_select(0, seq_t[:active])[:, safe]  # [A, C]
        cells = torch.where(logical[None, :] < width, cells, torch.zeros_like(cells))
        pool_rows = (cells[:, None, :] * n_kv + heads[None, :, None]).reshape(-1)  # [A * kv * C]
        head_rows.append(pool_rows.to(device))
        mask = logical[None, None, :] <= pos_t[:active, :, None]  # [A, Q_TILE, C]
        masks.append(mask[:, None, None].to(device))
    return ChunkedPlan(
        n_tiles=len(order),
        q_rows=torch.tensor(q_rows, dtype=torch.int64, device=device),
        head_rows=head_rows,
        masks=masks,
        out_slots=torch.tensor(out_slots, dtype=torch.int64, device=device),
    )


def chunked_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: ChunkedPlan
) -> torch.Tensor:
    """q [T, heads, D] (rope applied) against k_cache, v_cache [pages, page_size, kv_heads, D]
    (this step's rows already stored) -> [T, heads, D], each row independent of the others."""
    n_heads, d = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    g_rows = group * Q_TILE
    n = plan.n_tiles
    scale = 1.0 / math.sqrt(d)
    # [T + 1, heads, D] with a zero row for padding slots, gathered into tiles, GQA folded:
    # [tiles, Q_TILE, kv, group, D] -> [tiles, kv, group, Q_TILE, D] -> [tiles * kv, group * Q, D]
    padded = torch.cat((q.float(), q.new_zeros((1, n_heads, d), dtype=torch.float32)))
    qt = padded.index_select(0, plan.q_rows).view(n, Q_TILE, n_kv, group, d)
    qt = (qt.permute(0, 2, 3, 1, 4) * scale).reshape(n * n_kv, g_rows, d)
    k_rows = k_cache.view(-1, d)  # [cells * kv, D]
    v_rows = v_cache.view(-1, d)
    m = torch.full((n * n_kv, g_rows), -math.inf, dtype=torch.float32, device=q.device)
    ell = torch.zeros((n * n_kv, g_rows), dtype=torch.float32, device=q.device)
    acc = torch.zeros((n * n_kv, g_rows, d), dtype=torch.float32, device=q.device)
    for rows, mask in zip(plan.head_rows, plan.masks, strict=True):
        a = mask.shape[0] * n_kv  # active tiles of this chunk are the first ones of the stack
        k = k_rows.index_select(0, rows).view(a, KEY_CHUNK, d).float()
        v = v_rows.index_select(0, rows).view(a, KEY_CHUNK, d).float()
        s = torch.bmm(qt[:a], k.transpose(1, 2))  # [a, group * Q_TILE, C]
        s = s.view(-1, n_kv, group, Q_TILE, KEY_CHUNK).masked_fill_(~mask, -math.inf)
        s = s.view(a, g_rows, KEY_CHUNK)
        m_old = m[:a]
        m_new = torch.maximum(m_old, s.amax(dim=-1))
        p = torch.exp(s - m_new.unsqueeze(-1))
        alpha = torch.exp(m_old - m_new)
        ell[:a] = ell[:a] * alpha + p.sum(dim=-1)
        acc[:a] = acc[:a] * alpha.unsqueeze(-1) + torch.bmm(p, v)
        m[:a] = m_new
    out = (acc / ell.unsqueeze(-1)).view(n, n_kv, group, Q_TILE, d).permute(0, 3, 1, 2, 4)
    out = out.reshape(n * Q_TILE, n_heads, d).index_select(0, plan.out_slots)
    return out.to(q.dtype)
