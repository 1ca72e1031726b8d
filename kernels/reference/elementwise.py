"""The fused elementwise ops of a decoder layer in plain PyTorch: the oracle for the C++ kernels
(`kernels/cpu/elementwise.cpp`) and the path wherever they are not built.

Each function computes exactly what the op-by-op model computed before the fused kernels
existed (same operations, same order, same dtype roundings), so a model run on these is the
model the transformers parity tests were written against. Unlike the C++ ops they never
write into their inputs; callers use the returned tensors (`kernels/layer_ops.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference.attention import write_kv_cache_layers as _write_kv_layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm: the statistics in float32, then `weight * x.to(dtype)`."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta); `delta` None: no add."""
    if delta is not None:
        residual = residual + delta
    return rms_norm(residual, weight, eps), residual


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox (rotate-half) RoPE; `cos`/`sin` broadcast against x's last dimension."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope(
    qk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """qk [T, q_heads + k_heads, D]: Qwen3's per-head q/k RMSNorm (when given), then RoPE with
    the step's gathered tables (`cos`, `sin` [T, 1, D]). Returns a new tensor."""
    if q_norm is not None:
        qk = torch.cat((rms_norm(qk[:, :q_heads], q_norm, eps), rms_norm(qk[:, q_heads:], k_norm, eps)), dim=1)
    return rope(qk, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused [T, 2I] gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv(kv_data: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_data [L, 2, KVH, NB, BS, D]; k, v [L, T, KVH, D] to the flat slots [T]."""
    _write_kv_layers(kv_data, k, v, slots)
