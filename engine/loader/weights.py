"""Source-kind dispatch: one entry point for config and weights whatever the file format."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from .cache import default_cache_dir, file_cache_key
from .gguf import iter_gguf_weights, load_gguf_config
from .hf import iter_hf_weights, load_hf_config
from .source import ModelSource

log = logging.getLogger(__name__)

# Bump when the GGUF -> ModelConfig mapping changes, so cached configs are re-derived.
_CONFIG_VERSION = "config-v1"


def load_model_config(src: ModelSource) -> ModelConfig:
    """The architecture of `src` as a `ModelConfig` (name = `src.name`)."""
    if src.kind == "gguf":
        return _cached_gguf_config(src.path, src.name, default_cache_dir())
    return load_hf_config(src.path, src.name)


def _cached_gguf_config(path: Path, name: str, cache_dir: Path) -> ModelConfig:
    """GGUF metadata mapped once, then read from JSON beside the weights cache.

    Opening a GGUF parses its whole token list (about 2 s for SmolLM2's 49k entries), which
    every engine start would otherwise pay just to read a few architecture numbers.
    """
    target = cache_dir / "weights" / f"{file_cache_key(path, _CONFIG_VERSION)}.config.json"
    try:
        fields = json.loads(target.read_text())
        return dataclasses.replace(
            ModelConfig(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])}), name=name
        )
    except (OSError, ValueError, TypeError, KeyError):
        pass  # absent, or written by another version: recompute
    config = load_gguf_config(path, name)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(dataclasses.asdict(config)))
        os.replace(tmp, target)
    except OSError as exc:
        log.warning("could not cache the GGUF config at %s: %s", target, exc)
    return config


def iter_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_parameter_name, tensor)` pairs, one tensor in memory at a time.

    GGUF tensors are dequantised float32; safetensors keep their stored dtype (the model
    casts). A tied `lm_head.weight` is usually absent: the model reuses the embedding.
    """
    if src.kind == "gguf":
        return iter_cached_gguf_weights(src.path)
    return iter_hf_weights(src.path)


def iter_cached_gguf_weights(path: Path, cache_dir: Path | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """GGUF weights, dequantised once and then read back from a safetensors cache.

    Dequantising in numpy takes far longer than reading float32 tensors, and every engine
    start (and test) would pay it. The cache is keyed like the tokenizer's (path, size,
    mtime) and written atomically; an unwritable cache only costs speed.
    """
    target = weights_cache_path(path, cache_dir or default_cache_dir())
    if not target.exists():
        tensors = dict(iter_gguf_weights(path))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".tmp{os.getpid()}")
            save_file(tensors, str(tmp))
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("could not cache dequantised weights at %s: %s", target, exc)
        yield from tensors.items()
        return
    with safe_open(str(target), framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def weights_cache_path(path: Path, cache_dir: Path) -> Path:
    return cache_dir / "weights" / f"{file_cache_key(path, 'v1')}.safetensors"
