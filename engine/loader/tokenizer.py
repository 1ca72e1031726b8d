"""Tokenizers for a `ModelSource`, strictly from local files.

Converting a GGUF vocabulary into a fast tokenizer takes seconds (transformers rebuilds
the BPE from the token list and merges), so the converted tokenizer is saved under
`$TANDEM_CACHE_DIR/tokenizers/<key>/` (default `~/.cache/tandem`) and reloaded from there,
which takes ~0.1 s. The key covers the file's path, size and mtime and the transformers
version (a newer converter may produce a different tokenizer). The chat template survives
the round trip: `save_pretrained` writes it to `chat_template.jinja`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .cache import default_cache_dir, file_cache_key
from .errors import ModelLoadError
from .source import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_DONE_MARKER = "tokenizer_config.json"  # written by save_pretrained; absent in a partial copy


def load_tokenizer(src: ModelSource, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """Load the tokenizer of `src` without touching the network.

    `cache_dir` overrides `$TANDEM_CACHE_DIR` (only GGUF sources use the cache).
    """
    with _offline():
        if src.kind == "hf_dir":
            return _from_pretrained(src.path)
        return _gguf_tokenizer(src.path, cache_dir or default_cache_dir())


def tokenizer_cache_path(gguf_path: Path, cache_dir: Path) -> Path:
    """Where the converted tokenizer of `gguf_path` is (or would be) cached."""
    import transformers

    return cache_dir / "tokenizers" / file_cache_key(gguf_path, transformers.__version__)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Set the HF offline switches for the duration of a load, then restore them.

    huggingface_hub snapshots HF_HUB_OFFLINE when first imported, so if this is where it
    gets imported the process stays offline afterwards, which is what Tandem wants anyway.
    `local_files_only=True` on every call is the guarantee that does not depend on
    import order.
    """
    saved = {k: os.environ.get(k) for k in _OFFLINE_ENV}
    os.environ.update({k: "1" for k in _OFFLINE_ENV})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _from_pretrained(directory: Path, **kwargs: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        what = kwargs.get("gguf_file") or "tokenizer files"
        raise ModelLoadError(f"cannot load a tokenizer from {directory} ({what}): {exc}") from exc


def _gguf_tokenizer(gguf_path: Path, cache_dir: Path) -> PreTrainedTokenizerBase:
    cached = tokenizer_cache_path(gguf_path, cache_dir)
    if (cached / _DONE_MARKER).is_file():
        try:
            return _from_pretrained(cached)
        except ModelLoadError:
            log.warning("discarding unreadable tokenizer cache %s", cached)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = _from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _save_to_cache(tokenizer, cached)
    return tokenizer


def _save_to_cache(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Write into a temp dir then rename, so readers never see half a tokenizer.

    A concurrent writer may win the rename; its copy is equivalent, so ours is dropped.
    A read-only cache only costs speed, hence a warning rather than an error.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared between users
    except OSError as exc:
        log.warning("tokenizer cache disabled (%s): %s", target.parent, exc)
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, target)
    except OSError as exc:
        if not (target / _DONE_MARKER).is_file():
            log.warning("could not cache tokenizer at %s: %s", target, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
