"""Where the loader keeps what it derives from model files (converted tokenizers,
dequantised GGUF weights and configs), and how a file's cache entries are named."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CACHE_ENV = "TANDEM_CACHE_DIR"


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tandem").expanduser()


def file_cache_key(path: Path, *extra: str) -> str:
    """Stable name for data derived from `path`: changes when the file (path, size, mtime) or
    any `extra` (a converter version) changes, so stale entries are simply never read."""
    stat = path.stat()
    key = "\0".join([str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), *extra])
    return hashlib.sha256(key.encode()).hexdigest()[:32]
