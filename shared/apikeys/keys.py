"""The API key format, its hash, and what a key allows.

A key is `sk-tandem-<id>-<secret>`: `id` is 12 hex digits (the row's id, shown by `tandem keys
list`, so a presented key is found with one indexed lookup), `secret` 32 random bytes in
URL-safe base64. Only the SHA-256 of the whole key is stored, and the presented key's hash is
compared with `hmac.compare_digest` (constant time). A plain hash, not a slow password hash,
is enough: the key has 256 random bits, so there is nothing to guess a dictionary for, and the
check stays cheap on a path every request takes (the gateway also caches it).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

PREFIX = "sk-tandem-"
ID_HEX = 12
SECRET_BYTES = 32
SERVICE_CLASSES = ("rt", "be")


def new_key_id() -> str:
    return secrets.token_hex(ID_HEX // 2)


def new_secret_key(key_id: str) -> str:
    """The full key for `key_id` (shown once, never stored)."""
    return f"{PREFIX}{key_id}-{secrets.token_urlsafe(SECRET_BYTES)}"


def new_cache_salt() -> str:
    return secrets.token_hex(16)


def key_id_of(presented: str) -> str | None:
    """The id inside a presented key, or None when it is not shaped like one of ours."""
    if not presented.startswith(PREFIX):
        return None
    rest = presented[len(PREFIX) :]
    key_id, dash = rest[:ID_HEX], rest[ID_HEX : ID_HEX + 1]
    if dash != "-" or len(rest) <= ID_HEX + 1 or any(c not in "0123456789abcdef" for c in key_id):
        return None
    return key_id


def hash_key(presented: str) -> str:
    return hashlib.sha256(presented.encode()).hexdigest()


def key_matches(presented: str, stored_hash: str) -> bool:
    """Constant-time comparison of the presented key's hash with the stored one."""
    return hmac.compare_digest(hash_key(presented).encode(), stored_hash.encode())


def parse_classes(text: str) -> tuple[str, ...]:
    """`"rt,be"` -> ("rt", "be"); raises ValueError for an unknown or empty set."""
    classes = tuple(dict.fromkeys(c.strip().lower() for c in text.split(",") if c.strip()))
    bad = [c for c in classes if c not in SERVICE_CLASSES]
    if bad or not classes:
        raise ValueError(f"classes must be a comma-separated subset of {list(SERVICE_CLASSES)}, not {text!r}")
    return classes


@dataclass(frozen=True)
class KeyLimits:
    """None means unlimited."""

    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    batch_quota: int | None = None  # requests in the key's unfinished batches

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "tokens_per_min", "batch_quota"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive (or unset for no limit), not {value}")


@dataclass(frozen=True)
class ApiKey:
    """A key as the gateway and `tandem keys list` see it (never the secret)."""

    id: str
    name: str
    created_at: int
    revoked_at: int | None
    limits: KeyLimits
    classes: tuple[str, ...]
    admin: bool
    cache_salt: str

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def allows(self, req_class: str) -> bool:
        return req_class in self.classes

    @property
    def default_class(self) -> str:
        """The class of a request that does not ask for one: RT when allowed (OpenAI clients never ask)."""
        return "rt" if "rt" in self.classes else self.classes[0]

    def public(self) -> dict:
        """As `tandem keys list --json` and `GET /v1/keys` show it."""
        return {
            "id": self.id,
            "object": "api_key",
            "name": self.name,
            "created_at": self.created_at,
            "revoked_at": self.revoked_at,
            "requests_per_s": self.limits.requests_per_s,
            "tokens_per_min": self.limits.tokens_per_min,
            "batch_quota": self.limits.batch_quota,
            "classes": list(self.classes),
            "admin": self.admin,
        }
