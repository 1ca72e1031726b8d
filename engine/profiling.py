"""Profile the real model on the real device to fit the BROS cost model (a few seconds, cached).

Dummy batches run through the engine's own `ModelRunner` on a power-of-two grid: prefill
rows of 1 and 4 requests up to the token budget, decode batches up to `max_num_seqs` (64 at
most) at contexts up to the model length, as far as the KV pool holds them. Swap bandwidth
comes from copying blocks between the KV pool and host space with the engine's own copy
path. Each point is the *minimum* of a few timed runs after a warm-up: on a shared machine
other processes only ever add time, so the minimum is the least disturbed estimate. A handful of mixed
prefill+decode batches are measured but not fitted, to report how well the sum of the two
phase models predicts them.

Profiles are cached under `$TANDEM_CACHE_DIR/profiles/`, keyed by the model file, device,
dtype, thread count, block size, the grid limits and the decode attention kernel.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.cost_model import CostModel, Sample, fit, mape
from engine.kv.copies import CopyKind, KVCopy
from engine.loader.cache import default_cache_dir, file_cache_key
from engine.sampling import SamplingParams
from engine.scheduling.policy import ScheduledItem
from engine.scheduling.request import Request

if TYPE_CHECKING:
    from engine.engine import LLMEngine

log = logging.getLogger(__name__)
PROFILE_VERSION = "1"
_REPEATS = 3


def profile_path(engine: LLMEngine, source, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "profiles" / f"{profile_key(engine, source)}.json"


def profile_cached(engine: LLMEngine, source, cache_dir: Path | None = None) -> CostModel:
    path = profile_path(engine, source, cache_dir)
    if path.exists():
        try:
            return CostModel.load(path)
        except ValueError:
            log.warning("ignoring unreadable cost profile %s", path)
    model = profile(engine)
    model.save(path)
    log.info("cost model profiled in %.1f s, saved to %s", model.meta["profile_seconds"], path)
    return model


def profile_key(engine: LLMEngine, source) -> str:
    cfg = engine.config
    parts = [
        PROFILE_VERSION,
        cfg.device,
        cfg.dtype,
        str(torch.get_num_threads()),
        str(cfg.block_size),
        str(cfg.max_num_batched_tokens),
        str(cfg.max_num_seqs),
        str(engine.max_model_len),
        engine.runner.decode_kernel,  # the attention kernel and the layer graph change decode step times
        str(engine.runner.decode_graph is not None),
        *(["kv-heads-expand"] if cfg.kv_heads_expand else []),  # MHA memory shape: other KV traffic
    ]
    model_file = source.path / "config.json" if source.path.is_dir() else source.path
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
    return f"{source.name}-{cfg.device}-{cfg.dtype}-{file_cache_key(model_file, *parts)[:12]}-{digest}"


def profile(engine: LLMEngine) -> CostModel:
    start = time.perf_counter()
    bench = _Bench(engine)
    prefill = [bench.prefill(n, k) for n, k in _prefill_grid(engine)]
    decode = [bench.decode(b, c) for b, c in _decode_grid(engine)]
    mixed = [bench.mixed(n, b, c) for n, b, c in _mixed_grid(engine)]
    swap_bps = bench.swap_bandwidth()
    model = CostModel(fit(prefill), fit(decode), swap_bps)
    meta = {
        "model": engine.model_config.name,
        "device": engine.config.device,
        "dtype": engine.config.dtype,
        "threads": torch.get_num_threads(),
        "swap_overlaps": False,  # copies run before the forward pass
        "prefill_mape": mape(model.prefill, prefill),
        "decode_mape": mape(model.decode, decode),
        "mixed_mape": _mixed_mape(model, mixed),
        "num_samples": len(prefill) + len(decode),
        "profile_seconds": time.perf_counter() - start,
    }
    return CostModel(model.prefill, model.decode, swap_bps, meta)


def _pow2(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def _prefill_grid(engine: LLMEngine) -> list[tuple[int, int]]:
    top = min(engine.config.max_num_batched_tokens, engine.max_model_len - 1, engine.kv.capacity_tokens() // 2)
    return [(n, k) for n in _pow2(16, top) for k in (1, 4) if n // k >= 8]


def _decode_grid(engine: LLMEngine) -> list[tuple[int, int]]:
    capacity = engine.kv.capacity_tokens() - engine.config.block_size * 8
    batches = _pow2(1, min(engine.config.max_num_seqs, 64))
    contexts = _pow2(64, min(engine.max_model_len - 1, 2048))
    return [(b, c) for b in batches for c in contexts[::2] if b * (c + engine.config.block_size) <= capacity]


def _mixed_grid(engine: LLMEngine) -> list[tuple[int, int, int]]:
    cfg, bs = engine.config, engine.config.block_size
    top = min(cfg.max_num_batched_tokens, 256, engine.max_model_len - 1)
    context = min(128, engine.max_model_len // 2)
    capacity = engine.kv.capacity_tokens() - bs * 8
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

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.vocab = engine.model_config.vocab_size
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
        kv, storage = self.engine.kv, self.engine.storage
        bs = kv.block_size
        blocks = min(64, kv.pool.capacity, kv.host.num_blocks)
        if blocks == 0:
            return float("inf")
        slots = tuple(range(bs, (blocks + 1) * bs))  # skips the null block
        copy = KVCopy(CopyKind.D2H, slots, tuple(range(len(slots))), len(slots) * kv.bytes_per_token, "profile")
        secs = self._fastest(lambda: storage.execute([copy]))
        return copy.nbytes / secs

    def _time(self, rows: list[tuple[int, int]]) -> float:
        """Fastest seconds of one forward pass over `(new tokens, cached tokens)` rows."""
        requests = [self._request(n + c) for n, c in rows]
        try:
            for r, (n, c) in zip(requests, rows):
                r.num_computed_tokens = 0
                if not self.engine.kv.allocate(r, n + c):
                    raise RuntimeError("profiling grid does not fit the KV pool")
                r.num_computed_tokens = c
            items = [ScheduledItem(r, n) for r, (n, _) in zip(requests, rows)]
            return self._fastest(lambda: self.engine.runner.execute(items))
        finally:
            for r in requests:
                self.engine.kv.free(r)

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
