"""Causal attention over the paged KV pool, torch reference path (CPU, and CUDA without kernels).

A step's rows come in sequences (``AttentionMetadata``). ``prepare`` turns the metadata into gather
indices and masks ONCE per step; ``paged_attention`` then runs per layer, one SDPA call per group:

```
decode group   sequences with one row:   q [B, kv_heads, group, D]      x  cells [B, kv_heads, L, D]
prompt group   sequences with more rows: q [B, kv_heads, group * Q, D]  x  cells [B, kv_heads, L, D]
```
Query heads sharing a KV head are folded into the query axis (head h = kv * group + g), so SDPA sees
plain multi-head attention and no KV head is ever repeated. Splitting decode rows from prompt rows
keeps a mixed step (one 512-row chunk plus a few decode rows) from padding every decode row to 512.
The cells of each sequence are gathered from the pool in logical order into a padded batch; a bool
mask hides padding and, for prompt rows, the cells after the row's own position.

This path is fast, not batch invariant (feasibility §3.5): exact mode brings its own attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvpark.ops.metadata import AttentionMetadata


@dataclass
class _Group:
    """Sequences attended by one SDPA call, padded to q_len query rows and ctx_len cells each."""

    n_seqs: int
    q_len: int  # 1 for the decode group
    ctx_len: int
    cells: torch.Tensor  # [n_seqs, ctx_len] int64 flat cell index, padding points at a real cell
    mask: torch.Tensor | None  # [n_seqs, 1, group * q_len or 1, ctx_len] bool, True = attend;
    # None when every query sees every cell (decode rows of equal context): SDPA is faster then
    rows: torch.Tensor | None  # [n_seqs * q_len] step rows gathered as queries; None: all, in order
    valid: torch.Tensor | None  # [n_out] indices into the padded n_seqs * q_len rows that are real
    out_rows: torch.Tensor | None  # [n_out] step rows they write; None: rows complete, in order
    _head_rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def head_rows(self, n_kv: int) -> torch.Tensor:
        """[n_seqs * n_kv * ctx_len] rows of the pool viewed as [cells * n_kv, D], ordered so one
        index_select lands K or V head-major, [n_seqs, n_kv, ctx_len, D], contiguous as SDPA likes.
        """
        rows = self._head_rows.get(n_kv)
        if rows is None:
            heads = torch.arange(n_kv, device=self.cells.device)
            rows = (self.cells[:, None, :] * n_kv + heads[None, :, None]).reshape(-1)
            self._head_rows[n_kv] = rows
        return rows


@dataclass
class AttentionPlan:
    """What every layer of one step reuses: groups, masks and the gather buffers."""

    n_rows: int
    groups: list[_Group]
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)

    def buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A scratch tensor reused by every layer, so a step allocates (and page-faults) once."""
        buf = self.workspace.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype:
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.workspace[name] = buf
        return buf


def prepare(meta: AttentionMetadata, q_per_kv: int) -> AttentionPlan:
    """Build the plan for one step; q_per_kv is the model's GQA group size."""
    starts = meta.query_start
    lens = [starts[b + 1] - starts[b] for b in range(meta.n_seqs)]
    if any(n < 1 for n in lens) or any(n > c for n, c in zip(lens, meta.context_lens, strict=True)):
        raise ValueError(f"bad step: rows per sequence {lens}, context lens {meta.context_lens}")
    decode = [b for b in range(meta.n_seqs) if lens[b] == 1]
    prompt = [b for b in range(meta.n_seqs) if lens[b] > 1]
    groups = []
    if decode:
        groups.append(_decode_group(meta, decode, all_rows=len(decode) == meta.n_seqs))
    if prompt:
        groups.append(_prompt_group(meta, prompt, lens, q_per_kv))
    return AttentionPlan(n_rows=meta.n_rows, groups=groups)


def _cells(meta: AttentionMetadata, seqs: list[int], ctx_len: int) -> torch.Tensor:
    index = meta.cell_index
    if len(seqs) != meta.n_seqs:
        index = index.index_select(0, torch.tensor(seqs, device=index.device))
    return index[:, :ctx_len]


