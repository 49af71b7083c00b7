"""Causal attention over the paged KV pool, torch reference path (CPU, and CUDA without kernels).

A step's rows come in sequences (``AttentionMetadata``). ``prepare`` turns the metadata into gather
indices and masks ONCE per step; ``paged_attention`` then runs per layer, one SDPA call per group:

```
decode groups  sequences with one row:   q [B, kv_heads, group, D]      x  cells [B, kv_heads, L, D]
prompt group   sequences with more rows: q [B, kv_heads, group * Q, D]  x  cells [B, kv_heads, L, D]
```
Query heads sharing a KV head are folded into the query axis (head h = kv * group + g), so SDPA sees
plain multi-head attention and no KV head is ever repeated. Splitting decode rows from prompt rows
keeps a mixed step (one 512-row chunk plus a few decode rows) from padding every decode row to 512.
Each group's cells are gathered from the pool, in logical order and head-major, with one
``index_select`` into a padded batch; a bool mask hides padding and, for prompt rows, the cells
after the row's own position. Decode sequences are cut into groups of about DECODE_GROUP_BYTES of
gathered K and V, so SDPA reads them while they are still in cache: on the 2-core dev VM that made
fp32 decode attention 1.2-1.6x faster at 256-1024 cells per sequence and changed little elsewhere.

On the CPU (a float32, bf16 or f16 pool), decode rows skip the gather: ``cpu_attention`` reads
their cells in place, all decode sequences in one Rust call per layer.

This path is fast, not batch invariant (SDPA's kernel and tiling follow the batch's shape):
exact mode brings its own attention (docs/exact.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvpark.model.ops import cpu_attention
from kvpark.model.ops.cpu_attention import NativeDecode
from kvpark.model.ops.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvpark.model.arch import ModelArch

DECODE_GROUP_BYTES = 1 << 20  # gathered K + V per decode group: about one core's L2


@dataclass(frozen=True)
class _Group:
    """Sequences attended by one SDPA call, padded to q_len query rows and ctx_len cells each."""

    n_seqs: int
    q_len: int  # 1 for a decode group
    ctx_len: int
    # [n_seqs * kv_heads * ctx_len] rows of the pool viewed as [cells * kv_heads, D], ordered so one
    # index_select lands K (or V) as [n_seqs, kv_heads, ctx_len, D], contiguous as SDPA likes.
    # Padding points at cell 0 and is masked.
    head_rows: torch.Tensor
    mask: torch.Tensor | None  # [n_seqs, 1, group * q_len or 1, ctx_len] bool, True = attend;
    # None when every query sees every cell (decode rows of equal context): SDPA is faster then
    rows: torch.Tensor | None  # [n_seqs * q_len] step rows gathered as queries; None: all, in order
    valid: torch.Tensor | None  # [n_out] indices into the padded n_seqs * q_len rows that are real
    out_rows: torch.Tensor | None  # [n_out] step rows they write; None: rows complete, in order


@dataclass
class AttentionPlan:
    """What every layer of one step reuses: groups, masks and the gather buffers."""

    groups: list[_Group | NativeDecode]
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)

    def scratch(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``shape`` on a flat scratch tensor reused by every layer and group, so a step
        allocates (and page-faults) once."""
        n = 1
        for s in shape:
            n *= s
        buf = self.workspace.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype:
            buf = torch.empty(n, dtype=like.dtype, device=like.device)
            self.workspace[name] = buf
        return buf[:n].view(shape)


def prepare(meta: AttentionMetadata, arch: ModelArch, dtype: torch.dtype) -> AttentionPlan:
    """Build the plan for one step of a model with ``arch`` whose KV pool holds ``dtype``."""
    starts = meta.query_start
    lens = [starts[b + 1] - starts[b] for b in range(meta.n_seqs)]
    if any(n < 1 for n in lens) or any(n > c for n, c in zip(lens, meta.context_lens, strict=True)):
        raise ValueError(f"bad step: rows per sequence {lens}, context lens {meta.context_lens}")
    n_kv = arch.n_kv_heads
    cell_bytes = 2 * n_kv * arch.head_dim * torch.empty((), dtype=dtype).element_size()
    decode = [b for b in range(meta.n_seqs) if lens[b] == 1]
    prompt = [b for b in range(meta.n_seqs) if lens[b] > 1]
    groups: list[_Group | NativeDecode] = []
    if decode and cpu_attention.usable(meta.cell_index.device, dtype):
        context = [meta.context_lens[b] for b in decode]
        rows = [meta.query_start[b] for b in decode]
        groups.append(cpu_attention.plan(meta.cell_index, decode, context, rows))
        decode = []
    chunk: list[int] = []
    for b in decode:
        widest = max(meta.context_lens[s] for s in [*chunk, b])
        if chunk and (len(chunk) + 1) * widest * cell_bytes > DECODE_GROUP_BYTES:
            groups.append(_decode_group(meta, chunk, n_kv))
            chunk = []
        chunk.append(b)
    if chunk:
        groups.append(_decode_group(meta, chunk, n_kv))
    if prompt:
        groups.append(_prompt_group(meta, prompt, lens, n_kv, arch.q_per_kv))
    return AttentionPlan(groups=groups)


