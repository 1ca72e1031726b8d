"""The gateway's one settings object (`TANDEM_*` env vars; `tandem gateway` flags override).

It includes the batch store's location (`BatchStoreSettings`): the gateway serves the Files
and Batches API from the same database the queue service runs jobs from.
"""

from __future__ import annotations

from shared.batchstore.settings import BatchStoreSettings


class GatewaySettings(BatchStoreSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    gateway_id: str = ""  # default: host-pid; names this replica's results partition owner
    reply_partition: int | None = None  # default: derived from gateway_id
    max_inflight: int = 1024  # concurrent requests before 429
    max_body_bytes: int = 4 * 1024 * 1024  # 413 above this
    request_timeout_s: float = 600.0  # a request with no result this long gets 504
    first_event_timeout_s: float = 60.0  # no worker accepted it this long: 503
    rt_ttft_ms: float | None = None  # class-default SLOs sent with requests (per-request `tandem` overrides)
    rt_tpot_ms: float | None = None
    typing_debounce_s: float = 2.0  # per session, at most one typing hint this often (a burst is one hint)
    max_file_bytes: int = 100 * 1024 * 1024  # batch input uploads above this are a 413
    # API keys (services/gateway/auth.py): open until the first key exists, unless required.
    auth_required: bool = False  # true: every /v1 request needs a key even when none exists yet
    key_cache_ttl_s: float = 2.0  # how stale a key's record may be (a revoke takes this long at most)
    # RT dispatch by grant (services/gateway/grants.py; the scheduler's `rt_grants` reads the same
    # TANDEM_RT_GRANTS): send RT requests straight to a worker within the scheduler's grant (two
    # hops to the first token); off: every request through the scheduler (three hops).
    rt_grants: bool = False
    # When the flagged copy of a granted request goes to `requests.rt` (docs/services.md, issue 21,
    # twelfth session): 0 = with the dispatch (one round trip); > 0 = once the request's first
    # result event arrives, or this many ms after the dispatch's ack, whichever comes first (at
    # once when its stream closes sooner), so the scheduler's and the broker's work on the copy
    # does not compete with the worker's first step on a small host. 1000: paired TTFT median
    # better than 0 in all three runs (-1.0 to -8.5 ms), p99 in two of three.
    rt_grant_copy_after_ms: float = 1000.0
