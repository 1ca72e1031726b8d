"""Multi-turn sessions (Symphony): typing hints, the session directory, placements, prefetches.

- `advisory` (key session id): `TypingHint`, published by the gateway when a user starts typing.
- `sessions.directory` (compacted, key session id): `SessionLocation`, published by a worker
  whenever a session's kept KV changes there (kept or grown after a turn, promoted, pulled,
  dropped). Readers keep, per session, the entry with the latest `last_activity`: that worker is
  the session's holder.
- `sessions.placement` (compacted, key session id): `SessionPlacement`, published by the advisory
  service for a hint: the worker the session's next turn should go to, until `expires_at`
  (a tombstone once expired).
- `control`: `Prefetch`, from the advisory service to the placement's worker: make the session's
  KV ready (promote it locally, or pull it from `source_url` first).
"""

from __future__ import annotations

import urllib.parse
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.schemas.base import WireModel

MAX_SESSION_ID_LEN = 256  # session ids travel in URLs, Kafka keys and log lines
KV_PATH = "/kv/v1/sessions/"


def session_kv_url(base_url: str, session_id: str) -> str:
    """The URL a worker serves a session's KV file at, given its KV server's base URL."""
    return base_url.rstrip("/") + KV_PATH + urllib.parse.quote(session_id, safe="")


def check_session_id(session_id: str) -> str:
    """Raises ValueError for an id that cannot name a session."""
    if not session_id or len(session_id) > MAX_SESSION_ID_LEN:
        raise ValueError(f"a session id must have 1 to {MAX_SESSION_ID_LEN} characters")
    if any(ord(c) < 32 for c in session_id):
        raise ValueError("a session id must not contain control characters")
    return session_id


class TypingHint(WireModel):
    """The user of a session started typing: a turn is probably coming."""

    hint_id: str
    session_id: str
    sent_at: float  # wall clock at the gateway (time.time())
    expected_arrival_s: float | None = Field(None, ge=0)  # the front-end's guess, seconds from sent_at
    source: Literal["http", "websocket"] = "http"


class SessionLocation(WireModel):
    """Where one worker holds a session's KV (a directory entry)."""

    session_id: str
    worker_id: str
    kv_url: str | None = None  # the worker's KV server base URL (None: it serves no peers)
    tiers: list[str] = Field(default_factory=list)  # of "gpu", "host", "disk"
    num_tokens: int = 0  # tokens with kept KV (full blocks)
    nbytes: int = 0
    last_activity: float = 0.0  # wall clock of the session's last turn or move
    dropped: bool = False  # the worker no longer holds it


class SessionPlacement(WireModel):
    """The worker a session's next turn goes to (chosen by the advisory service from a hint)."""

    session_id: str
    worker_id: str
    hint_id: str
    expires_at: float  # wall clock; the scheduler ignores the placement after this
    source_worker: str | None = None  # the holder the target pulls from (None: the target holds it)
    # The advisory service's lease term (shared/lease.py): the scheduler drops a placement of an
    # older term than one it has read (a deposed advisory service woke up and published it).
    term: int = 0


class KVSourceRef(BaseModel):
    """A peer the worker running a turn can pull the session's KV from."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    worker_id: str
    url: str  # the session's KV URL on that peer (`session_kv_url`)
    num_tokens: int = 0  # tokens the peer holds (a worker with fewer locally pulls the newer copy)


class Prefetch(BaseModel):
    """Control message: worker `worker_id`, make `session_id`'s KV ready for a turn expected soon."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["prefetch"] = "prefetch"
    worker_id: str  # the target; other workers ignore it
    session_id: str
    hint_id: str
    source_worker: str | None = None  # None: the target holds the KV itself (local promotion)
    source_url: str | None = None
    source_tokens: int = 0
    ttl_s: float = 30.0  # the worker drops its pin on the prefetched KV after this
    # The advisory service's lease term (shared/lease.py), as on `SessionPlacement`: workers drop
    # a prefetch of an older term than one they have read on `control` (a deposed advisory
    # service woke up and sent it; its successor decides where sessions go).
    term: int = 0
