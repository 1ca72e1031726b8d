"""The runner's side of partial residency (eLLM): rows that rebuild non-resident prefixes,
and the per-layer loads of prefixes kept on host.

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
every kernel reads only under a -inf mask (as padding). That keeps the models' one K/V write
per layer (`LayerOps.write_kv` in `kernels/layer_ops.py`, called on the op-by-op path that such
a step takes) unchanged.

Rebuilt rows are not counted against `max_num_batched_tokens`: they are the price of the
memory partial residency frees, which the `ellm` policy weighs (and a fixed ratio is for
checking and debugging).

A table whose prefix is kept on host (`BlockTable.host_prefix`, the `host` source) adds no
rows, and is read one of two ways:

- *In place* (a CPU, `KVCacheStorage.host_offset` set: the swap space is the tail of the
  pool's tensor, `reads_host_prefix_in_place`): the row is a plain decode or prefill row whose
  block table names the prefix's host blocks (`attended_ids`). The step is the fully resident
  one with other block ids, so a decode-only step stays on the compiled decode layers and the
  C++/fused kernel, reads the same K/V bytes in the same order as full residency (bitwise the
  same logits) and pays no copy per step; the only copies are the offloads when a block leaves
  the pool. On a CPU the host tier is the same DRAM, so there is nothing to copy *to*.
- *Through a scratch* (a GPU, where the swap space is pinned host memory; or
  `host_prefix_in_place=False`): its span reads the prefix's K/V from a one-layer scratch
  (`HostPrefixKV`) that `HostPrefixLoader` fills just before each layer (through the models'
  `wait_layer` hook, the one they already call before every layer), by one `index_select`
  over that layer's host swap space for all such prefixes of the step, attended apart and
  merged (`kernels/reference/resident.py`); such a step runs op by op. The K/V are the
  originals, so attention over them is the full-residency one up to the merge's rounding. On
  a GPU this load is a synchronous host-to-device copy per layer; overlapping it one layer
  ahead on a second stream (the design in docs/ellm.md) is not built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import HostPrefixKV, PrefillSpan, TransientSpan

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.config import EngineConfig
    from engine.kv import KVCacheManager, KVCacheStorage
    from engine.kv.block_table import BlockTable
    from engine.scheduling import ScheduledItem

_NULL_BLOCK = 0


def reads_host_prefix_in_place(config: EngineConfig) -> bool:
    """Whether the engine keeps its host swap space in the pool's tensor
    (`KVCacheStorage(host_in_pool=True)`) so host-kept prefixes are read in place: partial
    residency that may read from host (`uncached_source` host, or auto under `ellm`), on a CPU
    (host and pool are the same DRAM there; on a GPU the swap space is pinned host memory),
    with a kernel other than Triton (the GPU path, which keeps the GPU's layout so that its
    interpreter tests run what a GPU runs), unless `host_prefix_in_place` turns it off."""
    partial = config.uncached_ratio > 0 or config.policy == "ellm"
    return (
        partial
        and config.uncached_source != "rebuild"
        and config.host_prefix_in_place
        and torch.device(config.device).type == "cpu"
        and config.decode_kernel != "triton"
    )


def needs_prefix_rows(table: BlockTable, host_offset: int | None) -> bool:
    """Whether the step attends `table` through the partial path (`TransientSpan`): a prefix it
    rebuilds, or one kept on host that is not read in place (`host_offset` None: the swap space
    is not the pool's tensor, so each layer copies it into the `HostPrefixKV` scratch)."""
    return bool(table.transient) and not (table.host_prefix and host_offset is not None)


def attended_ids(table: BlockTable, host_offset: int | None) -> list[int]:
    """The block ids a kernel reads for `table`: its own, except that with the swap space in the
    pool's tensor (`KVCacheStorage.host_offset`) each entry of a host-kept prefix names its host
    block in place (`host_offset + h`), so a decode row reads its whole context, prefix
    included, through one block table: the same kernel, the compiled decode layers included,
    the same K/V and order as full residency (the entries' empty ids, 0, are never read)."""
    if not table.host_prefix or host_offset is None:
        return table.ids
    n = len(table.host_prefix)
    return [host_offset + h for h in table.host_prefix] + table.ids[n:]


def rebuilt_rows(items: list[ScheduledItem], kv: KVCacheManager) -> list[tuple[int, int]]:
    """The prefill rows `(u, u)` this step's rebuilt prefixes add, one per item that has one:
    what a step-time model prices (the simulator's `batch_rows`). Call after allocation."""
    tables = (kv.table(it.request) for it in items)
    return [(t.transient, t.transient) for t in tables if t.transient and not t.host_prefix]


def host_prefix_rows(items: list[ScheduledItem], kv: KVCacheManager) -> list[tuple[int, int]]:
    """`(u, u)` per host-kept prefix this step reads from host, every layer (a step-time model
    prices `u` as copied tokens, or the rows as what rebuilding them would cost). Call after
    allocation."""
    tables = (kv.table(it.request) for it in items)
    return [(t.transient, t.transient) for t in tables if t.host_prefix]


def add_rebuilt_prefixes(
    items: list[ScheduledItem],
    first_row: int,
    kv: KVCacheManager,
    rows: tuple[list[int], list[int], list[int]],
    prefills: list[PrefillSpan],
    device: torch.device,
) -> tuple[list[TransientSpan], list[int]]:
    """Append the rebuilt prefix rows of `items` (whose new tokens are the batch rows from
    `first_row` on, in order) to `rows` = (input ids, positions, slots) and their ctx-0
    spans to `prefills`; return the items' `TransientSpan`s and the host slots of the
    host-kept prefixes (their spans' rows in the `HostPrefixKV` scratch, in order)."""
    input_ids, positions, slots = rows
    bs = kv.block_size
    spans: list[TransientSpan] = []
    host_slots: list[int] = []
    row = first_row
    for it in items:
        request, n = it.request, it.num_new_tokens
        table = kv.table(request)
        prefix_len, ctx, ids = table.transient, request.num_computed_tokens, table.ids
        width = -(-(ctx + n) // bs)
        block_ids = torch.tensor(ids[:width], dtype=torch.long, device=device)
        if table.host_prefix:  # read from host layer by layer: no rows
            start = len(host_slots)
            host_slots.extend(h * bs + o for h in table.host_prefix for o in range(bs))
            spans.append(TransientSpan(row, n, ctx, start, prefix_len, block_ids, from_host=True))
        else:
            prefix_start = len(input_ids)
            input_ids.extend(request.token_ids[:prefix_len])
            positions.extend(range(prefix_len))
            slots.extend((ids[p // bs] or _NULL_BLOCK) * bs + p % bs for p in range(prefix_len))
            prefills.append(PrefillSpan(q_start=prefix_start, q_len=prefix_len, ctx_len=0, block_ids=None))
            spans.append(TransientSpan(row, n, ctx, prefix_start, prefix_len, block_ids))
        row += n
    return spans, host_slots


class HostPrefixLoader:
    """Fills a step's `HostPrefixKV` with layer `j`'s K/V of its host-kept prefixes just
    before layer `j` runs (see the module docstring)."""

    def __init__(self, storage: KVCacheStorage, host_slots: list[int], device: torch.device) -> None:
        host = storage.host()  # [layers, 2, kv_heads, host_blocks, bs, D]
        layers, two, heads, blocks, bs, dim = host.shape
        self._source = host.view(layers, two, heads, blocks * bs, dim)
        self._slots = torch.tensor(host_slots, dtype=torch.long)
        self._device = device
        self.scratch = HostPrefixKV()

    def load(self, layer: int) -> None:
        kv = self._source[layer].index_select(2, self._slots).to(self._device)  # [2, kv_heads, N, D]
        self.scratch.keys = kv[0].transpose(0, 1)
        self.scratch.values = kv[1].transpose(0, 1)

    def before_layer(self, wait_layer: Callable[[int], None] | None) -> Callable[[int], None]:
        """The hook the model calls before each layer: the step's own `wait_layer` (KV still
        arriving for session promotion), then this layer's host prefixes."""
        if wait_layer is None:
            return self.load

        def both(layer: int) -> None:
            wait_layer(layer)
            self.load(layer)

        return both
