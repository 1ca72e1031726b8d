"""What `EngineConfig.load_format` loads: the model's own weights ("auto") or random ones ("dummy").

The engine asks for the architecture (config, tokenizer, and where the files are, if any)
first, builds the empty model, then has its weights filled; both steps depend on the format.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ..config import ModelConfig
from .dummy import BUILTIN_ARCHITECTURES, LOAD_FORMATS, builtin_model_config, init_dummy_weights
from .errors import ModelLoadError
from .source import ModelSource, resolve_model
from .tokenizer import load_tokenizer
from .weights import iter_weights, load_model_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class Architecture:
    config: ModelConfig
    source: ModelSource | None  # None: a built-in architecture, no files
    tokenizer: PreTrainedTokenizerBase | None  # None: prompts and outputs are token ids only


def load_architecture(model: str, load_format: str) -> Architecture:
    """The model's config and tokenizer (a built-in name needs load_format="dummy")."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, not {load_format!r}")
    builtin = builtin_model_config(model)
    if builtin is not None:
        if load_format != "dummy":
            raise ModelLoadError(
                f"{model!r} is a built-in architecture without weights; run it with load_format='dummy' "
                "(--load-format dummy)"
            )
        return Architecture(builtin, None, None)
    try:
        source = resolve_model(model)
    except ModelLoadError as exc:
        if load_format == "dummy":
            raise ModelLoadError(f"{exc} Built-in architectures: {', '.join(BUILTIN_ARCHITECTURES)}.") from None
        raise
    config = load_model_config(source)
    if load_format != "dummy":
        return Architecture(config, source, load_tokenizer(source))
    # Dummy weights need only the config: a directory with config.json alone will do. (Without
    # tokenizer files transformers still builds a tokenizer, with an empty vocabulary: none is
    # better than that.)
    if not _has_tokenizer_files(source):
        log.info("no tokenizer files for %s: token ids only", source.name)
        return Architecture(config, source, None)
    return Architecture(config, source, load_tokenizer(source))


def _has_tokenizer_files(source: ModelSource) -> bool:
    if source.kind == "gguf":
        return True  # the vocabulary is in the file
    return any((source.path / name).is_file() for name in _TOKENIZER_FILES)


def load_weights(model: nn.Module, arch: Architecture, load_format: str, seed: int) -> None:
    """Fill the built model: from the files, or random (dummy) from `seed`."""
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        model.load_weights(iter_weights(arch.source))
