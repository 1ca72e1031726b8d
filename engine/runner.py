"""Turns a scheduled batch into one forward pass.

Builds the flattened inputs (token ids, positions, cache slots) and the layer-invariant
attention metadata, runs the model, and returns logits only for the rows that produce a
token this step (the last new token of each sequence that reached its end; partial prefill
chunks produce none).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.hidden_batch import build_hidden_batch
from engine.kv import KVCacheManager, KVCacheStorage
from engine.kv.hidden import HiddenLayout
from engine.models.decode_graph import DecodeGraph, supports_decode_graph
from engine.rebuilt_prefix import HostPrefixLoader, add_rebuilt_prefixes, attended_ids, needs_prefix_rows
from engine.scheduling import Request, ScheduledItem
from engine.scheduling.request import CacheForm
from kernels import (
    GRAPH_DECODE_KERNELS,
    AttentionMetadata,
    DecodeBucket,
    PrefillSpan,
    prepare_decode_kernel,
    triton_unavailable,
)

log = logging.getLogger(__name__)
_BUCKET_FILL = 0.75  # a bucket's shortest row is at least this fraction of its longest...
_BUCKET_MIN = 8  # ...unless the bucket is still smaller than this
_BUCKET_MAX = 32  # and holds at most this many rows (bounds one gather's temporary; 64 measured no better)
_SPLIT_K_KERNELS = ("fused", "cpp", "triton")  # decode kernels that cut contexts into parts themselves


@dataclass
class StepResult:
    logits: torch.Tensor | None  # [N, vocab] float32, one row per request in `sampled`
    sampled: list[Request]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        storage: KVCacheStorage,
        kv: KVCacheManager,
        device: torch.device,
        decode_kernel: str = "reference",
        fallback: bool = False,
        compile_layers: bool = True,
        prefill_in_kernel: bool = True,
    ) -> None:
        """`decode_kernel`: one of `kernels.DECODE_KERNELS`. `fallback`: if that kernel cannot be
        built or compiled here, warn and use the reference (`attention="auto"`); otherwise the
        error propagates. `compile_layers`: with a kernel that runs inside compiled layers
        (`kernels.GRAPH_DECODE_KERNELS`), run decode-only steps through compiled layers
        (models/decode_graph.py) where the model supports it. `prefill_in_kernel`: with the C++
        kernel, attend prefill rows with it too, every row of a step in one call
        (`_step_bucket`); False keeps one SDPA call per prompt (`EngineConfig.prefill_attention`)."""
        self.model = model
        self.storage = storage
        self.kv = kv
        self.device = device
        self.block_size = storage.block_size
        self.scale = model.config.head_dim**-0.5
        self.decode_kernel = decode_kernel
        self.prefill_in_kernel = prefill_in_kernel
        self.decode_graph: DecodeGraph | None = None
        self.hidden_layout = HiddenLayout.of(model.config, storage.block_size, storage.num_blocks)
        if decode_kernel in GRAPH_DECODE_KERNELS:  # build or compile now rather than in the first request's step
            try:
                self._prepare(decode_kernel, compile_layers)
            except Exception as exc:  # e.g. no C++ compiler in a slim image
                if not fallback:
                    raise
                log.warning(
                    "%s decode attention unavailable (%s: %s); using the reference kernel",
                    decode_kernel,
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                )
                self.decode_kernel, self.decode_graph = "reference", None
        if decode_kernel == "triton":
            self._check_triton(fallback)

    def _check_triton(self, fallback: bool) -> None:
        """Triton missing or unusable here: `auto` warns and uses the reference; `triton` fails."""
        reason = triton_unavailable(self.device)
        if reason is None:
            return
        if not fallback:
            raise RuntimeError(f"attention='triton' is unavailable: {reason}")
        log.warning("Triton attention unavailable (%s); using the reference kernel", reason)
        self.decode_kernel = "reference"

    def _prepare(self, kernel: str, compile_layers: bool) -> None:
        prepare_decode_kernel(kernel, self.storage.layers[0], self.model.config.num_heads, self.scale)
        if compile_layers and kernel in GRAPH_DECODE_KERNELS and supports_decode_graph(self.model):
            self.decode_graph = DecodeGraph(self.model, self.scale, self.block_size, kernel)
            self.decode_graph.warm_up(self.storage.layers)

    @torch.inference_mode()
    def execute(self, items: list[ScheduledItem], wait_layer: Callable[[int], None] | None = None) -> StepResult:
        """`wait_layer(i)` runs before layer i when some KV of the batch is still loading."""
        hidden_items = [it for it in items if it.request.cache_form is CacheForm.HIDDEN]
        if hidden_items:  # the hybrid cache: HIDDEN rows go last, outside buckets and spans
            items = [it for it in items if it.request.cache_form is not CacheForm.HIDDEN]
        # partial residency (eLLM): prefixes rebuilt, or read from host through a scratch; a prefix
        # read from host in place (host_in_pool) is only other block ids, so its row stays a plain one
        partial = [needs_prefix_rows(self.kv.table(it.request), self.storage.host_offset) for it in items]
        rebuilt = [it for it, p in zip(items, partial) if p]
        if rebuilt:
            items = [it for it, p in zip(items, partial) if not p]
        # the engine refuses HIDDEN together with partial residency: both want the last rows
        assert not (hidden_items and rebuilt), "HIDDEN rows and rebuilt prefixes in one step"
        decodes = [it for it in items if it.num_new_tokens == 1]
        prefills = [it for it in items if it.num_new_tokens > 1]
        if not hidden_items and not rebuilt and self._graph_applies(decodes, prefills, wait_layer):
            return self._execute_decode_graph(decodes)
        ordered = decodes + prefills + rebuilt
        input_ids, positions, slots, rows, sampled = self._flatten(ordered + hidden_items)
        if self._prefill_in_kernel():  # one kernel call for every decode and prefill row
            buckets = [self._step_bucket(decodes, prefills)] if decodes or prefills else []
            spans: list[PrefillSpan] = []  # what stays on SDPA: rebuilt prefixes (added below)
        else:
            buckets = self._decode_buckets([it.request for it in decodes])
            spans = self._prefill_spans(prefills, start=len(decodes))
        transient, host_loader = [], None
        if rebuilt:  # their rebuilt prefixes go after every other row (host-kept ones are loaded per layer)
            first = len(input_ids) - sum(it.num_new_tokens for it in rebuilt)
            rows_in = (input_ids, positions, slots)
            transient, host_slots = add_rebuilt_prefixes(rebuilt, first, self.kv, rows_in, spans, self.device)
            if host_slots:
                host_loader = HostPrefixLoader(self.storage, host_slots, self.device)
                wait_layer = host_loader.before_layer(wait_layer)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            decode_buckets=buckets,
            prefills=spans,
            scale=self.scale,
            wait_layer=wait_layer,
            decode_kernel=self.decode_kernel,
            hidden=self._hidden_batch(hidden_items, sum(it.num_new_tokens for it in ordered)) if hidden_items else None,
            transient=transient,
            host_prefix=None if host_loader is None else host_loader.scratch,
        )
        hidden = self.model(self._tensor(input_ids), self._tensor(positions), meta, self.storage.layers)
        if not rows:
            return StepResult(None, [])
        logits = self.model.compute_logits(hidden[self._tensor(rows)])
        return StepResult(logits, sampled)

    def _prefill_in_kernel(self) -> bool:
        """Whether prefill rows go through the decode kernel (the C++ one attends any row over
        its own context, so a prompt's row i is a query over its first ctx + i + 1 tokens)."""
        return self.prefill_in_kernel and self.decode_kernel == "cpp"

    def _hidden_batch(self, items: list[ScheduledItem], first_row: int):
        return build_hidden_batch(
            self.hidden_layout, items, first_row, self.kv, self.model.position_tables, self.device
        )

    def _graph_applies(self, decodes, prefills, wait_layer) -> bool:
        """Decode-only steps in which every row has context in the cache and no KV is still loading."""
        return (
            self.decode_graph is not None
            and bool(decodes)
            and not prefills
            and wait_layer is None
            and all(it.request.num_computed_tokens for it in decodes)
        )

    def _execute_decode_graph(self, items: list[ScheduledItem]) -> StepResult:
        """A decode-only step through the compiled layers, then one K/V write for all layers."""
        input_ids, positions, slots, _, sampled = self._flatten(items)
        requests = [it.request for it in items]
        context = self._whole_bucket(requests, [r.num_computed_tokens for r in requests])
        hidden, keys, values = self.decode_graph(
            self._tensor(input_ids), self._tensor(positions), self.storage.layers, context
        )
        self.model.ops.write_kv_layers(self.storage.data, keys, values, self._tensor(slots))
        return StepResult(self.model.compute_logits(hidden), sampled)

    def _flatten(self, items: list[ScheduledItem]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        sampled: list[Request] = []
        for it in items:
            req, n = it.request, it.num_new_tokens
            start = req.num_computed_tokens
            table = self.kv.table(req)
            ids = table.ids
            input_ids.extend(req.token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            if any(table.rev[start // bs :]):  # logical positions stay; reversed blocks flip the slot
                rev = table.rev
                slots.extend(ids[p // bs] * bs + (bs - 1 - p % bs if rev[p // bs] else p % bs) for p in pos)
            else:
                slots.extend(ids[p // bs] * bs + p % bs for p in pos)
            if start + n == req.num_tokens:
                rows.append(len(input_ids) - 1)
                sampled.append(req)
        return input_ids, positions, slots, rows, sampled

    def _decode_buckets(self, requests: list[Request]) -> list[DecodeBucket]:
        """Group decode rows by context length so padding stays small.

        Rows are taken longest first; a new bucket starts when a row is shorter than
        `_BUCKET_FILL` of the bucket's longest and the bucket already has enough rows to
        amortise the per-bucket op overhead. The fused and C++ kernels split contexts into
        chunks themselves, so they get every decode row in one bucket.
        """
        lens = [r.num_computed_tokens + 1 for r in requests]
        if self.decode_kernel in _SPLIT_K_KERNELS:  # split-K over chunks: one bucket of any lengths
            return [self._whole_bucket(requests, lens)] if requests else []
        order = sorted(range(len(requests)), key=lens.__getitem__, reverse=True)
        buckets: list[list[int]] = []
        for i in order:
            current = buckets[-1] if buckets else None
            if (
                current is None
                or len(current) >= _BUCKET_MAX
                or (lens[i] < _BUCKET_FILL * lens[current[0]] and len(current) >= _BUCKET_MIN)
            ):
                buckets.append([])
            buckets[-1].append(i)
        return [self._decode_bucket(rows, [requests[i] for i in rows], [lens[i] for i in rows]) for rows in buckets]

    def _step_bucket(self, decodes: list[ScheduledItem], prefills: list[ScheduledItem]) -> DecodeBucket:
        """Rows 0.. of the step, decodes then prefill chunks, as one bucket whose every row is a
        query over its own sequence's cached tokens up to and including itself (causal by
        length: a chunk's K/V are written to the cache before attention). A prompt's rows share
        its block table row; SDPA per prompt (the other path) is what this replaces."""
        items = decodes + prefills
        requests = [it.request for it in items]
        ends = [it.request.num_computed_tokens + it.num_new_tokens for it in items]
        repeats = [it.num_new_tokens for it in items]
        return self._bucket(requests, ends, repeats, list(range(sum(repeats))))

    def _whole_bucket(self, requests: list[Request], lens: list[int]) -> DecodeBucket:
        """Every request in one bucket, rows in order (for kernels that cut contexts into chunks)."""
        return self._decode_bucket(list(range(len(requests))), requests, lens)

    def _decode_bucket(self, rows: list[int], requests: list[Request], lens: list[int]) -> DecodeBucket:
        """One row per request, request i attending its first lens[i] tokens."""
        return self._bucket(requests, lens, [1] * len(requests), rows)

    def _bucket(self, requests: list[Request], ends: list[int], repeats: list[int], rows: list[int]) -> DecodeBucket:
        """The bucket of `requests` where request i has repeats[i] consecutive query rows over
        its own first ends[i] - repeats[i] + 1 .. ends[i] tokens (a decode row: one row; a
        prefill chunk: one row per new token), at the step's rows `rows` (one per query row).
        Rows of one request share its block table row: a padded [rows, max_blocks] table (a
        host-kept prefix read in place names its host blocks: `attended_ids`), its direction
        bits, and a 0/-inf mask over each row's context."""
        bs = self.block_size
        width = -(-max(ends) // bs)
        tables = [self.kv.table(r) for r in requests]
        ids = [attended_ids(t, self.storage.host_offset)[: -(-e // bs)] for t, e in zip(tables, ends)]
        table = torch.tensor([row + [0] * (width - len(row)) for row in ids], dtype=torch.long)
        reversed_bits = self._directions(tables, width)
        lens = [n for e, r in zip(ends, repeats) for n in range(e - r + 1, e + 1)]
        if len(lens) != len(repeats):  # some request has several rows: they share its table row
            counts = torch.tensor(repeats)
            table = table.repeat_interleave(counts, 0)
            if reversed_bits is not None:
                reversed_bits = reversed_bits.repeat_interleave(counts.to(reversed_bits.device), 0)
        lens_t = torch.tensor(lens, dtype=torch.long)
        valid = torch.arange(width * bs).unsqueeze(0) < lens_t.unsqueeze(1)
        bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        return DecodeBucket(
            rows=self._tensor(rows),
            row_range=slice(rows[0], rows[0] + len(rows)) if consecutive else None,
            block_table=table.to(self.device),
            bias=bias.unsqueeze(1).to(self.device),
            reversed=reversed_bits,
            lens=lens_t.to(self.device),
        )

    def _directions(self, tables, width: int) -> torch.Tensor | None:
        """[len(tables), width] direction bits, or None when every block is forward (the common case)."""
        rows = [t.rev[:width] for t in tables]
        if not any(any(r) for r in rows):
            return None
        return torch.tensor([r + [False] * (width - len(r)) for r in rows], dtype=torch.bool, device=self.device)

    def _prefill_spans(self, items: list[ScheduledItem], start: int) -> list[PrefillSpan]:
        spans, row = [], start
        bs = self.block_size
        for it in items:
            req, n = it.request, it.num_new_tokens
            ctx = req.num_computed_tokens
            block_ids = reversed_bits = None
            if ctx:
                table = self.kv.table(req)
                width = -(-(ctx + n) // bs)
                block_ids = self._tensor(attended_ids(table, self.storage.host_offset)[:width])
                bits = self._directions([table], width)
                reversed_bits = None if bits is None else bits[0]
            spans.append(PrefillSpan(q_start=row, q_len=n, ctx_len=ctx, block_ids=block_ids, reversed=reversed_bits))
            row += n
        return spans

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
