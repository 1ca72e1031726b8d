"""OPT decoder (the Apt-Serve papers' family): learned positions (offset 2), biases
everywhere, ReLU MLP, pre-LN (or post-LN for OPT-350m), multi-head attention, optional
embedding projections, tied LM head."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.layers import linear_rows, load_checkpoint, output_logits
from kernels import AttentionMetadata, hidden_attention, paged_attention
from kernels.layer_ops import TORCH_LAYER_OPS, LayerOps

_POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


class OPTAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.size = c.num_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, 3 * self.size, bias=True)
        self.out_proj = nn.Linear(self.size, c.hidden_size, bias=True)

    def forward(self, x, meta: AttentionMetadata, cache, ops: LayerOps) -> torch.Tensor:
        """`ops`: only the KV write applies to OPT (its LayerNorm and ReLU are single PyTorch ops)."""
        t = x.shape[0]
        q, k, v = (y.view(t, self.num_heads, self.head_dim) for y in self.qkv_proj(x).split(self.size, dim=-1))
        ops.write_kv(cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, cache, meta)
        if meta.hidden is not None:  # hybrid cache: HIDDEN rows store x and attend over K/V rebuilt from it
            hidden_attention(out, q, k, v, x, cache, meta.hidden, self.rebuild_kv, meta.scale, meta.decode_kernel)
        return self.out_proj(out.reshape(t, self.size))  # a kernel may return a strided view

    def rebuild_kv(self, x):
        """K, V of stored layer inputs `x` (the hybrid cache). What is stored is the tensor this
        module receives, i.e. what enters qkv_proj: the self-attention layer norm's output for
        pre-LN OPT, the raw residual stream for post-LN OPT-350m; the learned positions are
        already in it, so nothing else is reapplied."""
        t = x.shape[0]
        k, v = linear_rows(self.qkv_proj, x, self.size).split(self.size, dim=-1)
        return k.reshape(t, self.num_heads, self.head_dim), v.reshape(t, self.num_heads, self.head_dim)


class OPTDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.pre_ln = c.do_layer_norm_before
        self.self_attn = OPTAttention(c)
        self.self_attn_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.final_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.act = {"relu": F.relu, "gelu": F.gelu}[c.hidden_act]

    def forward(self, x, meta, cache, ops: LayerOps) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_ln else x
        x = x + self.self_attn(h, meta, cache, ops)
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_ln else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_ln else self.final_layer_norm(x)


class OPTForCausalLM(nn.Module):
    def __init__(self, c: ModelConfig, max_positions: int, ops: LayerOps = TORCH_LAYER_OPS) -> None:
        """`ops`: the layers' elementwise ops (kernels/layer_ops.py), chosen at engine start."""
        super().__init__()
        self.config = c
        self.ops = ops
        proj = c.word_embed_proj_dim or c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, proj)
        self.embed_positions = nn.Embedding(c.max_position_embeddings + _POSITION_OFFSET, c.hidden_size)
        self.project_in = nn.Linear(proj, c.hidden_size, bias=False) if proj != c.hidden_size else None
        self.project_out = nn.Linear(c.hidden_size, proj, bias=False) if proj != c.hidden_size else None
        self.layers = nn.ModuleList(OPTDecoderLayer(c) for _ in range(c.num_layers))
        # OPT-350m (post-LN) has no final layer norm
        self.final_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.rms_norm_eps) if c.do_layer_norm_before else None
        self.lm_head: nn.Module | None = None  # OPT always ties the output head to the embedding

    def forward(self, input_ids, positions, meta: AttentionMetadata, caches) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + _POSITION_OFFSET)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if meta.wait_layer is not None:  # layer i's KV may still be arriving
                meta.wait_layer(i)
            x = layer(x, meta, cache, self.ops)
        return x

    def position_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Nothing per token for `rebuild_kv`: positions are inside the stored inputs."""
        return ()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return output_logits(hidden, self.lm_head, self.embed_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, self._map_name)

    def _map_name(self, name: str) -> tuple[str | None, int | None]:
        if name == "lm_head.weight":
            return None, None  # tied to embed_tokens
        name = name.removeprefix("model.").removeprefix("decoder.")
        for i, shard in enumerate(("q_proj", "k_proj", "v_proj")):
            if f".{shard}." in name:
                size = self.config.num_heads * self.config.head_dim
                return name.replace(f".{shard}.", ".qkv_proj."), i * size
        return name, None
