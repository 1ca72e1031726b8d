"""Llama-family decoder (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norms, SmolLM2).

Runs on a flattened batch: `input_ids` and `positions` are [T] over all sequences of the
step; attention finds each token's sequence through `AttentionMetadata`. Q/K/V and
gate/up projections are fused (one matmul each) since per-op overhead dominates on CPU.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    linear_rows,
    load_checkpoint,
    output_logits,
)
from kernels import AttentionMetadata, decode_attention_with_new, hidden_attention, paged_attention
from kernels.layer_ops import TORCH_LAYER_OPS, LayerOps

KVCache = torch.Tensor  # one layer's [2, kv_heads, num_blocks, block_size, head_dim]


class LlamaAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.o_proj_bias)
        self.qk_norm = c.qk_norm
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, rope: tuple, meta: AttentionMetadata, cache: KVCache, ops: LayerOps) -> torch.Tensor:
        """`rope`: the step's `ops.rope_tables(...)`."""
        q, k, v = self._qkv(x, rope, ops)
        ops.write_kv(cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, cache, meta)
        if meta.hidden is not None:  # hybrid cache: HIDDEN rows store x and attend over K/V rebuilt from it
            hidden_attention(out, q, k, v, x, cache, meta.hidden, self.rebuild_kv, meta.scale, meta.decode_kernel)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))  # a kernel may return a strided view

    def rebuild_kv(self, x, cos, sin):
        """K, V of stored layer inputs `x` at their own positions (the hybrid cache): the K/V
        rows of the QKV projection, Qwen3's k-norm, RoPE."""
        t = x.shape[0]
        k, v = linear_rows(self.qkv_proj, x, self.q_size).split(self.kv_size, dim=-1)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v.reshape(t, self.num_kv_heads, self.head_dim)

    def decode(self, x, cos, sin, cache: KVCache, context, scale: float, kernel: str):
        """Decode-only step without touching the cache (see models/decode_graph.py): returns
        the output and this step's k, v for the caller to write. `context` is the step's
        `kernels.decode_graph_context` for the decode `kernel`."""
        q, k, v = self._qkv(x, (cos, sin), TORCH_LAYER_OPS)  # PyTorch ops: Inductor fuses them
        out = decode_attention_with_new(q, k, v, cache, context, scale, kernel)
        # reshape: with one query head per KV head (MHA, kv_heads_expand) the kernel's output is a strided view
        return self.o_proj(out.reshape(x.shape[0], self.q_size)), k, v

    def _qkv(self, x, rope: tuple, ops: LayerOps):
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        # q and k heads are adjacent: normed (Qwen3) and rotated in one op
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        eps = self.q_norm.eps if self.qk_norm else 0.0
        qk = ops.qk_norm_rope(qk, rope, self.num_heads, *norms, eps)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.inter = c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_LAYER_OPS) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = LlamaMLP(c)

    def forward(self, x, residual, rope, meta, cache, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately (vLLM's form) so each residual add fuses
        with the norm after it: in, this layer's input is `x + residual` (`residual` None: `x`
        alone, the first layer); out, (the MLP's output, the residual before it)."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        h, residual = (
            ops.add_rms_norm(x, None, ln1.weight, ln1.eps)
            if residual is None
            else ops.add_rms_norm(residual, x, ln1.weight, ln1.eps)
        )
        h = self.self_attn(h, rope, meta, cache, ops)
        h, residual = ops.add_rms_norm(residual, h, ln2.weight, ln2.eps)
        return self.mlp(h, ops), residual

    def decode(self, x, cos, sin, cache, context, scale: float, kernel: str):
        """`forward` for a decode-only step, as one compiled graph: returns (x, k, v)."""
        out, k, v = self.self_attn.decode(self.input_layernorm(x), cos, sin, cache, context, scale, kernel)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: ModelConfig, max_positions: int, ops: LayerOps = TORCH_LAYER_OPS) -> None:
        """`ops`: the layers' elementwise ops (kernels/layer_ops.py), chosen at engine start."""
        super().__init__()
        self.config = c
        self.ops = ops
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c, max_positions)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata, caches: list[KVCache]) -> torch.Tensor:
        ops = self.ops
        x = self.embed_tokens(input_ids)
        rope = ops.rope_tables(*self.rotary.tables(x.dtype), positions)
        residual = None
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if meta.wait_layer is not None:  # layer i's KV may still be arriving
                meta.wait_layer(i)
            x, residual = layer(x, residual, rope, meta, cache, ops)
        return x if residual is None else x + residual

    def layer_inputs(self, input_ids, positions) -> tuple[torch.Tensor, ...]:
        """The embedded tokens and the per-token arguments every layer takes (RoPE tables)."""
        x = self.embed_tokens(input_ids)
        return (x, *self.rotary.cos_sin(positions, x.dtype))

    def position_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What `rebuild_kv` needs per token besides x (the hybrid cache): RoPE tables."""
        return self.rotary.cos_sin(positions, self.embed_tokens.weight.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return output_logits(self.norm(hidden), self.lm_head, self.embed_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, lambda name: _map_name(name, self.config))


_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_SHARD_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


def _map_name(name: str, c: ModelConfig) -> tuple[str | None, int | None]:
    """HF checkpoint name -> (our parameter name, row offset for fused shards)."""
    if "rotary_emb.inv_freq" in name:
        return None, None
    if name == "lm_head.weight" and c.tie_word_embeddings:
        return None, None
    name = name.removeprefix("model.")
    m = _SHARD_RE.search(name)
    if not m:
        return name, None
    fused, index = _SHARDS[m.group(1)]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    offset = [0, q, q + kv][index] if fused == "qkv_proj" else index * c.intermediate_size
    return name.replace(f".{m.group(1)}.", f".{fused}."), offset
