"""Profile the real model on the real device to fit the BROS cost model (a few seconds, cached).

Dummy batches run through the engine's own `ModelRunner` on a power-of-two grid: prefill
rows of 1 and 4 requests up to the token budget, decode batches up to `max_num_seqs` (64 at
most) at contexts up to the model length, as far as the KV pool holds them. Swap bandwidth
comes from copying blocks between the KV pool and host space with the engine's own copy
path. Each point is the *minimum* of a few timed runs after a warm-up: on a shared machine
other processes only ever add time, so the minimum is the least disturbed estimate. The runs of
one point are spread over the whole measurement (every point once per pass, three passes)
rather than taken back to back: on an oversubscribed machine a multi-threaded pass stalls at
every OpenMP barrier whose partner thread lost its core, and such a window lasts seconds, so
back-to-back runs of the points inside it all came out 100-500x slow (measured at load ~8 on 2
cores: a 1 ms tiny-model pass timed at 85-500 ms for several points in a row, and a fit whose
fixed cost was 92 ms). After the fit, the points it misses by far more than the rest get three
more passes and the phase is refitted once. A handful of mixed
prefill+decode batches are measured but not fitted, to report how well the sum of the two
phase models predicts them.

The hybrid cache's ρ (docs/aptserve.md) is measured the same way where the target asks for it
(`calibrate_hidden`: a model whose hidden form saves memory, with the hybrid cache attached):
decode batches timed twice, all rows KV and then all rows HIDDEN, at a few batch sizes and
contexts; the extra seconds are fitted against the HIDDEN context tokens rebuilt
(`extra = a·tokens + o`, non-negative), and `a` is the cost model's `hidden_s_per_token`. A
difference of two timings of the same batch, rather than a fit of HIDDEN steps alone, keeps
everything the two forms share (weights, sampling, attention over the context) out of ρ; `o`
(steps with HIDDEN rows run op by op, outside the compiled decode layer) goes to the meta as
`hidden_step_overhead_s`, since the knapsack's penalty is per block and has no fixed term.
A cached profile without the term gets it added on first use and is saved again. The same
holds for eLLM's host-read prefix step (`calibrate_prefix`, `engine/prefix_profiling.py`).

Profiles are cached under `$TANDEM_CACHE_DIR/profiles/`, keyed by the model file, device,
dtype, thread count, block size, the grid limits and the decode attention kernel. Each records
how it was measured (host load, CPU share: engine/profile_trust.py), and which one an engine
plans from, cached, spot-checked or measured again, is engine/profile_cache.py's decision.

The profiler sees a `ProfileTarget`, not an engine: the few things it drives and reads, built
explicitly by `LLMEngine.profile_target()` once the runner and the KV cache exist (the engine
profiles from its constructor, before its scheduler and session store are built, because the
BROS policy and the session store take the cost model).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.cost_model import CostModel, Sample, fit, mape, nonneg_lstsq, phase_sums
from engine.kv import KVCacheManager
from engine.kv.copies import CopyKind, KVCopy
from engine.kv.hidden import CacheForm
from engine.loader.cache import default_cache_dir, file_cache_key
from engine.prefix_profiling import with_prefix_step, with_rebuild_step
from engine.profile_trust import TrustBounds, doubts, measured
from engine.sampling import SamplingParams
from engine.scheduling.policy import ScheduledItem
from engine.scheduling.request import Request

log = logging.getLogger(__name__)
PROFILE_VERSION = "1"
_PASSES = 3  # timed runs per point, one per pass over the grid


@dataclass(frozen=True)
class ProfileTarget:
    """What profiling drives and reads, and nothing else of the engine."""

    execute: Callable[[list[ScheduledItem]], object]  # one forward pass over the rows (ModelRunner.execute)
    copy_blocks: Callable[[Sequence[KVCopy]], None]  # the engine's block copy path (KVCacheStorage.execute)
    kv: KVCacheManager  # idle: the dummy rows allocate and free their KV through it
    config: EngineConfig  # resolved: device, dtype, block size and batch limits
    max_model_len: int
    vocab_size: int
    model_name: str
    decode_kernel: str  # the attention kernel and the layer graph change decode step times
    compiled_layers: bool
    calibrate_hidden: bool = False  # measure the hybrid cache's rebuild (ρ): its hidden form saves memory
    calibrate_prefix: bool = False  # measure a host-read prefix step (eLLM's host source)
    calibrate_rebuild: bool = False  # measure a rebuilt prefix step (eLLM's rebuild source)
    # how such a step reads the prefix: "in_place" (swap space in the pool's tensor, the
    # compiled decode path) or "copy" (a per-layer scratch); a cached fit of the other is redone
    prefix_read: str = "copy"


def profile_path(target: ProfileTarget, source, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "profiles" / f"{profile_key(target, source)}.json"


def profile_cached(target: ProfileTarget, source, cache_dir: Path | None = None) -> CostModel:
    """The cached profile if it can be trusted, else a fresh one (engine/profile_cache.py)."""
    from engine.profile_cache import cached_profile

    return cached_profile(target, source, cache_dir).model


def profile_key(target: ProfileTarget, source) -> str:
    cfg = target.config
    parts = [
        PROFILE_VERSION,
        cfg.device,
        cfg.dtype,
        str(torch.get_num_threads()),
        str(cfg.block_size),
        str(cfg.max_num_batched_tokens),
        str(cfg.max_num_seqs),
        str(target.max_model_len),
        target.decode_kernel,
        str(target.compiled_layers),
        *(["kv-heads-expand"] if cfg.kv_heads_expand else []),  # MHA memory shape: other KV traffic
    ]
    model_file = source.path / "config.json" if source.path.is_dir() else source.path
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
    return f"{source.name}-{cfg.device}-{cfg.dtype}-{file_cache_key(model_file, *parts)[:12]}-{digest}"


def profile(target: ProfileTarget) -> CostModel:
    """A fresh profile of `target`, with how it was taken (`meta["conditions"]`: the host's
    load, the measuring thread's CPU share, wall seconds; engine/profile_trust.py) and the
    verdict on it under the config's bounds (`meta["trust"]`, informative: every read judges
    again), and the engine settings that make its cache key (`meta["engine"]`, so `tandem
    profile --retake` can measure it again)."""
    model, conditions = measured(lambda: _measure(target), torch.get_num_threads())
    meta = {**model.meta, "conditions": conditions.as_dict(), "engine": _engine_fields(target)}
    bounds = TrustBounds.of(target.config)
    found = doubts(meta, bounds, target.config.device)
    meta["trust"] = {"trusted": not found, "doubts": found, "bounds": bounds.as_dict()}
    return replace(model, meta=meta)


def _engine_fields(target: ProfileTarget) -> dict:
    cfg = target.config
    fields = ("model", "load_format", "device", "dtype", "block_size", "kv_cache_gib", "num_blocks", "max_num_seqs")
    more = ("max_num_batched_tokens", "max_model_len", "attention", "compile_layers", "kv_heads_expand")
    return {name: getattr(cfg, name) for name in (*fields, *more)}


def _measure(target: ProfileTarget) -> CostModel:
    start = time.perf_counter()
    bench = _Bench(target)
    prefill_rows = [[(n // k, 0)] * k for n, k in _prefill_grid(target)]
    decode_rows = [[(1, c - 1)] * b for b, c in _decode_grid(target)]
    mixed_rows = [[(n, 0)] + [(1, c - 1)] * b for n, b, c in _mixed_grid(target)]
    times = bench.fastest_each([*prefill_rows, *decode_rows, *mixed_rows])
    prefill = [_sample(rows, t) for rows, t in zip(prefill_rows, times)]
    decode = [_sample(rows, t) for rows, t in zip(decode_rows, times[len(prefill_rows) :])]
    prefill = _retime_outliers(bench, prefill_rows, prefill)
    decode = _retime_outliers(bench, decode_rows, decode)
    mixed_times = times[len(prefill_rows) + len(decode_rows) :]
    mixed = [(rows[:1], rows[1:], t) for rows, t in zip(mixed_rows, mixed_times)]
    swap_bps = bench.swap_bandwidth()
    model = CostModel(fit(prefill), fit(decode), swap_bps)
    meta = {
        "model": target.model_name,
        "device": target.config.device,
        "dtype": target.config.dtype,
        "threads": torch.get_num_threads(),
        "swap_overlaps": False,  # copies run before the forward pass
        "prefill_mape": mape(model.prefill, prefill),
        "decode_mape": mape(model.decode, decode),
        "mixed_mape": _mixed_mape(model, mixed),
        "num_samples": len(prefill) + len(decode),
        "profile_seconds": time.perf_counter() - start,
    }
    model = CostModel(model.prefill, model.decode, swap_bps, meta)
    model = with_hidden(target, model) if target.calibrate_hidden else model
    model = with_prefix_step(target, model) if target.calibrate_prefix else model
    return with_rebuild_step(target, model) if target.calibrate_rebuild else model


@dataclass(frozen=True)
class HiddenRebuild:
    """The measured rebuild: seconds per HIDDEN context token per step, the fixed extra of a
    step with HIDDEN rows, and the points fitted."""

    per_token_s: float
    overhead_s: float
    points: tuple[tuple[int, float], ...]  # (HIDDEN context tokens, extra seconds over KV form)


def measure_hidden(target: ProfileTarget) -> HiddenRebuild:
    """Time the grid's decode batches in KV and in HIDDEN form; fit the extra (module docstring)."""
    import numpy as np

    grid = _hidden_grid(target)
    batches = [[(1, c - 1)] * b for b, c in grid for _ in range(2)]
    forms = [form for _ in grid for form in (CacheForm.HIDDEN, CacheForm.KV)]
    times = _Bench(target).fastest_each(batches, forms)
    points = [(b * (c - 1), times[2 * i] - times[2 * i + 1]) for i, (b, c) in enumerate(grid)]
    if len(points) < 2:
        raise RuntimeError("the KV pool is too small to calibrate the hidden cache's rebuild")
    x = np.array([[t, 1.0] for t, _ in points])
    y = np.array([e for _, e in points])
    per_token, overhead = nonneg_lstsq(x, y, np.ones_like(y))
    return HiddenRebuild(per_token, overhead, tuple(points))


def with_hidden(target: ProfileTarget, model: CostModel) -> CostModel:
    """`model` with the hybrid cache's rebuild term measured (module docstring)."""
    start = time.perf_counter()
    rebuild = measure_hidden(target)
    meta = dict(model.meta)
    meta.update(
        hidden_step_overhead_s=rebuild.overhead_s,
        hidden_points=[{"tokens": t, "extra_s": e} for t, e in rebuild.points],
        hidden_profile_seconds=time.perf_counter() - start,
    )
    log.info(
        "hidden cache: %.3g s per HIDDEN context token per step (rho %.3g s/block)",
        rebuild.per_token_s,
        rebuild.per_token_s * target.config.block_size,
    )
    return replace(model, meta=meta, hidden_s_per_token=rebuild.per_token_s)


def _hidden_grid(target: ProfileTarget) -> list[tuple[int, int]]:
    """(batch, context) points for the rebuild: both forms of the batch must fit the pool."""
    bs = target.config.block_size
    capacity = target.kv.capacity_tokens() - bs * 8
    contexts = [c for c in (128, 512, 2048) if c < target.max_model_len]
    batches = [b for b in (1, 4, 16) if b <= target.config.max_num_seqs]
    # at most 8k rebuilt tokens a point: the fit is linear, and a CPU spends seconds on more
    return [(b, c) for b in batches for c in contexts if b * (c + bs) <= capacity and b * c <= 8192]


def _pow2(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def _prefill_grid(target: ProfileTarget) -> list[tuple[int, int]]:
    top = min(target.config.max_num_batched_tokens, target.max_model_len - 1, target.kv.capacity_tokens() // 2)
    return [(n, k) for n in _pow2(16, top) for k in (1, 4) if n // k >= 8]


def _decode_grid(target: ProfileTarget) -> list[tuple[int, int]]:
    capacity = target.kv.capacity_tokens() - target.config.block_size * 8
    batches = _pow2(1, min(target.config.max_num_seqs, 64))
    contexts = _pow2(64, min(target.max_model_len - 1, 2048))
    return [(b, c) for b in batches for c in contexts[::2] if b * (c + target.config.block_size) <= capacity]


def _mixed_grid(target: ProfileTarget) -> list[tuple[int, int, int]]:
    cfg, bs = target.config, target.config.block_size
    top = min(cfg.max_num_batched_tokens, 256, target.max_model_len - 1)
    context = min(128, target.max_model_len // 2)
    capacity = target.kv.capacity_tokens() - bs * 8
    grid = {(n, min(b, cfg.max_num_seqs - 1), context) for n in (64, top) for b in (4, 16)}
    return sorted(
        (n, b, c)
        for n, b, c in grid
        if b >= 1 and n + b <= cfg.max_num_batched_tokens and n + bs + b * (c + bs) <= capacity
    )


def _sample(rows: list[tuple[int, int]], seconds: float) -> Sample:
    """A single-phase sample from `(new tokens, cached tokens)` rows and their time."""
    return Sample(*phase_sums(_after_step(rows)), seconds)


def _after_step(rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`(new tokens, cached tokens)` rows as the cost model's `(new, context after the step)`."""
    return [(n, n + c) for n, c in rows]


def _retime_outliers(bench: _Bench, rows: list[list[tuple[int, int]]], samples: list[Sample]) -> list[Sample]:
    """Fit, give the points the fit misses by far more than the rest (relative error over three
    times the median and over 20%) more passes, and return the samples to refit. One round: a
    point still off after that is the model's shape, not noise."""
    if len(samples) < 3:
        return samples
    phase = fit(samples)
    errs = [abs(phase.predict_work(s.ln, s.work) - s.seconds) / s.seconds for s in samples]
    bar = max(0.2, 3 * sorted(errs)[len(errs) // 2])
    far = [i for i, e in enumerate(errs) if e > bar]
    if not far:
        return samples
    again = bench.fastest_each([rows[i] for i in far])
    out = list(samples)
    for i, t in zip(far, again):
        out[i] = _sample(rows[i], min(t, samples[i].seconds))
    return out


def _mixed_mape(model: CostModel, mixed: list[tuple[list, list, float]]) -> float:
    errs = [abs(model.estimate(_after_step(p), _after_step(d)) - secs) / secs for p, d, secs in mixed]
    return sum(errs) / len(errs) if errs else 0.0


class _Bench:
    """Times dummy batches through the engine's runner, using its (idle) KV pool."""

    def __init__(self, target: ProfileTarget) -> None:
        self.target = target
        self.vocab = target.vocab_size
        self._ids = 0

    def fastest_each(
        self, batches: Sequence[list[tuple[int, int]]], forms: Sequence[CacheForm] | None = None
    ) -> list[float]:
        """The fastest of `_PASSES` timed runs of each batch of `(new tokens, cached tokens)`
        rows (in cache form `forms[i]`, KV by default), one run per batch per pass, after one
        warm-up run each (module docstring: why passes, not back-to-back runs)."""
        forms = forms or [CacheForm.KV] * len(batches)
        for rows, form in zip(batches, forms):
            self._time_once(rows, form)  # warm-up: allocator, first-touch pages, kernel choice
        best = [float("inf")] * len(batches)
        for _ in range(_PASSES):
            for i, (rows, form) in enumerate(zip(batches, forms)):
                best[i] = min(best[i], self._time_once(rows, form))
        return best

    def swap_bandwidth(self) -> float:
        """Bytes per second of the engine's own block copy path, device -> host."""
        kv = self.target.kv
        bs = kv.block_size
        blocks = min(64, kv.pool.capacity, kv.host.num_blocks)
        if blocks == 0:
            return float("inf")
        slots = tuple(range(bs, (blocks + 1) * bs))  # skips the null block
        copy = KVCopy(CopyKind.D2H, slots, tuple(range(len(slots))), len(slots) * kv.bytes_per_token, "profile")
        secs = self._fastest(lambda: self.target.copy_blocks([copy]))
        return copy.nbytes / secs

    def _time_once(self, rows: list[tuple[int, int]], form: CacheForm) -> float:
        """Seconds of one forward pass over `(new tokens, cached tokens)` rows, every request in
        cache `form`; their KV is allocated before and freed after, outside the timing."""
        requests = [self._request(n + c) for n, c in rows]
        try:
            for r, (n, c) in zip(requests, rows):
                r.cache_form = form
                r.num_computed_tokens = 0
                if not self.target.kv.allocate(r, n + c):
                    raise RuntimeError("profiling grid does not fit the KV pool")
                r.num_computed_tokens = c
            items = [ScheduledItem(r, n) for r, (n, _) in zip(requests, rows)]
            return _timed(lambda: self.target.execute(items))
        finally:
            for r in requests:
                self.target.kv.free(r)

    def _request(self, length: int) -> Request:
        self._ids += 1
        tokens = torch.randint(0, self.vocab, (length,)).tolist()
        return Request(f"profile-{self._ids}", tokens, SamplingParams(max_tokens=1))

    @staticmethod
    def _fastest(fn: Callable[[], object]) -> float:
        fn()  # warm-up
        return min(_timed(fn) for _ in range(_PASSES))


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0
