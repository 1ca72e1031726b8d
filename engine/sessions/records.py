"""What the session store hands out: session facts, prefetch results and counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

TIERS = ("gpu", "host", "disk")  # fastest first


@dataclass(frozen=True)
class SessionInfo:
    """A kept session as the directory sees it. `tiers` lists where a *complete* copy is
    ("gpu": every kept block is in the device pool; "host": every layer in host memory;
    "disk": the file); an empty `tiers` means the session was dropped."""

    session_id: str
    num_tokens: int  # kept tokens (full blocks of prompt + output that have KV)
    tiers: tuple[str, ...]
    nbytes: int  # KV bytes of the kept tokens (about the transfer size)
    last_activity: float  # time.time() of the last turn, hint or adoption

    @property
    def dropped(self) -> bool:
        return not self.tiers


@dataclass(frozen=True)
class PrefetchResult:
    session_id: str
    found: bool  # False: the session is unknown here (nothing pinned)
    tier: str | None  # the slowest tier the promotion read from: "gpu" (nothing to move), "host" or "disk"
    num_tokens: int  # kept tokens of the session
    tokens_promoted: int  # tokens copied into device blocks by this call (layer-wise, in the background)
    tokens_pinned: int  # tokens now held on the device until a request of the session arrives or expires_at
    expires_at: float | None  # time.time() at which an unused pin is released


@dataclass
class SessionStats:
    tokens_reused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    tokens_computed: int = 0  # prompt tokens computed for session turns
    tokens_recomputed: int = 0  # of those, tokens the session had kept KV for (evicted, failed, mismatched)
    bytes_host_to_gpu: int = 0
    bytes_disk_to_gpu: int = 0
    bytes_written_disk: int = 0
    turns: int = 0  # session turns ended (finished or aborted)
    prefetches: int = 0
    load_failures: int = 0
    host_layer_evictions: int = 0
    sessions_dropped: int = 0  # deleted for the disk budget
    sessions_adopted: int = 0
    disk_write_failures: int = 0

    def as_dict(self) -> dict:
        return asdict(self)
