"""What other threads may know about a running engine: static facts and per-step snapshots.

The engine's state (queues, block pool, session store) belongs to the engine thread; a reader
on another thread that walks it can meet a list or dict changing size under it. So the engine
thread *publishes*: `EngineInfo` once (what never changes while it runs) and, at the end of
every step and when idle, an `EngineSnapshot`, a frozen value built from its state on its own
thread. A reader holds a reference to one snapshot and reads it at leisure; the next one
replaces the reference, never the contents. `AsyncLLM.snapshot()` is the worker's only view of
load, KV use and session counters (heartbeats, telemetry, metrics).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from engine.cost_model import CostModel
from engine.scheduling import Request, RequestClass


class FrozenCounters(Mapping[str, float]):
    """A read-only mapping over its own copy of the counters (copies and pickles, unlike a
    `MappingProxyType`, so `dataclasses.asdict(snapshot)` works)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, float] = ()) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> float:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenCounters({self._data!r})"

    def __reduce__(self):
        return FrozenCounters, (self._data,)


@dataclass(frozen=True)
class EngineInfo:
    """Facts about an engine that do not change while it runs."""

    model: str  # as configured ("default", a directory, a .gguf file)
    model_name: str  # the model's own name
    device: str
    dtype: str  # resolved: never "auto"
    max_model_len: int
    vocab_size: int
    block_size: int
    kv_blocks: int  # the device pool's blocks, the null block included
    max_num_seqs: int
    policy: str
    cost_model: CostModel | None = None  # the step-time profile, when one was given or profiled (frozen)


@dataclass(frozen=True)
class ClassCounts:
    running: int  # admitted: holding KV
    waiting: int  # queued, or preempted and waiting to be recomputed


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's load as of one moment on the engine thread. Immutable: its mappings are
    `FrozenCounters`, its sequences tuples."""

    seq: int  # publication number, increasing; 0 = the engine was just built
    taken_at: float  # time.monotonic() when it was taken
    rt: ClassCounts
    be: ClassCounts
    running_ids: tuple[str, ...]  # the engine's running requests, in admission order
    kv_blocks_free: int  # allocatable now (free or evictable cached blocks)
    kv_blocks_capacity: int  # allocatable in all (the pool without its null block)
    session_stats: Mapping[str, int]  # the session store's counters, flat (`tokens_reused_gpu`, ...)
    engine_stats: Mapping[str, float]  # `EngineStats.as_dict()`: steps, tokens, preemptions, times
    # the policy's own figures (`SchedulingPolicy.published_stats`; ellm's `DecisionStats`), None: none
    policy_stats: Mapping[str, float] | None = None

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_capacity - self.kv_blocks_free

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool in use, as `BlockPool.usage()` computes it."""
        return 1.0 - self.kv_blocks_free / self.kv_blocks_capacity

    @property
    def num_unfinished(self) -> int:
        return self.rt.running + self.rt.waiting + self.be.running + self.be.waiting

    def counts(self, req_class: RequestClass) -> ClassCounts:
        return self.rt if req_class is RequestClass.RT else self.be


def take_snapshot(
    seq: int,
    running: list[Request],
    waiting,
    kv_blocks_free: int,
    kv_blocks_capacity: int,
    session_stats: dict,
    engine_stats: dict,
    policy_stats: dict | None = None,
) -> EngineSnapshot:
    """Build a snapshot from the engine's live state. Engine thread only: it walks the queues."""
    rt_running = sum(1 for r in running if r.req_class is RequestClass.RT)
    rt_waiting = sum(1 for r in waiting if r.req_class is RequestClass.RT)
    return EngineSnapshot(
        seq=seq,
        taken_at=time.monotonic(),
        rt=ClassCounts(rt_running, rt_waiting),
        be=ClassCounts(len(running) - rt_running, len(waiting) - rt_waiting),
        running_ids=tuple(r.request_id for r in running),
        kv_blocks_free=kv_blocks_free,
        kv_blocks_capacity=kv_blocks_capacity,
        session_stats=FrozenCounters(flatten_stats(session_stats)),
        engine_stats=FrozenCounters(engine_stats),
        policy_stats=None if policy_stats is None else FrozenCounters(policy_stats),
    )


def flatten_stats(stats: dict) -> dict[str, int]:
    """`{"tokens_reused": {"gpu": 3}}` -> `{"tokens_reused_gpu": 3}`: one level, flat keys."""
    out: dict[str, int] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            out.update({f"{key}_{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out
