"""Process-level tuning for CPU inference, applied once when an engine starts.

glibc serves allocations above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh
`mmap`s and returns them on free, so every large temporary of a forward pass (gathered K/V,
MLP activations) is page-faulted in again on every layer. Pinning the threshold at its
maximum and never trimming the heap keeps those buffers in reused heap memory: decode
attention got about 2x faster on the 2-core reference machine. It only affects the C heap
of this process; memory is still bounded by the tensors that are alive at once.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit
_TRIM_THRESHOLD = 1 << 30


def tune_allocator() -> bool:
    """Keep large temporaries on the heap (glibc only; a no-op elsewhere). Idempotent."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("mallopt not available; allocator left as is")
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
