"""A second runner, written only against kvpark's public runner protocol: Hugging Face transformers'
Llama with its own paged K/V tensors (tests/runner/test_custom_runner.py drives it through the
engine).

Each step runs its items one at a time: gather the sequence's past K/V from the paged tensors
through the item's page table into a transformers cache, run the item's rows at their positions,
and write what the attention layers add to the cache (the rows' K after rope, and V) at the rows'
cells of the slot mapping. float32, one sequence at a time: the point is the protocol, not speed.

    paged K (per layer)  [kv_cells, kv_heads, head_dim]     cell = page * page_size + offset
    transformers cache   [1, kv_heads, positions, head_dim] positions 0 .. start-1, then the rows
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers

import kvpark
from kvpark.core import cells_of


def load_hf_llama(gguf_path: str) -> Any:
    """The GGUF through transformers' own GGUF support, in float32 (as
    tests/model/test_model_parity.py)."""
    # transformers rebuilds gguf's tensor-name table once per module; it is a pure function of its
    # arguments, so caching it saves a third of the load time.
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        path = Path(gguf_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


class _Capture(transformers.DynamicCache):  # type: ignore[misc]
    """A transformers cache that also keeps what each layer appends during one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.added: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *a: Any,
        **k: Any,
    ) -> Any:
        self.added[layer_idx] = (key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *a, **k)


class HFRunner:
    """A ``kvpark.Runner`` around a transformers causal LM (Llama family)."""

    # transformers' matmuls and attention change with the step's shapes: no bit-for-bit promise
    row_invariant = False

    def __init__(
        self, model: Any, tokenizer: kvpark.Tokenizer, config: kvpark.EngineConfig, name: str
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = name
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = int(cfg.max_position_embeddings)
        self.page_size = config.pool.page_size
        heads = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (config.pool.kv_cells, heads, head_dim)
        self.k = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
        # transformers 5 renamed past_key_values to cache (the old name warns)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def execute(self, plan: kvpark.StepPlan) -> torch.Tensor:
        size = self.page_size
        for src, dst in plan.page_copies:
            for layer in (*self.k, *self.v):
                layer[dst * size : (dst + 1) * size] = layer[src * size : (src + 1) * size]
        logits: list[torch.Tensor] = []
        row = 0
        for item, table in zip(plan.items, plan.page_tables, strict=True):
            n = len(item.token_ids)
            last = self._run_item(item, table, plan.slot_mapping[row : row + n])
            row += n
            if item.sample:
                logits.append(last)
        if not logits:
            return torch.empty(0, self.vocab_size)
        return torch.stack(logits)

    def _run_item(self, item: kvpark.StepItem, table: list[int], cells: list[int]) -> torch.Tensor:
        """Run one item's rows; the logits of its last row, float32 [vocab]."""
        cache = _Capture()
        if item.start > 0:
            past = torch.tensor(cells_of(table, self.page_size, 0, item.start))
            for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
                # [positions, heads, dim] -> [1, heads, positions, dim]
                cache.update(k[past].transpose(0, 1)[None], v[past].transpose(0, 1)[None], layer)
            cache.added.clear()
        n = len(item.token_ids)
        out = self.model(
            input_ids=torch.tensor([item.token_ids]),
            position_ids=torch.arange(item.start, item.start + n)[None],
            use_cache=True,
            **{self._cache_arg: cache},
        )
        rows = torch.tensor(cells)
        for layer, (k, v) in cache.added.items():
            self.k[layer][rows] = k[0].transpose(0, 1)
            self.v[layer][rows] = v[0].transpose(0, 1)
        return out.logits[0, -1].float()

    # ------------------------------------------------------------ parking
    def bytes_per_cell(self) -> int:
        per_layer = self.k[0][0].numel() * self.k[0].element_size()
        return 2 * len(self.k) * per_layer

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        return torch.empty(-(-n_bytes // 4), dtype=torch.float32)

    def _view(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """The buffer as [2 * layers, n, heads, head_dim]: K and V of layer l at 2l and 2l + 1."""
        _, heads, dim = self.k[0].shape
        return buf[: 2 * len(self.k) * n * heads * dim].view(2 * len(self.k), n, heads, dim)

    def save_cells(self, cells: list[int], out: torch.Tensor) -> None:
        idx = torch.tensor(cells)
        view = self._view(out, len(cells))
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            view[2 * layer] = k[idx]
            view[2 * layer + 1] = v[idx]

    def restore_cells(self, src: torch.Tensor, cells: list[int]) -> None:
        idx = torch.tensor(cells)
        view = self._view(src, len(cells))
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k[idx] = view[2 * layer]
            v[idx] = view[2 * layer + 1]
