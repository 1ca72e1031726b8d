"""The runner's part of the hybrid cache: a step's HIDDEN sequences as `kernels.HiddenBatch`.

Kept apart from `runner.py` so the KV path's per-step work is unchanged: the runner calls
`build_hidden_batch` only when a step has HIDDEN requests, and places their rows after every
KV row of the flattened batch. Their K/V writes already go to the null block (their table
entries have id 0), and the decode buckets and prefill spans never list them, so the paged
attention leaves their rows to `hidden_attention`.
"""

from __future__ import annotations

import torch

from engine.kv.hidden import HiddenLayout
from engine.kv.kv_cache_manager import KVCacheManager
from engine.scheduling import ScheduledItem
from kernels import HiddenBatch, HiddenSeq


def build_hidden_batch(
    layout: HiddenLayout,
    items: list[ScheduledItem],
    first_row: int,
    kv: KVCacheManager,
    position_tables,
    device: torch.device,
) -> HiddenBatch:
    """`items` are HIDDEN, flattened from row `first_row` on in this order; `position_tables`
    is the model's (positions -> per-token rebuild arguments)."""
    bs = layout.block_size
    rows, writes, units, ctx_rows, ctx_pos, seqs = [], [], [], [], [], []
    row, ctx_start, gathered = first_row, 0, 0  # gathered: context rows in the gather so far
    for it in items:
        req, n = it.request, it.num_new_tokens
        ctx = req.num_computed_tokens
        held = torch.tensor([b.block_id for b in kv.table(req).held], dtype=torch.long)
        rows.append(torch.arange(row, row + n))
        writes.append(layout.write_rows(held, torch.arange(ctx, ctx + n)))
        if ctx:
            entries = -(-ctx // bs)
            units.append(layout.entry_units(held, entries).reshape(-1))
            ctx_rows.append(torch.arange(gathered, gathered + ctx))
            ctx_pos.append(torch.arange(ctx))
            gathered += entries * bs
        seqs.append(HiddenSeq(row, n, ctx_start, ctx))
        row += n
        ctx_start += ctx

    def cat(parts: list[torch.Tensor], shape=(0,)) -> torch.Tensor:
        t = torch.cat(parts) if parts else torch.empty(shape, dtype=torch.long)
        return t.to(device)

    positions = cat(ctx_pos)
    return HiddenBatch(
        rows=cat(rows),
        write_rows=cat(writes, (0, layout.chunks)),
        units=cat(units),
        ctx_rows=cat(ctx_rows),
        ctx_positions=positions,
        seqs=seqs,
        hidden_size=layout.hidden_size,
        position_args=tuple(position_tables(positions)) if positions.numel() else (),
    )
