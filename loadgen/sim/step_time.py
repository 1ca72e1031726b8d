"""Step-time features of a scheduled batch, exactly as the engine's runner splits it.

A row with one new token is a decode (the runner treats it so), every other row is a
prefill chunk; each row is `(num_new_tokens, context_tokens_after_the_step)`, the
`CostModel.estimate` contract. Call before the batch's progress is applied.

Partial residency (eLLM): given the KV manager, a request whose table rebuilds `u` tokens this
step adds a prefill row `(u, u)`, the rows the runner appends (`engine/rebuilt_prefix.py`).
`step_seconds` prices those rows with `CostModel.with_rebuilt_prefixes`, the function the
`ellm` optimiser prices them with: the profile's measured rebuild step where it has one (the
whole extra of such a step), prefill rows otherwise.

The hybrid cache (Apt-Serve): a HIDDEN row is priced as the same row in KV form (its attention
over the context is the same work) plus the rebuild of K/V from every stored context token,
`CostModel.hidden_seconds` of the HIDDEN requests' context tokens (`hidden_context_tokens`)
given the step's new tokens, which come first in the shared K/V projection (the knee), plus
the profile's measured fixed extra of a step that rebuilds (`meta.hidden_step_overhead_s`:
on the CPU engine such a step leaves the compiled decode layer; a roofline has none).

Host-kept prefixes (eLLM's host source): no rows; the step reads their K/V of every layer
from host, priced like a swap (`CostModel.swap_bytes_per_s`, overlapped with the step where
the profile's copies overlap, added to it otherwise). Under the `ellm` policy's priced layer
split (`ScheduledBatch.host_prefix_split`) only that share of bytes is read and the rest of
each such prefix is rebuilt, priced as that share of their prefill rows' time.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.cost_model import CostModel, phase_sums
from engine.kv import KVCacheManager
from engine.kv.hidden import CacheForm
from engine.rebuilt_prefix import host_prefix_rows, rebuilt_rows
from engine.scheduling import ScheduledBatch, ScheduledItem


def batch_rows(
    items: Sequence[ScheduledItem], kv: KVCacheManager | None = None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    prefill, decode = [], []
    for it in items:
        row = (it.num_new_tokens, it.request.num_computed_tokens + it.num_new_tokens)
        (decode if it.num_new_tokens == 1 else prefill).append(row)
    if kv is not None:
        prefill += rebuilt_rows(items, kv)
    return prefill, decode


def hidden_context_tokens(items: Sequence[ScheduledItem]) -> int:
    """Tokens whose K/V this step rebuilds from stored hidden rows: every HIDDEN request's
    context before its new tokens (a first prefill chunk has none)."""
    return sum(it.request.num_computed_tokens for it in items if it.request.cache_form is CacheForm.HIDDEN)


def swap_bytes(batch: ScheduledBatch, bytes_per_token: int) -> int:
    """Bytes the batch moves across the host link (checkpoints, swaps); the manager may price
    them itself (`swap_bytes`) or leave it to us (`swap_slots` x bytes per token)."""
    priced = int(getattr(batch, "swap_bytes", 0) or 0)
    return priced or int(getattr(batch, "swap_slots", 0) or 0) * bytes_per_token


def _with_rebuilt(
    cost: CostModel, prefill: list, decode: list, rebuilt: list, swap: float = 0, overlap: bool | None = None
) -> float:
    """`CostModel.estimate` of the rows plus the rebuilt prefix rows `(u, u)`, priced the
    optimiser's way (`CostModel.with_rebuilt_prefixes`); swaps as `estimate` adds them."""
    p_ln, p_work = phase_sums(prefill)
    d_ln, d_work = phase_sums(decode)
    u_sum, u_pairs = phase_sums(rebuilt)
    exec_s = cost.with_rebuilt_prefixes(p_ln, p_work, d_ln, d_work, len(rebuilt), u_sum, u_pairs)
    swap_s = swap / cost.swap_bytes_per_s if swap else 0.0
    return max(exec_s, swap_s) if (cost.swap_overlaps if overlap is None else overlap) else exec_s + swap_s


def step_seconds(
    cost: CostModel, batch: ScheduledBatch, bytes_per_token: int, kv: KVCacheManager | None = None
) -> float:
    prefill, decode = batch_rows(batch.items)
    rebuilt = rebuilt_rows(batch.items, kv) if kv is not None else []
    new_tokens = sum(it.num_new_tokens for it in batch.items)
    rebuilt_tokens = hidden_context_tokens(batch.items)
    rebuild = cost.hidden_seconds(rebuilt_tokens, step_rows=new_tokens)
    if rebuilt_tokens:  # a measured profile's fixed extra of a step that rebuilds (op by op on a CPU)
        rebuild += float(cost.meta.get("hidden_step_overhead_s", 0.0) or 0.0)
    host_rows = host_prefix_rows(batch.items, kv) if kv is not None else []
    if not host_rows:
        return _with_rebuilt(cost, prefill, decode, rebuilt, swap_bytes(batch, bytes_per_token)) + rebuild
    read_share, rebuild_share = getattr(batch, "host_prefix_split", (1.0, 0.0))
    exec_s = _with_rebuilt(cost, prefill, decode, rebuilt, overlap=False) + rebuild
    prefill = prefill + rebuilt
    if rebuild_share:
        exec_s += rebuild_share * (cost.estimate(prefill + host_rows, decode) - cost.estimate(prefill, decode))
    moved = swap_bytes(batch, bytes_per_token) + read_share * sum(u for u, _ in host_rows) * bytes_per_token
    copy_s = moved / cost.swap_bytes_per_s
    return max(exec_s, copy_s) if cost.swap_overlaps else exec_s + copy_s
