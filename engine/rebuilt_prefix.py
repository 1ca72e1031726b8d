"""The runner's side of partial residency (eLLM): rows that rebuild non-resident prefixes.

A request whose table has `transient = T > 0` (`engine/kv/partial.py`) has no K/V in the pool
for its tokens `[0, T)`. This step re-runs those tokens from their ids through every layer,
as extra rows at the end of the flattened batch (positions `0 .. T-1`, a ctx-0 prefill span
of their own, so each layer's attention over them is plain causal self-attention and the
next layer gets their true hidden states). At each layer the request's own query rows attend
those rows' K/V and the paged rest, merged exactly (`kernels/reference/resident.py`); the
rebuilt K/V are dropped with the layer's activations. The rebuilt rows produce no logits.

Where a rebuilt token's entry has a block (a fresh one, brought back by a shrinking ratio)
its K/V are written there, so the token is resident from the next step on; every other
rebuilt row writes into the null block (block 0), a write sink no table entry points at and
every kernel reads only under a -inf mask (as padding). That keeps the one per-layer
`write_kv_cache` of the models unchanged.

Rebuilt rows are not counted against `max_num_batched_tokens`: they are the price of the
memory partial residency frees, which the `ellm` policy weighs (and a fixed ratio is for
checking and debugging).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import PrefillSpan, TransientSpan

if TYPE_CHECKING:
    from engine.kv import KVCacheManager
    from engine.scheduling import ScheduledItem

_NULL_BLOCK = 0


def rebuilt_rows(items: list[ScheduledItem], kv: KVCacheManager) -> list[tuple[int, int]]:
    """The prefill rows `(u, u)` this step's rebuilt prefixes add, one per item that has one:
    what a step-time model prices (the simulator's `batch_rows`). Call after allocation."""
    return [(u, u) for u in (kv.table(it.request).transient for it in items) if u]


def add_rebuilt_prefixes(
    items: list[ScheduledItem],
    first_row: int,
    kv: KVCacheManager,
    rows: tuple[list[int], list[int], list[int]],
    prefills: list[PrefillSpan],
    device: torch.device,
) -> list[TransientSpan]:
    """Append the rebuilt prefix rows of `items` (whose new tokens are the batch rows from
    `first_row` on, in order) to `rows` = (input ids, positions, slots) and their ctx-0
    spans to `prefills`; return the items' `TransientSpan`s."""
    input_ids, positions, slots = rows
    bs = kv.block_size
    spans: list[TransientSpan] = []
    row = first_row
    for it in items:
        request, n = it.request, it.num_new_tokens
        table = kv.table(request)
        rebuilt, ctx, ids = table.transient, request.num_computed_tokens, table.ids
        prefix_start = len(input_ids)
        input_ids.extend(request.token_ids[:rebuilt])
        positions.extend(range(rebuilt))
        slots.extend((ids[p // bs] or _NULL_BLOCK) * bs + p % bs for p in range(rebuilt))
        prefills.append(PrefillSpan(q_start=prefix_start, q_len=rebuilt, ctx_len=0, block_ids=None))
        width = -(-(ctx + n) // bs)
        block_ids = torch.tensor(ids[:width], dtype=torch.long, device=device)
        spans.append(TransientSpan(row, n, ctx, prefix_start, rebuilt, block_ids))
        row += n
    return spans
