"""A tensor-parallel rank's model: the Llama layer over its share of the weights (tp_shard.py),
with the collectives that make the ranks' shares one model.

::

    embedding   each rank looks up the ids in its vocabulary rows (zeros elsewhere) -> all-reduce
    attention   Q/K/V of its heads (column-parallel), attention over its share of every cell,
                O's columns of its heads (row-parallel) -> all-reduce
    MLP         gate/up rows of its slice (column-parallel), down's columns (row-parallel)
                -> all-reduce
    logits      the final norm (every rank holds the whole hidden row), its vocabulary columns
                -> gathered on rank 0, side by side, the padding cut off

Every rank ends each all-reduce with the same bits, so the residual stream is the same on all of
them. In exact mode the sum is taken in rank order (each rank's part gathered, then added
0 + 1 + ... + N-1), so a row's bits depend on the TP size and nothing else: two runs at the same
size agree bit for bit whatever runs beside them; another size groups the long sums into other
partial sums, so its bits differ (within float32's rounding of those sums). In normal mode the
backend's all-reduce does the sum (NCCL's ring on CUDA).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvpark.model.arch import ModelArch
from kvpark.model.llama import Block, LlamaModel
from kvpark.model.ops import KVCache, OpSet
from kvpark.model.ops.metadata import AttentionMetadata

Tensor = torch.Tensor


class Collectives:
    """The sums and gathers of a shard's forward, over ``group`` (torch.distributed's)."""

    def __init__(self, rank: int, world: int, exact: bool, group: Any = None) -> None:
        self.rank = rank
        self.world = world
        self.exact = exact
        self.group = group  # a ProcessGroup of the world's ranks; None: the default group

    def reduce(self, t: Tensor) -> Tensor:
        """The sum of every rank's ``t``, the same bits on every rank."""
        if self.world == 1:
            return t
        if not self.exact:
            dist.all_reduce(t, group=self.group)
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        out = parts[0]
        for part in parts[1:]:  # rank order: fixed for a TP size
            out = out + part
        return out

    def gather_columns(self, t: Tensor) -> Tensor | None:
        """Rank 0: every rank's ``t`` [rows, cols] side by side, [rows, world * cols], in rank
        order; the other ranks: None."""
        if self.world == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(t.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=1) if parts is not None else None


class ShardedLlama(LlamaModel):
    """One rank's shard: ``arch`` is the shard's (tp_shard.shard_arch), ``vocab`` the whole
    model's vocabulary."""

    def __init__(
        self,
        arch: ModelArch,
        dtype: torch.dtype,
        device: torch.device,
        *,
        comm: Collectives,
        vocab: int,
    ) -> None:
        super().__init__(arch, dtype, device)
        self.comm = comm
        self.vocab = vocab
        self.first_token = comm.rank * arch.vocab_size  # the first of its vocabulary rows
        for layer in self.layers:
            cast(Block, layer).reduce = comm.reduce

    def embed_rows(self, token_ids: Tensor) -> Tensor:
        """Each rank's rows of the ids it holds, zeros for the others, summed: the rows of the
        whole embedding, exactly (one term of each sum is not zero)."""
        local = token_ids - self.first_token
        mine = (local >= 0) & (local < self.arch.vocab_size)
        rows = F.embedding(local.clamp(0, self.arch.vocab_size - 1), self.embed)
        rows = torch.where(mine[:, None], rows, rows.new_zeros(()))
        return self.comm.reduce(rows)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv: KVCache,
        logit_rows: Tensor,  # [S] int64 rows whose logits are wanted
        ops: OpSet | None = None,
    ) -> Tensor:  # rank 0: [S, vocab] float32; the others: their columns [S, vocab / N]
        ops = ops or OpSet.default()
        x = self.layer_stack(token_ids, positions, meta, kv, ops)
        x = x.index_select(0, logit_rows)
        x = ops.rms_norm(x, self.norm, self.arch.rms_eps)
        local = ops.linear(x, self.lm_head, None).float()  # [S, vocab rows of this rank]
        if local.shape[0] == 0:  # no row sampled: every rank sees the same plan, none gathers
            return local.new_zeros((0, self.vocab))
        full = self.comm.gather_columns(local)
        if full is None:
            return local
        logits = full[:, : self.vocab]
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
