"""Paged decode attention by the C++ kernel (`decode.cpp`): the Python side.

Two entry points with the contracts of the other decode kernels:
- `decode(q, kv_cache, bucket, scale)`: the reference `_decode`'s contract (the step's own
  token is already in the cache), used by `paged_attention` for the decode rows of any step;
- `decode_with_new(q, k, v, kv_cache, context, scale)`: the compiled decoder layers' variant
  (`engine/models/decode_graph.py`), where the own token comes from the layer's fresh k, v
  and `context` (from `graph_context`) covers the cache only. The op is a registered torch
  op with a fake (meta) implementation, so Inductor calls it from inside a layer graph.

A bucket's direction bits travel inside the block table (a reversed block as `-(id + 1)`),
so the op has one shape of inputs whether or not a step holds BROS blocks, and a compiled
layer graph never recompiles for them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.cpu import build
from kernels.metadata import DecodeBucket

_native = None  # this CPU's ops once loaded: what the compiled layers call (no Python lookup traced)


def ops(target: str | None = None):
    """The `torch.ops` namespace of the kernels for `target` (default: this CPU's), built and
    loaded on first use, with the fake implementations Dynamo traces through."""
    global _native
    namespace = _load(target or build.target_for())
    if target is None:
        _native = namespace
    return namespace


@functools.cache
def _load(target: str | None):
    name = build.load(target)
    torch.library.register_fake(f"{name}::decode")(_decode_shape)
    return getattr(torch.ops, name)


def _decode_shape(q, kv_cache, block_table, ctx_lens, k_new, v_new, scale):
    return q.new_empty(q.shape)


def available(target: str | None = None) -> bool:
    """Whether the kernel builds and loads here (the error is raised by `ops`)."""
    try:
        ops(target)
    except build.KernelBuildError:
        return False
    return True


def signed_table(block_table: torch.Tensor, reversed: torch.Tensor | None) -> torch.Tensor:
    """The block table with each reversed block's id stored as -(id + 1), int64, contiguous."""
    table = block_table.to(torch.long)
    if reversed is not None:
        table = torch.where(reversed, -table - 1, table)
    return table.contiguous()


def decode(q: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket, scale: float) -> torch.Tensor:
    """Attention of one decode bucket (same contract as the reference `_decode`); the signed
    table is built on the step's first layer and kept in the bucket for the others."""
    table = bucket.prepared.get("cpp_table")
    if table is None:
        table = bucket.prepared["cpp_table"] = signed_table(bucket.block_table, bucket.reversed)
    return ops().decode(_last_dim_contiguous(q), kv_cache, table, bucket.context_lens(), None, None, scale)


def decode_with_new(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    context: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    namespace=None,
) -> torch.Tensor:
    """Decode attention over the cached context (`graph_context`) plus the step's own k, v
    ([S, kv_heads, D], not in the cache); a row may have no cached context."""
    table, lens = context
    op = (namespace or _native or ops()).decode  # ops() loaded before any graph is traced
    return op(_last_dim_contiguous(q), kv_cache, table, lens, _last_dim_contiguous(k), _last_dim_contiguous(v), scale)


def graph_context(bucket: DecodeBucket, seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed block table, context lengths) of `bucket` as a compiled layer graph takes
    them: `seqs` rows (the caller may double a lone sequence; Dynamo specialises size 1) and
    at least two table columns, both dimensions marked dynamic."""
    table = signed_table(bucket.block_table, bucket.reversed)
    lens = bucket.context_lens()
    if table.shape[0] < seqs:
        table, lens = table.expand(seqs, -1).contiguous(), lens.expand(seqs).contiguous()
    if table.shape[1] < 2:
        table = F.pad(table, (0, 2 - table.shape[1]))
    torch._dynamo.mark_dynamic(table, 0)
    torch._dynamo.mark_dynamic(table, 1)
    torch._dynamo.mark_dynamic(lens, 0)
    return table, lens


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
