"""Where a session's next turn runs in the simulator, and what its KV costs to get there.

Four modes, compared on the same arrivals (docs/sessions.md, "Symphony at its own scale"):

- `recompute` (vLLM without prefix caching): turns go wherever placement puts them and the
  whole history is prefilled again. The workers run with prefix caching off (`factory.py`).
- `recompute-cached` (today's vLLM: prefix caching, sticky routing): a turn goes to the worker
  that served the session's last turn and reuses what that worker's device prefix cache still
  holds; there is no host tier, so what the pool's LRU evicted is recomputed.
- `load-aware` (no hints): turns are placed by load; the KV follows at turn time from the
  target's host tier (PCIe) or from the holder (network), on the critical path.
- `hints` (Symphony): at the typing hint the real advisory's target rule
  (`services.advisory.targets.LeastLoadedTarget`, counting advised-but-not-arrived turns as
  pending load; the holder wins ties) picks the worker, and the KV is prefetched there in the
  background. The turn goes to that worker; if the copy is still in flight it waits for the rest
  (Symphony's pitfall 6), and if the device pool evicted the prefetched blocks meanwhile it
  reloads them from the target's host copy (cooperative memory management: no data lost).

The advisory target rule is imported from the service package because it is pure (no I/O, no
Kafka): the simulator already uses the scheduler's placement the same way, and a copy could drift.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from loadgen.sim.session_tiers import CopyCosts, HostTier
from loadgen.sim.worker import SimWorker
from services.advisory.targets import Candidate, LeastLoadedTarget

SESSION_MODES = ("recompute", "recompute-cached", "load-aware", "hints")


@dataclass
class Binding:
    """A hint's decision: the turn will run on `worker_id`; its KV is there at `ready_s`."""

    worker_id: str
    ready_s: float


@dataclass(frozen=True)
class Route:
    worker_id: str
    delay_s: float  # seconds before the turn can enter the worker (KV still moving)
    kv_tokens: list[int] | None  # history to place in the worker's prefix cache on entry


