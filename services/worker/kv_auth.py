"""Peer authentication of the worker KV servers: an HMAC over each request with a cluster secret.

Session KV caches are users' prompts in another form; a worker's KV server must serve them only to
its peers. Every worker of a deployment shares one secret (`TANDEM_CLUSTER_SECRET`). A puller
signs each request, a server with a secret refuses anything not signed with it.

    X-Tandem-Timestamp: unix seconds (the sender's clock)
    X-Tandem-Nonce:     16 random bytes, hex
    X-Tandem-Signature: hex HMAC-SHA256(secret, "METHOD\\nPATH\\nTIMESTAMP\\nNONCE")

Decisions:
- HMAC rather than mTLS: one secret in settings and Compose, no certificates to issue and rotate,
  and the KV bytes stay on the cluster network as today (the file carries per-layer CRCs; the
  secret guards who may read, not the wire). mTLS can be added in front without changing this.
- Replay: a signature is good for `MAX_SKEW_S` either side of the server's clock and only once
  (the server remembers the nonces it accepted for that long). The path is signed, so a captured
  request cannot be turned to another session.
- Without a secret a server is open, as before (one machine, loopback); a server bound to a
  non-loopback address without one logs a warning at start, as the gateway does for API keys.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

TIMESTAMP = "x-tandem-timestamp"
NONCE = "x-tandem-nonce"
SIGNATURE = "x-tandem-signature"
MAX_SKEW_S = 30.0
_MAX_NONCES = 100_000  # bounds the replay memory under a flood of (valid) requests


def _mac(secret: str, method: str, path: str, timestamp: str, nonce: str) -> str:
    msg = f"{method}\n{path}\n{timestamp}\n{nonce}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def sign(secret: str, method: str, path: str, now: float | None = None) -> dict[str, str]:
    """The headers that authenticate one request for `path` (the URL's path, not its query)."""
    timestamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    return {TIMESTAMP: timestamp, NONCE: nonce, SIGNATURE: _mac(secret, method, path, timestamp, nonce)}


class PeerVerifier:
    """Checks signed requests against the cluster secret, each nonce accepted once."""

    def __init__(self, secret: str) -> None:
        self._secret = secret
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> when it stops mattering

    def check(self, method: str, path: str, headers: dict[str, str], now: float | None = None) -> str | None:
        """None when the request is authentic; otherwise why not (for the 401 body and the log)."""
        now = time.time() if now is None else now
        timestamp, nonce, signature = headers.get(TIMESTAMP), headers.get(NONCE), headers.get(SIGNATURE)
        if not (timestamp and nonce and signature):
            return "missing peer signature (X-Tandem-Timestamp, -Nonce, -Signature)"
        try:
            sent = float(timestamp)
        except ValueError:
            return "malformed timestamp"
        if abs(now - sent) > MAX_SKEW_S:
            return f"timestamp outside +-{MAX_SKEW_S:.0f}s of this server's clock"
        if not hmac.compare_digest(_mac(self._secret, method, path, timestamp, nonce), signature):
            return "bad signature"
        self._forget_expired(now)
        if nonce in self._nonces:
            return "replayed request"
        self._nonces[nonce] = sent + MAX_SKEW_S
        while len(self._nonces) > _MAX_NONCES:
            self._nonces.popitem(last=False)
        return None

    def _forget_expired(self, now: float) -> None:
        while self._nonces and next(iter(self._nonces.values())) < now:
            self._nonces.popitem(last=False)
