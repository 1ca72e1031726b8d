"""`--kv-heads-expand`: a grouped-query model rewritten as the same function with MHA's memory shape.

In grouped-query attention (GQA) query head `h` reads KV head `h // group`. Repeating every
KV head's rows of the K and V projections `group` times, in place, gives a model with
`num_kv_heads == num_heads` whose query head `h` reads a copy of exactly the K/V it read
before: the same function, with multi-head attention's KV memory (`2·heads·head_dim` per
token per layer). Apt-Serve's hidden cache saves memory only for such models (the hidden row
`d` is half of MHA's K+V, 1.5x *more* than SmolLM2's GQA K+V), so the expanded default model is
the real MHA model this machine can test and measure the hybrid cache with
(`docs/aptserve.md`).

Done on the loaded model (either load format), before weights are packed: the fused QKV
projection is rebuilt with the repeated rows (and bias rows). Per-head K norms (Qwen3) act on
`head_dim` and are shared by all heads, so they need nothing. OPT is multi-head already.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from engine.config import ModelConfig

log = logging.getLogger(__name__)


def expand_kv_heads(model: nn.Module, config: ModelConfig) -> ModelConfig:
    """Rewrite `model` (loaded, not yet packed) so each KV head is repeated for its query
    heads; returns the config with `num_kv_heads = num_heads` (also set on `model.config`)."""
    group, rest = divmod(config.num_heads, config.num_kv_heads)
    if rest:
        raise ValueError(f"{config.num_heads} query heads do not share {config.num_kv_heads} KV heads evenly")
    if group == 1:
        log.info("kv_heads_expand: %s already has one KV head per query head; nothing to expand", config.name)
        return config
    if config.architecture != "llama":
        raise ValueError(f"kv_heads_expand supports grouped-query Llama-family models, not {config.architecture!r}")
    for layer in model.layers:
        _expand_attention(layer.self_attn, group)
    expanded = replace(config, num_kv_heads=config.num_heads)
    model.config = expanded
    log.info(
        "kv_heads_expand: %d KV heads repeated %dx to %d (MHA memory shape, same outputs)",
        config.num_kv_heads,
        group,
        config.num_heads,
    )
    return expanded


def _expand_attention(attn: nn.Module, group: int) -> None:
    """Repeat the K and V rows of `attn.qkv_proj` (layout [q | k | v], head-major) `group` times."""
    old = attn.qkv_proj
    q_size, kv_size, head_dim = attn.q_size, attn.kv_size, attn.head_dim

    def expand(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t.split([q_size, kv_size, kv_size], dim=0)
        rep = [x.unflatten(0, (-1, head_dim)).repeat_interleave(group, dim=0).flatten(0, 1) for x in (k, v)]
        return torch.cat([q, *rep], dim=0)

    new = nn.Linear(old.in_features, q_size + 2 * kv_size * group, bias=old.bias is not None)
    new = new.to(device=old.weight.device, dtype=old.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        new.weight.copy_(expand(old.weight))
        if old.bias is not None:
            new.bias.copy_(expand(old.bias))
    attn.qkv_proj = new
    attn.num_kv_heads *= group
    attn.kv_size *= group