class SessionRouter:
    def __init__(self, mode: str, workers: dict[str, SimWorker], costs: CopyCosts, host_bytes: int) -> None:
        if mode not in SESSION_MODES:
            raise ValueError(f"unknown session mode {mode!r}; available: {', '.join(SESSION_MODES)}")
        self.mode, self.workers, self.costs = mode, workers, costs
        tiered = mode in ("load-aware", "hints")
        self.host = {wid: HostTier(host_bytes, costs.kv_bytes_per_token) for wid in workers} if tiered else {}
        # the inclusive disk copy (session -> history) per worker, when the costs name a disk
        self.disk: dict[str, dict[str, list[int]]] = (
            {wid: {} for wid in workers} if tiered and costs.disk_bytes_per_s > 0 else {}
        )
        self.holder: dict[str, str] = {}  # session -> worker that served its last turn
        self.bindings: dict[str, Binding] = {}  # hinted sessions whose turn has not arrived
        self.target_rule = LeastLoadedTarget()
        self.counts: Counter[str] = Counter()

    # -- hints ---------------------------------------------------------------------------

    def on_hint(self, session_id: str, now: float) -> tuple[str, float, list[int]] | None:
        """The advisor's decision for a typing hint: (target, when its KV is ready, the history
        to place there), or None (not `hints` mode, a session nobody holds, or a refresh)."""
        if self.mode != "hints":
            return None
        holder = self.holder.get(session_id)
        if holder is None or session_id in self.bindings:
            self.counts["hint_ignored" if holder is None else "hint_refresh"] += 1
            return None
        found = self._kept(holder, session_id)
        if found is None:  # evicted from every tier of the holder: nothing to move
            self.counts["hint_no_copy"] += 1
            return None
        history, on_disk = found
        read_s = self.costs.disk_to_device_s(len(history)) - self.costs.host_to_device_s(len(history)) if on_disk else 0
        target = self.target_rule.pick(holder, self._candidates()) or holder
        if target == holder:
            cached = self.workers[holder].cached_prefix_tokens(history)
            copy_s = read_s + self.costs.host_to_device_s(len(history) - cached)
            self.counts["hint_stay"] += 1
        else:
            copy_s = read_s + self.costs.worker_to_worker_s(len(history))
            self.counts["hint_move"] += 1
        ready = now + copy_s
        self.bindings[session_id] = Binding(target, ready)
        return target, ready, history

    def prefetched(self, worker_id: str, session_id: str, history: list[int], now: float) -> int:
        """A prefetch landed: the target keeps a host copy (inclusive) and fills its free device
        blocks with the history; returns the tokens placed on the device."""
        self.host[worker_id].keep(session_id, history, now, set(self.bindings))
        if self.disk:
            self.disk[worker_id][session_id] = history
        return self.workers[worker_id].import_prefix(history)

    # -- turns ---------------------------------------------------------------------------

    def route(self, session_id: str | None, placed: str, now: float) -> Route:
        """Where a session's turn runs (`placed`: the placement policy's choice) and what its
        KV costs to get there."""
        holder = self.holder.get(session_id or "")
        if session_id is None or holder is None:
            return Route(placed, 0.0, None)
        if self.mode == "recompute":
            return Route(placed, 0.0, None)
        if self.mode == "recompute-cached":
            self.counts["turn_sticky"] += 1
            return Route(holder, 0.0, None)
        binding = self.bindings.pop(session_id, None)
        if binding is not None:
            self.counts["turn_hinted"] += 1
            wait = binding.ready_s - now
            if wait > 0:  # the prefetch lands first (its event is older), then the turn enters
                self.counts["turn_waited_for_prefetch"] += 1
                return Route(binding.worker_id, wait, None)
            return self._fetch(binding.worker_id, session_id, holder)
        self.counts["turn_unhinted"] += 1
        return self._fetch(placed, session_id, holder)

    def on_finish(self, worker_id: str, session_id: str, token_ids: list[int], now: float) -> None:
        """A turn finished on `worker_id`: it holds the session now; other workers' copies are
        stale (shorter) and dropped."""
        self.holder[session_id] = worker_id
        if not self.host:
            return
        for wid, tier in self.host.items():
            if wid != worker_id:
                tier.drop(session_id)
                self.disk.get(wid, {}).pop(session_id, None)
        if self.disk:
            self.disk[worker_id][session_id] = token_ids
        if not self.host[worker_id].keep(session_id, token_ids, now, set(self.bindings)):
            self.counts["host_too_small"] += 1

    # -- internals -----------------------------------------------------------------------

    def _fetch(self, wid: str, session_id: str, holder: str) -> Route:
        """The turn runs on `wid` now: its history from `wid`'s device, its host tier, or the
        holder's host tier over the network; recomputed when no tier kept it."""
        worker = self.workers[wid]
        local = self._kept(wid, session_id)
        found = local if local is not None else self._kept(holder, session_id)
        if found is None:
            self.counts["kv_recomputed"] += 1
            return Route(wid, 0.0, None)
        kept, on_disk = found
        on_device = worker.cached_prefix_tokens(kept)
        if on_device >= len(kept) // worker.spec.block_size * worker.spec.block_size:
            self.counts["kv_device_hit"] += 1
            return Route(wid, 0.0, None)
        read_s = self.costs.disk_to_device_s(len(kept)) - self.costs.host_to_device_s(len(kept)) if on_disk else 0
        if local is not None:
            self.counts["kv_from_disk" if on_disk else "kv_from_host"] += 1
            return Route(wid, read_s + self.costs.host_to_device_s(len(kept) - on_device), kept)
        self.counts["kv_from_peer"] += 1
        return Route(wid, read_s + self.costs.worker_to_worker_s(len(kept)), kept)

    def _kept(self, wid: str, session_id: str) -> tuple[list[int], bool] | None:
        """`wid`'s copy of the session: (history, whether it must be read from disk), or None."""
        host = self.host[wid].get(session_id)
        if host is not None:
            return host, False
        disk = self.disk.get(wid, {}).get(session_id)
        return None if disk is None else (disk, True)

    def _candidates(self) -> list[Candidate]:
        pending = Counter(b.worker_id for b in self.bindings.values())
        out = []
        for wid, w in self.workers.items():
            c = w.counts()
            out.append(
                Candidate(
                    wid,
                    running=c["running_rt"] + c["waiting_rt"] + 0.25 * (c["running_be"] + c["waiting_be"]),
                    pending=pending[wid],
                    kv_usage=w.kv_usage(),
                    max_num_seqs=w.spec.max_num_seqs,
                )
            )
        return out
