"""Who is calling: API keys on every `/v1` route, and what the caller's key allows.

One app-wide dependency (`Authenticator.__call__`) runs before every route; it acts on paths
under `/v1/` only, so it cannot miss a route added later. Decisions:

- **Open until the first key.** With no key in the database (`tandem keys create` never run) the
  stack stays open, as before, and a key sent anyway is ignored (OpenAI clients always send
  one). Once any key exists, revoked ones included, every `/v1` request needs a valid one:
  revoking the last key never silently reopens the stack. `TANDEM_AUTH_REQUIRED=true` closes a
  stack with no keys too (fail closed from the first start). A gateway bound to a non-loopback
  address with no keys warns at start.
- **Open routes**: `/` (the chat page: static files; its API calls carry the key the user
  enters), `/static/*`, `/health` (load balancers probe it), `/metrics` (Prometheus scrapes it;
  it has no per-key labels), and `/openapi.json` and `/docs` (the API's description is not a
  secret). Firewall them if that is not what you want.
- **The key**: `Authorization: Bearer <key>`. A WebSocket from a browser cannot set headers, so
  `/v1/sessions/{id}/events` also takes it as a `Sec-WebSocket-Protocol` entry
  `tandem-key.<key>` (offer `tandem.v1` beside it; the server selects that one).
- **Cache**: a key's record (or its absence) is cached for `TANDEM_KEY_CACHE_TTL_S` (2 s), so a
  request costs no database read and a revoke takes effect within that TTL on every replica.
  The presented key's SHA-256 is compared in constant time with the cached hash.
- **Errors** (OpenAI's shape): 401 `invalid_api_key` (missing, malformed, unknown or revoked;
  with `WWW-Authenticate: Bearer`), 403 `class_not_allowed` / `admin_required`, 429
  `rate_limit_exceeded` with `Retry-After`, 503 `auth_unavailable` when the key store cannot be
  read and nothing is cached.
- **Class**: a request that names no class (no `X-Tandem-Class`, no `service_tier` "flex" or
  "priority": what every stock OpenAI client sends) runs in the key's default class, RT when the
  key allows it, else BE; one that names a class the key does not allow is a 403, never
  silently downgraded (a client that asked for interactive latency must learn it will not get
  it).
- **Sessions** are per key: the wire session id is `<key id>/<client's id>`, so two tenants
  choosing the same id never touch each other's kept KV (the cache salt alone would keep their
  KV apart, but one tenant's turn would still replace the other's kept session).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import WebSocketException
from starlette.requests import HTTPConnection

from services.gateway.database import GatewayDatabase
from services.gateway.errors import APIError
from services.gateway.limits import KeyLimiter, Refusal
from services.gateway.settings import GatewaySettings
from shared.apikeys.keys import ApiKey, key_id_of, key_matches
from shared.apikeys.store import KeyStore

log = logging.getLogger(__name__)
WS_KEY_PROTOCOL = "tandem-key."
WS_PROTOCOL = "tandem.v1"
_UNAUTHENTICATED = {"WWW-Authenticate": "Bearer"}


@dataclass(frozen=True)
class Caller:
    """The caller of one request: its key, or None on an open stack."""

    key: ApiKey | None = None

    @property
    def owner(self) -> str | None:
        """Whose files and batches it sees and creates (the key id)."""
        return None if self.key is None else self.key.id

    @property
    def cache_salt(self) -> str | None:
        return None if self.key is None else self.key.cache_salt

    def session_id(self, client_session_id: str) -> str:
        """The session id on the wire: per key, so tenants' ids never collide."""
        return client_session_id if self.key is None else f"{self.key.id}/{client_session_id}"

    def request_class(self, asked: str | None) -> str:
        """The class a request runs in (`asked`: what it named, None when nothing)."""
        if self.key is None:
            return asked or "rt"
        if asked is None:
            return self.key.default_class
        if not self.key.allows(asked):
            raise APIError(
                403,
                f"this API key may not send {asked.upper()} requests (allowed: {', '.join(self.key.classes)})",
                code="class_not_allowed",
                param="service_tier",
            )
        return asked


OPEN = Caller()


def caller_of(conn: HTTPConnection) -> Caller:
    """The caller the auth dependency found for this `/v1` request."""
    return conn.state.caller


