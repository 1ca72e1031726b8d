"""Paged attention: the contract between the model runner and the kernels.

The per-step inputs (`AttentionMetadata` and what it holds) are in `kernels/metadata.py`;
this module dispatches each op to the kernel that runs it.

KV cache layout, per layer: one tensor `[2, num_kv_heads, num_blocks, block_size,
head_dim]` (K then V; head-major, so a gather of blocks is directly a per-head matrix). A
token's *slot* is `block_id * block_size + offset`. New tokens are written by slot; reads
go through per-sequence block lists built by the runner from block tables, plus a direction
bit per block (BROS): a *reversed* block holds logical offset o at in-block slot
`block_size - 1 - o` (a BE request filling from the right end). Gathers return keys in
logical order whatever the directions, so the attention math (and its floating-point
summation order) is the same as for forward blocks.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from kernels.compiled import decode as _compiled
from kernels.cpu import decode as _cpu
from kernels.metadata import AttentionMetadata, DecodeBucket, DecodeChunks, PrefillSpan, TransientSpan
from kernels.reference import attention as _ref
from kernels.reference import resident as _resident

__all__ = [
    "DECODE_KERNELS",
    "GRAPH_DECODE_KERNELS",
    "AttentionMetadata",
    "DecodeBucket",
    "DecodeChunks",
    "PrefillSpan",
    "TransientSpan",
    "decode_attention_with_new",
    "decode_graph_context",
    "paged_attention",
    "prepare_decode_kernel",
    "triton_unavailable",
    "write_kv_cache",
    "write_kv_cache_layers",
]


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their slots."""
    write_kv_cache_layers(kv_cache.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), slot_mapping)


def write_kv_cache_layers(kv_data: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Every layer at once: kv_data is the whole cache `[layers, 2, kv_heads, blocks, block_size,
    head_dim]`, k and v are `[layers, T, kv_heads, head_dim]` (a compiled decode step's output)."""
    if kv_data.is_cuda and _triton_installed():
        _triton().write_kv_cache_layers(kv_data, k, v, slot_mapping)
    else:
        _ref.write_kv_cache_layers(kv_data, k, v, slot_mapping)


# The CPU decode kernels by name (`AttentionMetadata.decode_kernel`, `EngineConfig.attention`):
# "reference" gathers blocks then matmuls (kernels/reference; the oracle), "fused" is the same
# math compiled by Inductor (kernels/compiled/decode.py), "cpp" the C++ kernel (kernels/cpu/).
DECODE_KERNELS = ("reference", "fused", "cpp")
# Kernels that also run inside a compiled decoder layer (`decode_attention_with_new`).
GRAPH_DECODE_KERNELS = ("fused", "cpp")


def prepare_decode_kernel(kernel: str, kv_cache: torch.Tensor, num_heads: int, scale: float) -> None:
    """Make `kernel` ready before the first step: compile the Inductor kernel for this cache's
    shape, or build/load the C++ one. Raises (no compiler, a failed build) for the caller to
    fall back or fail."""
    if kernel == "fused":
        _compiled.warm_up(kv_cache, num_heads, scale)
    elif kernel == "cpp":
        _cpu.ops()
    elif kernel != "reference":
        raise ValueError(f"unknown decode kernel {kernel!r}; expected one of {', '.join(DECODE_KERNELS)}")


def decode_graph_context(kernel: str, bucket: DecodeBucket, seqs: int) -> tuple[torch.Tensor, ...]:
    """The per-step context tensors `decode_attention_with_new` takes, built once per step from a
    bucket of every decode row with lengths that exclude this step's token; `seqs` rows (a lone
    sequence may be doubled: Dynamo specialises size 1)."""
    if kernel == "cpp":
        return _cpu.graph_context(bucket, seqs)
    return _compiled.graph_chunks(bucket.chunks(_compiled.chunk_blocks(bucket.block_size)), seqs)


def decode_attention_with_new(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    context: tuple[torch.Tensor, ...],
    scale: float,
    kernel: str = "fused",
) -> torch.Tensor:
    """Decode attention for tracing inside a compiled layer: one query row per sequence (q
    [S, heads, D]) over its cached context, given as `decode_graph_context(kernel, ...)`, plus
    that token's own k, v ([S, kv_heads, D], not in the cache). Returns [S, heads, D]."""
    if kernel == "cpp":
        return _cpu.decode_with_new(q, k, v, kv_cache, context, scale)
    return _compiled.decode_with_new_math(q, k, v, kv_cache, *context, scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached and new tokens.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (already written to the cache).
    Returns [T, heads, head_dim]. Heads are grouped as in Hugging Face's `repeat_kv`:
    query head h reads KV head h // (heads // kv_heads).
    """
    if meta.decode_kernel == "triton":
        out = _triton().paged_attention(q, k, v, kv_cache, meta)
    elif meta.decode_kernel == "fused":
        out = _ref.paged_attention(q, k, v, kv_cache, meta, decode=_compiled.decode)
    elif meta.decode_kernel == "cpp":
        out = _ref.paged_attention(q, k, v, kv_cache, meta, decode=_cpu.decode)
    else:
        out = _ref.paged_attention(q, k, v, kv_cache, meta)
    if meta.transient:  # partial residency: rebuilt prefix + paged part, merged by the step's kernel
        if meta.decode_kernel == "triton":
            _triton().attend_transient(out, q, k, v, kv_cache, meta)
        else:
            _resident.attend_transient(out, q, k, v, kv_cache, meta.transient, meta.scale, meta.host_prefix)
    return out


# -- dispatch by device -------------------------------------------------------------------
# CUDA tensors go to the Triton kernels: the KV write always where Triton is installed (it
# has no metadata to say otherwise), attention when the engine resolved its kernel to
# "triton" (`attention` auto on CUDA; "reference" keeps the PyTorch oracle on any device).
# CPU tensors take the paths above, and Triton only when forced (`attention="triton"` under
# TRITON_INTERPRET=1, for tests; the KV write then stays the reference's). The step's kernel
# also decides for the forms whose K/V are not in the pool: eLLM's transient prefix (above)
# and the hybrid cache's HIDDEN rows (`kernels/hidden.py`, through `HiddenBatch.kernel`).


def triton_unavailable(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on `device` in this process, or None if they can."""
    if not _triton_installed():
        return "triton is not installed"
    return _triton().unavailable_reason(device)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton():
    """kernels.triton, imported on first use: Triton is a GPU (and test) dependency only."""
    from kernels import triton as triton_kernels

    return triton_kernels