def _head_rows(meta: AttentionMetadata, seqs: list[int], ctx_len: int, n_kv: int) -> torch.Tensor:
    cells = meta.cell_index
    if len(seqs) != meta.n_seqs:
        cells = cells.index_select(0, torch.tensor(seqs, device=cells.device))
    heads = torch.arange(n_kv, device=cells.device)
    return (cells[:, None, :ctx_len] * n_kv + heads[None, :, None]).reshape(-1)


def _decode_group(meta: AttentionMetadata, seqs: list[int], n_kv: int) -> _Group:
    device = meta.cell_index.device
    ctx = [meta.context_lens[b] for b in seqs]
    ctx_len = max(ctx)
    mask = None
    if min(ctx) < ctx_len:  # padding to hide
        ctx_t = torch.tensor(ctx, device=device)
        mask = torch.arange(ctx_len, device=device)[None, :] < ctx_t[:, None]  # [B, L]
    rows = None
    if len(seqs) != meta.n_seqs:  # Index lists are built on the host: no device sync.
        rows = torch.tensor([meta.query_start[b] for b in seqs], device=device)
    return _Group(
        n_seqs=len(seqs),
        q_len=1,
        ctx_len=ctx_len,
        head_rows=_head_rows(meta, seqs, ctx_len, n_kv),
        mask=None if mask is None else mask[:, None, None, :],
        rows=rows,
        valid=None,
        out_rows=rows,
    )


def _prompt_group(
    meta: AttentionMetadata, seqs: list[int], lens: list[int], n_kv: int, group: int
) -> _Group:
    device = meta.cell_index.device
    q_len = max(lens[b] for b in seqs)
    ctx_len = max(meta.context_lens[b] for b in seqs)
    # Padding slots repeat the sequence's last row, so no mask row is empty (SDPA would give NaN).
    last = [[min(i, lens[b] - 1) for i in range(q_len)] for b in seqs]
    rows_list = [
        meta.query_start[b] + i for b, slots in zip(seqs, last, strict=True) for i in slots
    ]
    pos = [
        meta.context_lens[b] - lens[b] + i
        for b, slots in zip(seqs, last, strict=True)
        for i in slots
    ]
    position = torch.tensor(pos, device=device).view(len(seqs), q_len)  # [B, Q]
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
        head_rows=_head_rows(meta, seqs, ctx_len, n_kv),
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
    for g in plan.groups:
        if isinstance(g, NativeDecode):
            q = q.contiguous()
            if out is None:
                out = torch.empty_like(q)
            cpu_attention.decode(q, k_cache, v_cache, g, out)
            continue
        b, lq, lk = g.n_seqs, g.q_len, g.ctx_len
        k = plan.scratch("k", (b, n_kv, lk, head_dim), k_cache)  # [B, kv, L, D]
        v = plan.scratch("v", (b, n_kv, lk, head_dim), v_cache)
        torch.index_select(k_rows, 0, g.head_rows, out=k.view(-1, head_dim))
        torch.index_select(v_rows, 0, g.head_rows, out=v.view(-1, head_dim))
        qg = q if g.rows is None else q.index_select(0, g.rows)  # [B * Q, heads, D]
        if lq == 1:
            qf = qg.view(b, n_kv, group, head_dim)
        else:  # [B, Q, kv, group, D] -> [B, kv, group * Q, D]
            qf = qg.view(b, lq, n_kv, group, head_dim).permute(0, 2, 3, 1, 4)
            qf = qf.reshape(b, n_kv, group * lq, head_dim)
        if k.dtype != qf.dtype:  # a 16-bit pool under float32 activations (--kv-dtype)
            k, v = k.to(qf.dtype), v.to(qf.dtype)
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=g.mask)
        if lq > 1:  # back to [B * Q, heads, D]
            o = o.view(b, n_kv, group, lq, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(b * lq, n_heads, head_dim)
        if g.valid is not None:
            o = o.index_select(0, g.valid)
        if g.out_rows is None:  # the only group, and it covers the step's rows in order
            return o
        if out is None:
            out = torch.empty_like(q)
        out.index_copy_(0, g.out_rows, o)
    assert out is not None, "a step has at least one row"
    return out
