"""Content hashes of full KV blocks for automatic prefix caching.

A block's hash covers its tokens *and* its parent's hash, so equal hashes mean equal whole
prefixes. 128-bit BLAKE2b makes accidental collisions (which would silently serve wrong KV)
negligible; `extra` keys anything else the KV depends on (e.g. a LoRA or cache kind).

A request's cache salt (vLLM's `cache_salt`; the gateway sets it per API key) replaces the
shared root as its first block's parent (`salt_root`), so every hash of the chain differs from
any other salt's: requests share cached KV only with requests of the same salt, and one tenant
cannot learn from a cache hit's timing that another sent the same prompt. No salt: the shared
root, the hashes are what they were before salts existed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_ROOT = bytes(16)


def salt_root(cache_salt: str | None) -> bytes | None:
    """The parent hash of a request's first block: None (the shared root) without a salt."""
    if not cache_salt:
        return None
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"tandem-salt").digest()


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(extra)
    return h.digest()
