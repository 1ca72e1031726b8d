"""Attention for a partially resident request (eLLM): its oldest tokens' K/V rebuilt this step
(transient, in the step's own rows), the rest paged, merged exactly by log-sum-exp.

`paged_partial` is paged attention that returns `(out, lse)` over a request's resident
entries only: its block list keeps logical indexing, with empty entries (block id 0) for the
non-resident prefix, and it skips them by starting at the first resident position. Masking
is causal by absolute position (`attend_partial`), so the same call serves a decode row and a
prefill chunk whose own new tokens are already in the cache.

`attend_transient` fills the output rows of every `TransientSpan` of the step: the span's
query rows over the rebuilt prefix's K/V (this layer's rows `prefix_start ..`, or for a
host-kept prefix the rows of this layer's `HostPrefixKV` scratch) and over its paged part,
merged by `merge_partials` (the one merge, shared with the hybrid cache), cast back to the
model's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.reference.attention import gather_blocks
from kernels.reference.partial import attend_partial, merge_partials

if TYPE_CHECKING:
    from kernels.metadata import HostPrefixKV, TransientSpan


def paged_partial(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    resident_from: int,
    kv_len: int,
    q_pos0: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q` `[q_len, heads, D]` at positions q_pos0.. over the cached keys at positions
    `[resident_from, kv_len)` of a request whose logical blocks are `block_ids` (entries before
    `resident_from // block_size` are empty and not read). Returns float32 `(out, lse)` as
    `attend_partial` does."""
    block_size = kv_cache.shape[3]
    first = resident_from // block_size
    keys, values = gather_blocks(kv_cache, block_ids[first:])  # each [kv_heads, n * bs, D]
    skip = resident_from - first * block_size
    k = keys[:, skip : kv_len - first * block_size].transpose(0, 1)
    v = values[:, skip : kv_len - first * block_size].transpose(0, 1)
    return attend_partial(q, k, v, q_pos0=q_pos0, k_pos0=resident_from, scale=scale)


def attend_transient(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    spans: list[TransientSpan],
    scale: float,
    host: HostPrefixKV | None = None,
) -> None:
    """Write the attention of every transient span's query rows into `out` (in place);
    `host`: this layer's K/V of the host-kept prefixes (spans with `from_host`)."""
    for span in spans:
        rows = slice(span.q_start, span.q_start + span.q_len)
        prefix = slice(span.prefix_start, span.prefix_start + span.prefix_len)
        qs = q[rows]
        pk, pv = (host.keys, host.values) if span.from_host else (k, v)
        rebuilt = attend_partial(qs, pk[prefix], pv[prefix], q_pos0=span.ctx_len, k_pos0=0, scale=scale)
        paged = paged_partial(
            qs,
            kv_cache,
            span.block_ids,
            resident_from=span.prefix_len,
            kv_len=span.ctx_len + span.q_len,
            q_pos0=span.ctx_len,
            scale=scale,
        )
        merged, _ = merge_partials([rebuilt, paged])
        out[rows] = merged.to(out.dtype)