class KeyCache:
    """Key records (and unknown ids) and "is any key configured", each cached `ttl_s` seconds."""

    def __init__(
        self, db: GatewayDatabase, ttl_s: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 10_000
    ) -> None:
        self.db, self.ttl_s, self._clock, self._max = db, ttl_s, clock, max_keys
        self._keys: OrderedDict[str, tuple[float, tuple[ApiKey, str] | None]] = OrderedDict()
        self._closed: tuple[float, bool] | None = None

    async def _store(self) -> KeyStore:
        return KeyStore(await self.db.get())

    async def any_keys(self) -> bool:
        now = self._clock()
        if self._closed is None or now - self._closed[0] >= self.ttl_s:
            self._closed = (now, await (await self._store()).any_keys())
        return self._closed[1]

    async def lookup(self, key_id: str) -> tuple[ApiKey, str] | None:
        """The key with this id and its stored hash, or None (negative answers are cached too)."""
        now = self._clock()
        hit = self._keys.get(key_id)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        found = await (await self._store()).get(key_id)
        self._keys[key_id] = (now, found)
        self._keys.move_to_end(key_id)
        while len(self._keys) > self._max:
            self._keys.popitem(last=False)
        return found

    def forget(self, key_id: str) -> None:
        """Drop a cached record (this replica just changed it)."""
        self._keys.pop(key_id, None)


class Authenticator:
    def __init__(self, settings: GatewaySettings, db: GatewayDatabase) -> None:
        self.settings = settings
        self.keys = KeyCache(db, settings.key_cache_ttl_s)
        self.limiter = KeyLimiter()

    async def start(self) -> None:
        """Warn when the gateway is reachable from other machines and nothing is protecting it."""
        host = self.settings.host
        if _is_loopback(host) or self.settings.auth_required:
            return
        try:
            closed = await self.keys.any_keys()
        except Exception:  # noqa: BLE001 (checked again on the first request)
            log.warning("could not read the API keys at start", exc_info=True)
            return
        if not closed:
            log.warning(
                "the gateway listens on %s, which is not a loopback address, and no API key exists: anyone who "
                "can reach port %d can use it. Create a key (`tandem keys create --name NAME`) to require one.",
                host,
                self.settings.port,
            )

    async def __call__(self, conn: HTTPConnection) -> None:
        """The app-wide dependency: authenticate and rate-limit every `/v1` request."""
        if not conn.url.path.startswith("/v1/"):
            return
        try:
            caller = await self.authenticate(_presented_key(conn))
            if caller.key is not None:
                raise_refusal(self.limiter.take_request(caller.key))
        except APIError as exc:
            if conn.scope["type"] == "websocket":  # refuses the handshake (HTTP 403 to the client)
                raise WebSocketException(code=1008, reason=exc.message[:120]) from None
            raise
        conn.state.caller = caller

    async def authenticate(self, presented: str | None) -> Caller:
        try:
            if not self.settings.auth_required and not await self.keys.any_keys():
                return OPEN
            if presented is None:
                raise _unauthenticated("no API key: send 'Authorization: Bearer <key>'")
            key_id = key_id_of(presented)
            found = None if key_id is None else await self.keys.lookup(key_id)
        except APIError:
            raise
        except Exception:  # noqa: BLE001 (the database is away and nothing is cached)
            log.warning("API key store unavailable", exc_info=True)
            raise APIError(503, "API keys cannot be checked right now; retry later", code="auth_unavailable") from None
        if found is None or not key_matches(presented, found[1]):
            raise _unauthenticated("incorrect API key provided")
        key = found[0]
        if not key.active:
            raise _unauthenticated(f"API key {key.id} has been revoked")
        return Caller(key)


def raise_refusal(refusal: Refusal | None) -> None:
    """A rate-limit refusal as OpenAI's 429 (type `requests` or `tokens`) with `Retry-After`."""
    if refusal is None:
        return
    raise APIError(
        429,
        f"rate limit of {refusal.limit} reached for this API key; retry in {refusal.retry_after_s}s",
        code="rate_limit_exceeded",
        type_=refusal.kind,
        headers={"Retry-After": str(refusal.retry_after_s)},
    )


def _unauthenticated(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers=_UNAUTHENTICATED)


def _presented_key(conn: HTTPConnection) -> str | None:
    header = conn.headers.get("authorization")
    if header is not None:
        scheme, _, value = header.strip().partition(" ")
        return value.strip() if scheme.lower() == "bearer" and value.strip() else None
    if conn.scope["type"] == "websocket":
        offered = conn.headers.get("sec-websocket-protocol", "")
        for protocol in (p.strip() for p in offered.split(",")):
            if protocol.startswith(WS_KEY_PROTOCOL):
                return protocol[len(WS_KEY_PROTOCOL) :]
    return None


def ws_subprotocol(conn: HTTPConnection) -> str | None:
    """The subprotocol to accept a WebSocket with: `tandem.v1` when offered (a browser that sent
    its key as a subprotocol needs one of its offers selected), else none."""
    offered = [p.strip() for p in conn.headers.get("sec-websocket-protocol", "").split(",")]
    return WS_PROTOCOL if WS_PROTOCOL in offered else None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything
