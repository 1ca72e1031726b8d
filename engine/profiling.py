"""Profile the real model on the real device to fit the BROS cost model (a few seconds, cached).

Dummy batches run through the engine's own `ModelRunner` on a power-of-two grid: prefill
rows of 1 and 4 requests up to the token budget, decode batches up to `max_num_seqs` (64 at
most) at contexts up to the model length, as far as the KV pool holds them. Swap bandwidth
comes from copying blocks between the KV pool and host space with the engine's own copy
path. Each point is the *minimum* of a few timed runs after a warm-up: on a shared machine
other processes only ever add time, so the minimum is the least disturbed estimate. A handful of mixed
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
A cached profile without the term gets it added on first use and is saved again.

Profiles are cached under `$TANDEM_CACHE_DIR/profiles/`, keyed by the model file, device,
dtype, thread count, block size, the grid limits and the decode attention kernel.

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
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.cost_model import CostModel, Sample, fit, mape, nonneg_lstsq
from engine.kv import KVCacheManager
from engine.kv.copies import CopyKind, KVCopy
from engine.kv.hidden import CacheForm
from engine.loader.cache import default_cache_dir, file_cache_key
from engine.sampling import SamplingParams
from engine.scheduling.policy import ScheduledItem
from engine.scheduling.request import Request

log = logging.getLogger(__name__)
PROFILE_VERSION = "1"
_REPEATS = 3


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


def profile_path(target: ProfileTarget, source, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "profiles" / f"{profile_key(target, source)}.json"


def profile_cached(target: ProfileTarget, source, cache_dir: Path | None = None) -> CostModel:
    path = profile_path(target, source, cache_dir)
    if path.exists():
        try:
            model = CostModel.load(path)
        except ValueError:
            log.warning("ignoring unreadable cost profile %s", path)
        else:
            if target.calibrate_hidden and model.hidden_s_per_token is None:
                model = with_hidden(target, model)
                model.save(path)
            return model
    model = profile(target)
    model.save(path)
    log.info("cost model profiled in %.1f s, saved to %s", model.meta["profile_seconds"], path)
    return model


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
    start = time.perf_counter()
    bench = _Bench(target)
    prefill = [bench.prefill(n, k) for n, k in _prefill_grid(target)]
    decode = [bench.decode(b, c) for b, c in _decode_grid(target)]
    mixed = [bench.mixed(n, b, c) for n, b, c in _mixed_grid(target)]
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
    return with_hidden(target, model) if target.calibrate_hidden else model


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

    bench = _Bench(target)
    points = []
    for b, c in _hidden_grid(target):
        rows = [(1, c - 1)] * b
        points.append((b * (c - 1), bench._time(rows, CacheForm.HIDDEN) - bench._time(rows)))
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
    return CostModel(model.prefill, model.decode, model.swap_bytes_per_s, meta, rebuild.per_token_s)


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


def _mixed_mape(model: CostModel, mixed: list[tuple[list, list, float]]) -> float:
    errs = [abs(model.estimate(p, d) - secs) / secs for p, d, secs in mixed]
    return sum(errs) / len(errs) if errs else 0.0


class _Bench:
    """Times dummy batches through the engine's runner, using its (idle) KV pool."""

    def __init__(self, target: ProfileTarget) -> None:
        self.target = target
        self.vocab = target.vocab_size
        self._ids = 0

    def prefill(self, n: int, k: int) -> Sample:
        rows = [(n // k, 0)] * k
        secs = self._time(rows)
        return Sample(n // k * k, sum(m * m for m, _ in rows), secs)

    def decode(self, batch: int, context: int) -> Sample:
        secs = self._time([(1, context - 1)] * batch)
        return Sample(batch, batch * context, secs)

    def mixed(self, n: int, batch: int, context: int) -> tuple[list, list, float]:
        secs = self._time([(n, 0)] + [(1, context - 1)] * batch)
        return [(n, n)], [(1, context)] * batch, secs

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

    def _time(self, rows: list[tuple[int, int]], form: CacheForm = CacheForm.KV) -> float:
        """Fastest seconds of one forward pass over `(new tokens, cached tokens)` rows, every
        request in cache `form`."""
        requests = [self._request(n + c) for n, c in rows]
        try:
            for r, (n, c) in zip(requests, rows):
                r.cache_form = form
                r.num_computed_tokens = 0
                if not self.target.kv.allocate(r, n + c):
                    raise RuntimeError("profiling grid does not fit the KV pool")
                r.num_computed_tokens = c
            items = [ScheduledItem(r, n) for r, (n, _) in zip(requests, rows)]
            return self._fastest(lambda: self.target.execute(items))
        finally:
            for r in requests:
                self.target.kv.free(r)

    def _request(self, length: int) -> Request:
        self._ids += 1
        tokens = torch.randint(0, self.vocab, (length,)).tolist()
        return Request(f"profile-{self._ids}", tokens, SamplingParams(max_tokens=1))

    @staticmethod
    def _fastest(fn: Callable[[], object]) -> float:
        fn()  # warm-up: allocator, first-touch pages
        times = []
        for _ in range(_REPEATS):
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)
