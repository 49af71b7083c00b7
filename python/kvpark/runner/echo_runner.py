"""A toy ``kvpark.Runner`` that shows the plumbing of a custom runner without a neural network.

Its "model" predicts that text repeats: after a token it proposes whatever followed that token's
latest earlier occurrence in the sequence (the sequence's first token when there is none). Its "K/V
cache" holds one token id per cell. Everything else is what a real runner does: write each row at
its cell of the slot mapping, read a sequence's context through its page table, copy pages for
forks, save and restore cells for swap parks. Try it with
``kvpark serve --runner kvpark.runner.echo_runner:EchoRunner``.
"""

from __future__ import annotations

import torch

import kvpark
from kvpark.core import cells_of

CONFIDENCE = 30.0  # the predicted token's logit above the rest: sampling picks it (p > 1 - 1e-8)


class EchoRunner:
    """The class is its own factory: ``EchoRunner(config)`` builds the runner for a config."""

    model_name = "echo"
    # Each row's logits come from its own sequence's cells, in integers: nothing else in the step
    # can change them, so exact mode may run it.
    row_invariant = True

    def __init__(self, config: kvpark.EngineConfig) -> None:
        self.tokenizer = kvpark.load_tokenizer(config.model.model)  # None: the default model's
        self.vocab_size = self.tokenizer.vocab_size
        self.max_model_len = config.pool.kv_cells
        self.page_size = config.pool.page_size
        self.cells = torch.zeros(config.pool.kv_cells, dtype=torch.int64)  # cell -> token id

    def execute(self, plan: kvpark.StepPlan) -> torch.Tensor:
        size = self.page_size
        for src, dst in plan.page_copies:  # before anything reads the copies
            self.cells[dst * size : (dst + 1) * size] = self.cells[src * size : (src + 1) * size]
        tokens = [t for item in plan.items for t in item.token_ids]  # one per row, in row order
        self.cells[torch.tensor(plan.slot_mapping)] = torch.tensor(tokens)
        predicted: list[int] = []
        for item, table in zip(plan.items, plan.page_tables, strict=True):
            if item.sample:  # only the last row of an item is ever sampled
                end = item.start + len(item.token_ids)
                context = self.cells[torch.tensor(cells_of(table, size, 0, end))]
                predicted.append(self._next_token(context))
        logits = torch.zeros(len(predicted), self.vocab_size, dtype=torch.float32)
        best = torch.tensor(predicted, dtype=torch.int64)
        logits[torch.arange(len(predicted)), best] = CONFIDENCE
        return logits

    @staticmethod
    def _next_token(context: torch.Tensor) -> int:
        earlier = (context[:-1] == context[-1]).nonzero()
        return int(context[0] if len(earlier) == 0 else context[int(earlier[-1, 0]) + 1])

    # ------------------------------------------------------------ parking: a cell is one int64
    def bytes_per_cell(self) -> int:
        return self.cells.element_size()

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        return torch.empty(-(-n_bytes // self.cells.element_size()), dtype=self.cells.dtype)

    def save_cells(self, cells: list[int], out: torch.Tensor) -> None:
        out[: len(cells)] = self.cells[torch.tensor(cells, dtype=torch.int64)]

    def restore_cells(self, src: torch.Tensor, cells: list[int]) -> None:
        self.cells[torch.tensor(cells, dtype=torch.int64)] = src[: len(cells)]
