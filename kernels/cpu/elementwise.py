"""The fused elementwise C++ ops (`elementwise.cpp`): the Python side.

They live in the same library as the decode attention kernel (one build per ISA target,
`build.py`), so loading one loads both. Contracts are in `elementwise.cpp`; the oracle is
`kernels/reference/elementwise.py`. The ops that take `residual` or `qk` change them in place.
"""

from __future__ import annotations

import torch

from kernels.cpu import decode


def ops(target: str | None = None):
    """The `torch.ops` namespace holding the ops for `target` (default: this CPU's)."""
    return decode.ops(target)


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, namespace=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual), residual) after `residual += delta` in place."""
    out = (namespace or ops()).add_rms_norm(residual, delta, weight, eps)
    return out, residual


def qk_norm_rope(
    qk: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    namespace=None,
) -> torch.Tensor:
    """qk [T, heads, D] normed (Qwen3) and rotated in place at `positions` from the full
    `cos`/`sin` tables [max_pos, D]; returns qk."""
    (namespace or ops()).qk_norm_rope(qk, positions, cos, sin, q_heads, q_norm, k_norm, eps)
    return qk


def silu_mul(gate_up: torch.Tensor, namespace=None) -> torch.Tensor:
    return (namespace or ops()).silu_mul(gate_up)


def write_kv(kv_data: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, namespace=None) -> None:
    (namespace or ops()).write_kv(kv_data, k, v, slots)
