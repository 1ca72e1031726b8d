"""Model loading: resolve a model reference, read its config, stream its weights, load its tokenizer.

src = resolve_model("default")        # or a .gguf file / HF model directory
cfg = load_model_config(src)          # -> engine.config.ModelConfig
for name, tensor in iter_weights(src):  # HF parameter names
    ...
tok = load_tokenizer(src)
"""

from .errors import ModelLoadError
from .source import DEFAULT_MODEL, ModelSource, resolve_model
from .tokenizer import load_tokenizer
from .weights import iter_weights, load_model_config

__all__ = [
    "DEFAULT_MODEL",
    "ModelLoadError",
    "ModelSource",
    "iter_weights",
    "load_model_config",
    "load_tokenizer",
    "resolve_model",
]
