"""What one step's rows mean to attention: which sequence each row belongs to and where its cells
are.

``runner/batch.py`` builds one :class:`AttentionMetadata` per step from the scheduler's plan; the
model passes it unchanged to every attention layer. Rows of a step are grouped by sequence, in
order: sequence ``b`` owns rows ``query_start[b]:query_start[b + 1]``, and those rows sit at the
last positions of its context (``context_lens[b] - n_rows_b .. context_lens[b] - 1``). A prompt
chunk and a decode token are the same thing here: rows catching up with the sequence's known tokens.

Cell layout: a cell's flat index is ``page * page_size + offset``; the KV tensors of one layer are
``[n_pages, page_size, kv_heads, head_dim]`` and so view as ``[n_cells, kv_heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cell index that receives each row's K and V
    query_start: list[int]  # [B + 1]: row ranges per sequence, query_start[0] == 0, [-1] == T
    context_lens: list[int]  # [B]: cells each sequence attends to once this step's rows are stored
    cell_index: (
        torch.Tensor
    )  # [B, max(context_lens)] int64: each sequence's cells in logical order, 0-padded
    max_query_len: int  # max rows of one sequence in this step (1 for a pure decode step)
    # the sliding layers' cells where they keep a window space of their own (the plan's window
    # slot mapping and page tables): what those layers write and read instead
    window: AttentionMetadata | None = None

    @property
    def n_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def n_rows(self) -> int:
        return self.query_start[-1]
