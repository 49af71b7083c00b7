"""One prompt's embedding for ``/v1/embeddings``: its last hidden state (after the final norm),
mean-pooled over its tokens and L2-normalised.

The forward is the model's own (``LlamaModel.final_hidden``, the layers a step runs), over one
sequence at positions ``0 .. n-1``, writing its K/V into a temporary cache of its own that is
dropped on return: the pool's cells are never touched, so the requests running beside it keep
their state and no cell is ever held for an embedding. The engine calls it between steps, on its
own thread (engine/async_engine.py), so it never runs concurrently with a step on the model.

::

    token ids [n] ──► layers (temporary K/V: n cells, own pages) ──► final norm [n, hidden]
                  ──► mean over the n rows (float32) ──► / ||.||2 ──► [hidden] float32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpark.model.llama import LlamaModel
from kvpark.model.ops import KVCache, OpSet
from kvpark.model.ops.metadata import AttentionMetadata


@torch.inference_mode()
def embed_tokens(
    model: LlamaModel,
    ops: OpSet,
    token_ids: list[int],
    page_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The normalised mean-pooled embedding of ``token_ids``: float32 ``[hidden]`` on the CPU."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("an embedding needs at least one token")
    pages = -(-n // page_size)
    kv = KVCache.allocate(model.arch, pages, page_size, kv_dtype, device)
    cells = torch.arange(n, dtype=torch.int64, device=device)  # the cache is this prompt's alone
    meta = AttentionMetadata(
        slot_mapping=cells,
        query_start=[0, n],
        context_lens=[n],
        cell_index=cells[None],
        max_query_len=n,
    )
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    hidden = model.final_hidden(ids, cells, meta, kv, ops)  # [n, hidden]; positions == cells
    # float32 whatever the model's dtype: the mean of n rows is one more sum to keep accurate
    pooled = hidden.float().mean(dim=0)
    return F.normalize(pooled, dim=0).cpu()
