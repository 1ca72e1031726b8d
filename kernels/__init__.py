"""Attention and KV-cache kernels.

Each op is a function with one contract (documented in `attention.py`); the per-step
inputs they read (`AttentionMetadata`, `DecodeBucket`, ...) are in `metadata.py`. The plain-PyTorch
implementations in `kernels.reference` are the CPU path and the ground truth that GPU Triton
kernels are tested against. `kernels.compiled` holds plain-PyTorch formulations written for
`torch.compile` to fuse, and `kernels.cpu` the C++ CPU kernels (built at first use for
the host's vector ISA); both are checked against the reference. `kernels.triton` holds the
GPU kernels (decode, prefill/extend, KV write), chosen by device in `attention.py` and
tested against the reference under Triton's interpreter. `kernels.reference.partial` is the
contract for K/V that are not in the pool (the hybrid cache's rebuilt K/V, partial
residency's transient prefix): partial attention with its log-sum-exp and an exact merge of
parts. `kernels.hidden` uses it for HIDDEN rows. `kernels.triton.partial` is its Triton form,
which `kernels.triton.hidden` and `kernels.triton.resident` use when the step's kernel is
`triton`.
"""

from kernels.attention import (
    DECODE_KERNELS,
    GRAPH_DECODE_KERNELS,
    decode_attention_with_new,
    decode_graph_context,
    paged_attention,
    prepare_decode_kernel,
    triton_unavailable,
    write_kv_cache,
    write_kv_cache_layers,
)
from kernels.hidden import HiddenBatch, HiddenSeq, hidden_attention
from kernels.metadata import (
    AttentionMetadata,
    DecodeBucket,
    DecodeChunks,
    HostPrefixKV,
    PrefillSpan,
    TransientSpan,
)
from kernels.reference.partial import attend_partial, merge_partials

__all__ = [
    "DECODE_KERNELS",
    "GRAPH_DECODE_KERNELS",
    "AttentionMetadata",
    "attend_partial",
    "merge_partials",
    "DecodeBucket",
    "DecodeChunks",
    "HiddenBatch",
    "HiddenSeq",
    "HostPrefixKV",
    "hidden_attention",
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
