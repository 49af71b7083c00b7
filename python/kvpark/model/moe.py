"""A mixture of experts' MLP for the torch model (Qwen3-MoE): the router scores every expert for
each row, the ``experts_per_token`` best are picked, their softmax weights renormalised over the
picked ones where ``norm_topk``, and the row's output is the weighted sum of their SwiGLUs.

Rows are grouped by expert (each expert's matrices multiply all its rows at once); every op set's
``linear`` is row-invariant where the set is, and a row's sum runs over its own picks in
ascending expert order, so exact mode holds. The Rust decoder's mixture is decoder/moe.rs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvpark.model.arch import ModelArch
from kvpark.model.ops import OpSet, Weight

Tensor = torch.Tensor


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Expert(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        width, hidden = arch.expert_size, arch.hidden_size
        self.gate_up_w: Weight = _param((2 * width, hidden), dtype, device)  # rows: gate, up
        self.down_w: Weight = _param((hidden, width), dtype, device)


class Experts(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        self.router_w: Weight = _param((arch.n_experts, arch.hidden_size), dtype, device)
        self.experts = nn.ModuleList(Expert(arch, dtype, device) for _ in range(arch.n_experts))

    def matrices(self) -> Iterator[tuple[nn.Module, str]]:
        """Every matrix slot (module, attribute): what block-dot and dense-copy passes visit."""
        yield self, "router_w"
        for e in self.experts:
            yield e, "gate_up_w"
            yield e, "down_w"

    def forward(self, h: Tensor, ops: OpSet) -> Tensor:  # h [T, hidden] -> [T, hidden]
        a = self.arch
        logits = ops.linear(h, self.router_w, None).float()  # [T, experts]
        probs = torch.softmax(logits, dim=-1)
        # descending, ties to the lower index (the decoder's order)
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
        picked = order[:, : a.experts_per_token]  # [T, k]
        weights = probs.gather(1, picked)
        if a.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in torch.unique(picked).tolist():
            rows, slot = (picked == e).nonzero(as_tuple=True)
            expert = self.experts[e]
            gate_up = ops.linear(h.index_select(0, rows), expert.gate_up_w, None)
            gate, up = gate_up.chunk(2, dim=-1)
            y = ops.linear(F.silu(gate).mul_(up), expert.down_w, None)
            out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(1).to(y.dtype))
        return out
