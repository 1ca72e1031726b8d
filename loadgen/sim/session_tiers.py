"""Sessions' KV between turns in the simulator: a host tier per worker and the copy costs.

The device tier is the worker's own paged pool and prefix cache (`SimWorker.kv`), exactly as in
the engine (docs/sessions.md, "The tiers"): a finished turn's blocks stay registered and the
pool's LRU evicts them under pressure. This module adds what the engine keeps beside it:

- `HostTier`: the session's whole history (prompt + output) in host memory under a byte
  budget, evicted by the engine's own policy class (`engine.sessions.eviction`,
  `idle-layer-size` by default). The simulator has no disk tier, and the real host tier then
  evicts whole sessions (a partial copy could not be completed from anywhere), so each session
  is one candidate; "busy" means a pending hint, as in the engine.
- A disk tier (optional, `CopyCosts.disk_bytes_per_s`): Symphony's inclusive copy of every
  session, unbounded (the paper's 4 TB SSDs hold far more than a run writes); reading it costs
  the disk's bandwidth before the PCIe copy.
- `CopyCosts`: seconds to move KV host->device (PCIe) and worker->worker (the network). A copy
  is charged in full before the turn can run on the worker; the engine's layer-wise overlap
  would hide part of a host load behind the prefill, so this is the pessimistic side (it
  penalises `load-aware`, which copies at turn time, not `hints`, which copies ahead).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sessions.eviction import EvictionCandidate, EvictionPolicy, make_eviction_policy

GIB = 2**30


@dataclass(frozen=True)
class CopyCosts:
    kv_bytes_per_token: int
    pcie_bytes_per_s: float = 25e9  # PCIe 4.0 x16, effective (H100 SXM hosts: PCIe 5, ~2x)
    network_bytes_per_s: float = 12.5e9  # 100 Gbps Ethernet, Symphony's testbed
    disk_bytes_per_s: float = 0.0  # 0: no disk tier (an NVMe SSD reads ~3e9)

    def host_to_device_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.pcie_bytes_per_s

    def disk_to_device_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.disk_bytes_per_s + self.host_to_device_s(tokens)

    def worker_to_worker_s(self, tokens: int) -> float:
        """Network transfer, then the target's host->device copy (not pipelined: pessimistic)."""
        return tokens * self.kv_bytes_per_token / self.network_bytes_per_s + self.host_to_device_s(tokens)


@dataclass
class KeptHistory:
    token_ids: list[int]
    last_activity: float


class HostTier:
    """Whole sessions' token histories in one worker's host memory, under `budget_bytes`."""

    def __init__(self, budget_bytes: int, bytes_per_token: int, policy: str = "idle-layer-size") -> None:
        if budget_bytes < 0 or bytes_per_token <= 0:
            raise ValueError(
                f"host tier needs a budget >= 0 and bytes per token > 0, got {budget_bytes}, {bytes_per_token}"
            )
        self.budget_bytes, self.bytes_per_token = budget_bytes, bytes_per_token
        self.policy: EvictionPolicy = make_eviction_policy(policy)
        self.sessions: dict[str, KeptHistory] = {}
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return sum(len(k.token_ids) for k in self.sessions.values()) * self.bytes_per_token

    def get(self, session_id: str) -> list[int] | None:
        kept = self.sessions.get(session_id)
        return None if kept is None else kept.token_ids

    def drop(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def keep(self, session_id: str, token_ids: list[int], now: float, busy: set[str]) -> bool:
        """Keep (or replace) a session's history, evicting others by the policy until it fits;
        False when it is larger than the whole budget (then it is not kept)."""
        self.sessions.pop(session_id, None)
        need = len(token_ids) * self.bytes_per_token
        if need > self.budget_bytes:
            return False
        used = self.used_bytes
        if used + need > self.budget_bytes:
            for victim in self.policy.order(self._candidates(busy)):
                used -= victim.session_nbytes
                del self.sessions[victim.session_id]
                self.evictions += 1
                if used + need <= self.budget_bytes:
                    break
        self.sessions[session_id] = KeptHistory(list(token_ids), now)
        return True

    def _candidates(self, busy: set[str]) -> list[EvictionCandidate]:
        out = []
        for sid, kept in self.sessions.items():
            nbytes = len(kept.token_ids) * self.bytes_per_token
            out.append(EvictionCandidate(sid, 0, nbytes, sid in busy, nbytes, kept.last_activity))
        return out
