"""Attention and KV-cache kernels.

Each op is a function with one contract (documented in `attention.py`). The plain-PyTorch
implementations in `kernels.reference` are the CPU path and the ground truth that GPU Triton
kernels are tested against. `kernels.compiled` holds plain-PyTorch formulations written for
`torch.compile` to fuse: the fast CPU decode path, checked against the reference.
`kernels.triton` holds the GPU kernels (decode, prefill/extend, KV write), chosen by device
in `attention.py` and tested against the reference under Triton's interpreter.
`kernels.reference.partial` is the contract for K/V that are not in the pool (the hybrid
cache's rebuilt K/V, partial residency's transient prefix): partial attention with its
log-sum-exp and an exact merge of parts.
"""

from kernels.attention import (
    AttentionMetadata,
    DecodeBucket,
    PrefillSpan,
    TransientSpan,
    decode_attention_with_new,
    paged_attention,
    triton_unavailable,
    write_kv_cache,
    write_kv_cache_layers,
)
from kernels.reference.partial import attend_partial, merge_partials

__all__ = [
    "AttentionMetadata",
    "attend_partial",
    "merge_partials",
    "DecodeBucket",
    "PrefillSpan",
    "TransientSpan",
    "decode_attention_with_new",
    "paged_attention",
    "triton_unavailable",
    "write_kv_cache",
    "write_kv_cache_layers",
]