def _decode_group(meta: AttentionMetadata, seqs: list[int], all_rows: bool) -> _Group:
    device = meta.cell_index.device
    ctx = [meta.context_lens[b] for b in seqs]
    ctx_len = max(ctx)
    mask = None
    if min(ctx) < ctx_len:  # padding to hide
        ctx_t = torch.tensor(ctx, device=device)
        mask = torch.arange(ctx_len, device=device)[None, :] < ctx_t[:, None]  # [B, L]
    rows = None if all_rows else torch.tensor([meta.query_start[b] for b in seqs], device=device)
    return _Group(
        n_seqs=len(seqs),
        q_len=1,
        ctx_len=ctx_len,
        cells=_cells(meta, seqs, ctx_len),
        mask=None if mask is None else mask[:, None, None, :],
        rows=rows,
        valid=None,
        out_rows=rows,
    )


def _prompt_group(meta: AttentionMetadata, seqs: list[int], lens: list[int], group: int) -> _Group:
    device = meta.cell_index.device
    q_len = max(lens[b] for b in seqs)
    ctx_len = max(meta.context_lens[b] for b in seqs)
    # Padding slots repeat the sequence's last row, so no mask row is empty (SDPA would give NaN).
    # Index lists are built on the host: no device sync, and they are short.
    rows_list = [meta.query_start[b] + min(i, lens[b] - 1) for b in seqs for i in range(q_len)]
    pos_list = [
        meta.context_lens[b] - lens[b] + min(i, lens[b] - 1) for b in seqs for i in range(q_len)
    ]
    position = torch.tensor(pos_list, device=device).view(len(seqs), q_len)  # [B, Q]
    mask = torch.arange(ctx_len, device=device)[None, None, :] <= position[:, :, None]  # [B, Q, L]
    mask = mask[:, None].expand(-1, group, -1, -1).reshape(len(seqs), 1, group * q_len, ctx_len)
    rows: torch.Tensor | None = torch.tensor(rows_list, device=device)
    valid = out_rows = None
    if any(lens[b] != q_len for b in seqs):
        real = [j * q_len + i for j, b in enumerate(seqs) for i in range(lens[b])]
        valid = torch.tensor(real, device=device)
        out_rows = torch.tensor([rows_list[r] for r in real], device=device)
    elif len(seqs) == meta.n_seqs:
        rows = None  # the step is this group's rows, in order
    else:
        out_rows = rows
    return _Group(
        n_seqs=len(seqs),
        q_len=q_len,
        ctx_len=ctx_len,
        cells=_cells(meta, seqs, ctx_len),
        mask=mask.contiguous(),
        rows=rows,
        valid=valid,
        out_rows=out_rows,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
) -> torch.Tensor:
    """q [T, heads, D] (rope applied) against the cells in k_cache, v_cache [pages, page_size,
    kv_heads, D] (this step's rows already stored) -> [T, heads, D]."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    k_rows = k_cache.view(-1, head_dim)  # [cells * kv_heads, D]
    v_rows = v_cache.view(-1, head_dim)
    out: torch.Tensor | None = None
    if len(plan.groups) > 1:
        out = torch.empty_like(q)
    for i, g in enumerate(plan.groups):
        b, lq, lk = g.n_seqs, g.q_len, g.ctx_len
        k4 = plan.buffer(f"k{i}", (b, n_kv, lk, head_dim), k_cache)  # [B, kv, L, D]
        v4 = plan.buffer(f"v{i}", (b, n_kv, lk, head_dim), v_cache)
        torch.index_select(k_rows, 0, g.head_rows(n_kv), out=k4.view(-1, head_dim))
        torch.index_select(v_rows, 0, g.head_rows(n_kv), out=v4.view(-1, head_dim))
        qg = q if g.rows is None else q.index_select(0, g.rows)  # [B * Q, heads, D]
        if lq == 1:
            qf = qg.view(b, n_kv, group, head_dim)
        else:  # [B, Q, kv, group, D] -> [B, kv, group * Q, D]
            qf = qg.view(b, lq, n_kv, group, head_dim).permute(0, 2, 3, 1, 4)
            qf = qf.reshape(b, n_kv, group * lq, head_dim)
        o = F.scaled_dot_product_attention(qf, k4, v4, attn_mask=g.mask)
        if lq > 1:  # back to [B * Q, heads, D]
            o = o.view(b, n_kv, group, lq, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(b * lq, n_heads, head_dim)
        if g.valid is not None:
            o = o.index_select(0, g.valid)
        if out is None:
            if g.out_rows is None:
                return o
            out = torch.empty_like(q)
        if g.out_rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, g.out_rows, o)
    assert out is not None, "a step has at least one row"
    return out
