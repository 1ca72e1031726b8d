"""Content hashes of full KV blocks for automatic prefix caching.

A block's hash covers its tokens *and* its parent's hash, so equal hashes mean equal whole
prefixes. 128-bit BLAKE2b makes accidental collisions (which would silently serve wrong KV)
negligible; `extra` keys anything else the KV depends on (e.g. a LoRA or cache kind).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_ROOT = bytes(16)


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(extra)
    return h.digest()
