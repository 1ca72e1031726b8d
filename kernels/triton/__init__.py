"""Triton kernels for the GPU: paged attention (decode and prefill/extend) and the KV write.

Same contracts as the PyTorch reference in `kernels/reference/attention.py`, which stays the
oracle. CUDA tensors run compiled kernels; CPU tensors run only under Triton's interpreter
(`TRITON_INTERPRET=1` set before this package is imported: Triton decides at decoration time),
which is how CI checks the kernels without a GPU. The interpreter is slow (each program is
Python over NumPy) and exists for tests, not serving.

Modules: `kv_write` (slots), `decode` (split-K decode + merge), `extend` (prefill with a cached
prefix), `partial` (attention over dense K/V with its log-sum-exp, and the merge of parts:
the contract of `kernels/reference/partial.py`), `common` (paged addressing, online softmax),
`plan` (the step's metadata in kernel form, built once per step), `tiles` (tile sizes per
target), `hidden` (the hybrid cache's HIDDEN rows) and `resident` (eLLM's transient prefix
merged with the paged suffix).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kernels.triton import kv_write as _kv_write
from kernels.triton.decode import decode as _decode
from kernels.triton.extend import extend as _extend
from kernels.triton.plan import step_plan
from kernels.triton.resident import attend_transient as _attend_transient
from kernels.triton.tiles import TileConfig, tile_config

if TYPE_CHECKING:
    from kernels import AttentionMetadata

# Whether the kernels above were decorated for the interpreter (read once, as Triton does).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on `device` in this process, or None if they can."""
    device = torch.device(device)
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device"
    if device.type == "cpu":
        if not INTERPRETED:
            return "Triton runs on CPU tensors only under its interpreter (TRITON_INTERPRET=1 before start; tests only)"
        return _interpreter_problem()
    return f"no Triton kernels for device type {device.type!r}"


def _interpreter_problem() -> str | None:
    """Triton's own `@jit` helpers (tl.max, tl.sum...) were decorated when Triton was first
    imported; if that was before TRITON_INTERPRET=1, the interpreter cannot call them."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(standard.max, InterpretedFunction):
        return None
    return "triton was imported before TRITON_INTERPRET=1 was set: set it before anything imports triton"


def _check(device: torch.device) -> None:
    reason = unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(reason)


def write_kv_cache_layers(kv_data: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Contract of `kernels.attention.write_kv_cache_layers`."""
    _check(kv_data.device)
    _kv_write.write_kv_cache_layers(kv_data, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """Contract of `kernels.attention.paged_attention`; `tiles` overrides the device's tile sizes (tests)."""
    _check(kv_cache.device)
    tiles = tiles or tile_config(kv_cache.device)
    tokens, heads, head_dim = q.shape
    _, kv_heads, _, block_size, _ = kv_cache.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("the kernels need head_dim contiguous in q, k, v and the cache")
    plan = step_plan(meta, heads, kv_heads, head_dim, block_size, tiles)
    fp32_dot = INTERPRETED or kv_cache.dtype == torch.float32
    # The interpreter rounds float32 -> bfloat16 by truncation; keep its output float32 and
    # let PyTorch round (to nearest even, as the GPU's cast does).
    out_dtype = torch.float32 if INTERPRETED else q.dtype
    out = torch.empty(tokens, heads, head_dim, dtype=out_dtype, device=q.device)
    for decode_plan in plan.decodes:
        _decode(q, kv_cache, out, decode_plan, meta.scale, tiles, fp32_dot)
    if plan.extend is not None:
        _extend(q, k, v, kv_cache, out, plan.extend, meta.scale, tiles, fp32_dot)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def attend_transient(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    tiles: TileConfig | None = None,
) -> None:
    """Contract of `kernels.reference.resident.attend_transient` (rows of `meta.transient`)."""
    _check(kv_cache.device)
    _attend_transient(out, q, k, v, kv_cache, meta, tiles)
