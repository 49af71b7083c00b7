"""The decoder of every architecture kvpark serves (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3,
Gemma 2/3, Phi-3): the Llama layer with ModelArch's switches, all of it in this file.

One forward runs one step: a flat batch of rows from several sequences (prompt chunks and decode
tokens alike). Each row's K and V go to its cell in the paged pool, then each row attends to its own
sequence's cells up to its position (``AttentionMetadata``). Weights use Hugging Face's layout with
Q/K/V fused into one matrix and gate/up into another, so a layer is four matmuls. Every op goes
through an ``OpSet`` so that exact mode can replace matmuls and attention. Attention that is not
plain (a sliding window, a score scale or soft-cap of its own: Gemma, Phi-3, Mistral) goes
through ``masked_attention`` instead of the set's kernels, in the set's row-invariance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kvpark.model.arch import ModelArch
from kvpark.model.moe import Experts
from kvpark.model.ops import BlockWeight, KVCache, OpSet, Weight
from kvpark.model.ops import masked_attention as masked
from kvpark.model.ops.metadata import AttentionMetadata
from kvpark.model.ops.rope import RopeTable
from kvpark.model.weight_names import MATRICES as _MATRICES

Tensor = torch.Tensor


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Block(nn.Module):
    """One transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self, arch: ModelArch, dtype: torch.dtype, device: torch.device, moe: bool = False
    ) -> None:
        super().__init__()
        a, hidden, d = arch, arch.hidden_size, arch.head_dim
        self.arch = arch
        self.attn_norm = _param((hidden,), dtype, device)
        # matrices are Weight: the loader may replace one by its GGUF blocks (torch_weights.py)
        self.qkv_w: Weight = _param((a.qkv_size, hidden), dtype, device)  # rows: q, k, v heads
        self.qkv_b = _param((a.qkv_size,), dtype, device) if a.qkv_bias else None
        self.o_w: Weight = _param((hidden, a.n_heads * d), dtype, device)
        self.o_b = _param((hidden,), dtype, device) if a.o_bias else None
        self.q_norm = _param((d,), dtype, device) if a.qk_norm else None
        self.k_norm = _param((d,), dtype, device) if a.qk_norm else None
        self.mlp_norm = _param((hidden,), dtype, device)
        # a dense MLP, or a mixture of experts (moe.py) in its place
        self.moe = Experts(a, dtype, device) if moe else None
        width = 0 if moe else a.intermediate_size
        self.gate_up_w: Weight = _param((2 * width, hidden), dtype, device)  # rows: gate, up
        self.down_w: Weight = _param((hidden, width), dtype, device)
        # Gemma: norms of the attention's and the MLP's outputs, before each residual add
        self.post_attn_norm = _param((hidden,), dtype, device) if a.sandwich_norms else None
        self.post_mlp_norm = _param((hidden,), dtype, device) if a.sandwich_norms else None
        # tensor parallel (tp_model.py): the sum over the ranks of the attention's and the MLP's
        # partial outputs (row-parallel products); None: the whole model is here
        self.reduce: Callable[[Tensor], Tensor] | None = None

    def forward(
        self,
        x: Tensor,  # [T, hidden]
        rope: tuple[Tensor, Tensor],  # cos, sin [T, 1, head_dim]
        k_cache: Tensor,  # [pages, page_size, kv_heads, head_dim]
        v_cache: Tensor,
        meta: AttentionMetadata,
        plan: object,  # ops.prepare_attention(meta, ...) or a MaskedPlan: built once per step
        ops: OpSet,
    ) -> Tensor:
        a = self.arch
        n_rows, nh, nkv, d = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
        h = ops.rms_norm(x, self.attn_norm, a.rms_eps)
        qkv = ops.linear(h, self.qkv_w, self.qkv_b)  # [T, (nh + 2 nkv) d]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head norm before rope
            q = ops.rms_norm(qkv[:, : nh * d].view(n_rows, nh, d), self.q_norm, a.rms_eps)
            k = ops.rms_norm(
                qkv[:, nh * d : (nh + nkv) * d].view(n_rows, nkv, d), self.k_norm, a.rms_eps
            )
            q, k = ops.rope(q, *rope), ops.rope(k, *rope)
        else:  # one rope call for the q and k heads together
            qk = ops.rope(qkv[:, : (nh + nkv) * d].view(n_rows, nh + nkv, d), *rope)
            q, k = qk[:, :nh], qk[:, nh:]  # [T, nh, d], [T, nkv, d]
        v = qkv[:, (nh + nkv) * d :].view(n_rows, nkv, d)  # [T, nkv, d]
        ops.store_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        if isinstance(plan, masked.MaskedPlan):
            att = masked.masked_attention(q, k_cache, v_cache, plan)
        else:
            att = ops.attention(q, k_cache, v_cache, plan)  # [T, nh, d]
        out = ops.linear(att.reshape(n_rows, nh * d), self.o_w, self.o_b)
        if self.reduce is not None:
            out = self.reduce(out)
        if self.post_attn_norm is not None:
            out = ops.rms_norm(out, self.post_attn_norm, a.rms_eps)
        x = x + out
        h = ops.rms_norm(x, self.mlp_norm, a.rms_eps)
        if self.moe is not None:
            out = self.moe(h, ops)
        else:
            gate_up = ops.linear(h, self.gate_up_w, None)  # [T, 2 * intermediate]
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if a.activation == "gelu_tanh" else F.silu(gate)
            out = ops.linear(act.mul_(up), self.down_w, None)
        if self.reduce is not None:
            out = self.reduce(out)
        if self.post_mlp_norm is not None:
            out = ops.rms_norm(out, self.post_mlp_norm, a.rms_eps)
        return x + out


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.embed = _param((arch.vocab_size, arch.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            Block(arch, dtype, device, arch.is_moe(i)) for i in range(arch.n_layers)
        )
        self.norm = _param((arch.hidden_size,), dtype, device)
        self.lm_head: Weight = (
            self.embed if arch.tie_embeddings else _param(self.embed.shape, dtype, device)
        )
        self.ropes = RopeTable.build_all(arch, None, device)  # [ModelArch.rope_table_of(layer)]
        # the token embedding kept as blocks (a GGUF's on the CPU): rows are dequantised where
        # they are looked up, bitwise the dense matrix's, and the dense matrix is never built
        # (113 MB for the default model); a tied head multiplies the same blocks
        self.embed_blocks: BlockWeight | None = None

    def set_block_dot(self, int8: bool) -> None:
        """Multiply every block matrix through int8 activations or float32 ones
        (``--block-dot``, BlockWeight.int8)."""
        tied = self.embed_blocks is not None and self.embed_blocks is self.lm_head
        for module, attr in [*self.matrix_slots(), (self, "lm_head")]:
            weight = getattr(module, attr)
            if isinstance(weight, BlockWeight):
                object.__setattr__(module, attr, replace(weight, int8=int8))
        if tied and isinstance(self.lm_head, BlockWeight):
            self.embed_blocks = self.lm_head

    def add_dense_copies(self, dtype: torch.dtype) -> None:
        """Give every layer's block matrix a dense copy in ``dtype``, for prompt chunks
        (``--prompt-path``); the head stays blocks alone (it sees only the sampled rows)."""
        for module, attr in self.matrix_slots():
            weight = getattr(module, attr)
            if isinstance(weight, BlockWeight):
                object.__setattr__(module, attr, weight.with_dense(dtype))

    def matrix_slots(self) -> list[tuple[nn.Module, str]]:
        """Every layer's matrix slots (module, attribute), a mixture's experts' included."""
        out: list[tuple[nn.Module, str]] = []
        for layer in self.layers:
            out += [(layer, a) for a in _MATRICES]
            moe = layer.moe
            if isinstance(moe, Experts):
                out += list(moe.matrices())
        return out

    def embed_rows(self, token_ids: Tensor) -> Tensor:
        """The embeddings of ``token_ids`` [T] -> [T, hidden] in the model's dtype."""
        if self.embed_blocks is None:
            return F.embedding(token_ids, self.embed)
        return self.embed_blocks.rows(token_ids).dequantize().to(self.dtype)

    # ---- one step ----

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv: KVCache,
        logit_rows: Tensor,  # [S] int64 rows whose logits are wanted
        ops: OpSet | None = None,
    ) -> Tensor:  # [S, vocab] float32
        ops = ops or OpSet.default()
        x = self.layer_stack(token_ids, positions, meta, kv, ops)
        x = x.index_select(0, logit_rows)  # [S, hidden]: the norm is row-wise, so select first
        x = ops.rms_norm(x, self.norm, self.arch.rms_eps)
        logits = ops.linear(x, self.lm_head, None).float()  # [S, vocab]
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def final_hidden(
        self,
        token_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv: KVCache,
        ops: OpSet | None = None,
    ) -> Tensor:  # [T, hidden] in the model's dtype
        """Every row's last hidden state after the final norm (what ``forward`` feeds the head):
        what ``/v1/embeddings`` pools (runner/embedding.py)."""
        ops = ops or OpSet.default()
        x = self.layer_stack(token_ids, positions, meta, kv, ops)
        return ops.rms_norm(x, self.norm, self.arch.rms_eps)

    def layer_stack(
        self, token_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv: KVCache, ops: OpSet
    ) -> Tensor:  # [T, hidden]: the rows through every layer, before the final norm
        a = self.arch
        x = self.embed_rows(token_ids)  # [T, hidden]
        if a.embed_scale != 1.0:  # Gemma: times sqrt(hidden), rounded to the model's dtype
            x = x * torch.tensor(a.embed_scale, dtype=x.dtype)
        ropes = [r.at(positions, self.dtype) for r in self.ropes]  # looked up once per step
        plans: dict[int | None, object] = {}
        for i, layer in enumerate(self.layers):
            window = a.window_of(i)
            # a sliding layer's cells may be a window space's (kv_cache.py)
            m = meta.window if window is not None and meta.window is not None else meta
            if window not in plans:
                plans[window] = (
                    ops.prepare_attention(m, a, kv.k[0].dtype)
                    if a.plain_attention
                    else masked.prepare(
                        m, window, a.attention_scale, a.attn_softcap, ops.row_invariant
                    )
                )
            rope = ropes[a.rope_table_of(i)]
            x = layer(x, rope, kv.k[i], kv.v[i], m, plans[window], ops)
        return x
