"""Building blocks shared by the model families."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from kernels.reference.elementwise import rms_norm, rope


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 like Hugging Face's for bit-compatible outputs."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole [max_positions, D] cos and sin tables in `dtype` (the model's: no copy)."""
        return self.cos.to(dtype), self.sin.to(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] tables for the step's positions, shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def output_logits(hidden: torch.Tensor, lm_head: nn.Module | None, embedding: nn.Embedding) -> torch.Tensor:
    """Float32 logits from the output head; `lm_head` None means tied to the embedding (a packed
    model has its own head module for it: see packed_linear.py)."""
    logits = F.linear(hidden, embedding.weight) if lm_head is None else lm_head(hidden)
    return logits.float()


def linear_rows(linear: nn.Module, x: torch.Tensor, start: int) -> torch.Tensor:
    """Output features `start:` of `linear(x)` (the K/V part of a fused QKV projection, for the
    hybrid cache's rebuild): only those rows are computed when the weight is a plain matrix; a
    packed weight (packed_linear.py) computes all and slices."""
    if isinstance(linear, nn.Linear):
        bias = None if linear.bias is None else linear.bias[start:]
        return F.linear(x, linear.weight[start:], bias)
    return linear(x)[:, start:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rope(x, cos, sin)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths scaled, short kept, smooth between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: Callable[[str], tuple[str | None, int | None]],
) -> None:
    """Copy checkpoint tensors into `model`, every parameter exactly covered.

    `map_name` turns a checkpoint name into (our parameter name or None to skip, row offset
    inside a fused parameter or None). Unknown names and missing parameters are errors, so a
    checkpoint of the wrong shape family fails loudly instead of running with random weights.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target, offset = map_name(name)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[target].data
        if offset is not None:  # one shard (e.g. k_proj) of a fused parameter
            param = param[offset : offset + tensor.shape[0]]
        param.copy_(tensor)
        loaded.add(target)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
