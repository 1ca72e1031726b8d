"""Hugging Face checkpoint directories: `config.json` -> `ModelConfig`, safetensors -> tensors.

Weight names come out exactly as stored, with two normalisations:
  * OPT checkpoints saved from the bare `OPTModel` use `decoder.*`; they are renamed to the
    `OPTForCausalLM` layout `model.decoder.*` so OPT names are always `model.decoder.*` plus
    (when untied and stored) `lm_head.weight`.
  * Stale rotary `inv_freq` buffers found in some old Llama exports are dropped: they are
    derived from the config, not parameters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from .errors import ModelLoadError

Json = dict[str, Any]

# Values `transformers` uses when a key is missing from config.json, per model_type.
_LLAMA_FAMILY_DEFAULTS: dict[str, Json] = {
    "llama": {"max_position_embeddings": 2048, "attention_bias": False},
    "mistral": {"max_position_embeddings": 4096 * 32, "attention_bias": False},
    "qwen2": {"max_position_embeddings": 32768, "attention_bias": True},
    "qwen3": {"max_position_embeddings": 32768, "attention_bias": False, "head_dim": 128},
}
SUPPORTED_MODEL_TYPES = (*_LLAMA_FAMILY_DEFAULTS, "opt")

_SAFETENSORS_INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- config


def load_hf_config(model_dir: Path, name: str = "") -> ModelConfig:
    """Parse `model_dir/config.json` into a `ModelConfig`."""
    return parse_hf_config(_read_config_json(model_dir / "config.json"), name, str(model_dir / "config.json"))


def parse_hf_config(cfg: Json, name: str, origin: str) -> ModelConfig:
    """A `config.json` already read (`origin` names it in errors) as a `ModelConfig`."""
    model_type = cfg.get("model_type")
    if model_type == "opt":
        return _opt_config(cfg, name)
    if model_type in _LLAMA_FAMILY_DEFAULTS:
        return _llama_family_config(cfg, model_type, name)
    raise ModelLoadError(
        f"unsupported model_type {model_type!r} in {origin}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def _read_config_json(path: Path) -> Json:
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: a Hugging Face model directory needs config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path} must contain a JSON object")
    return cfg


def _require(cfg: Json, key: str) -> Any:
    value = cfg.get(key)
    if value is None:
        raise ModelLoadError(f"config.json (model_type {cfg.get('model_type')!r}) lacks {key!r}")
    return value


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """eos_token_id may be an int, a list (Llama 3: several stop tokens) or absent."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(cfg: Json) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config layout.

    transformers >= 5 nests both in `rope_parameters`; older files have top-level
    `rope_theta` and `rope_scaling`. "default" scaling means none. The returned scaling dict
    always carries `rope_type` (legacy files spell it `type`).
    """
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"})
    rope_type = scaling.pop("type", None) or scaling.get("rope_type")
    if rope_type in (None, "default"):
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("rope_theta", None)
    return theta, scaling


def _sliding_window(cfg: Json, model_type: str) -> int | None:
    if model_type == "mistral":
        return cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        return cfg.get("sliding_window")
    return None


def _llama_family_config(cfg: Json, model_type: str, name: str) -> ModelConfig:
    defaults = _LLAMA_FAMILY_DEFAULTS[model_type]
    if cfg.get("mlp_bias"):
        raise ModelLoadError("config.json sets mlp_bias=true, which the engine does not support")
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    # Qwen2's q/k/v always carry biases regardless of the config; others follow the flag.
    attention_bias = True if model_type == "qwen2" else bool(cfg.get("attention_bias", False))
    theta, scaling = _rope(cfg)
    return ModelConfig(
        architecture="llama",
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size")),
        num_layers=int(_require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or defaults.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or defaults["max_position_embeddings"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_proj_bias=model_type != "qwen2" and attention_bias,
        qk_norm=model_type == "qwen3",
        hidden_act=str(cfg.get("hidden_act", "silu")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_token_ids(cfg.get("eos_token_id")),
        sliding_window=_sliding_window(cfg, model_type),
        name=name,
    )


def _opt_config(cfg: Json, name: str) -> ModelConfig:
    if not cfg.get("layer_norm_elementwise_affine", True):
        raise ModelLoadError("OPT with layer_norm_elementwise_affine=false is not supported")
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    proj_dim = cfg.get("word_embed_proj_dim")
    return ModelConfig(
        architecture="opt",
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "ffn_dim")),
        num_layers=int(_require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=heads,  # OPT is plain multi-head attention
        head_dim=hidden // heads,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        rms_norm_eps=1e-5,  # nn.LayerNorm default; OPT configs do not store it
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("enable_bias", True)),
        hidden_act=str(cfg.get("activation_function", "relu")),
        do_layer_norm_before=bool(cfg.get("do_layer_norm_before", True)),
        word_embed_proj_dim=None if proj_dim in (None, hidden) else int(proj_dim),
        bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_ids=_token_ids(cfg.get("eos_token_id", 2)),
        name=name,
    )


# ----------------------------------------------------------------------------- weights


def iter_hf_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every stored weight, in the dtype it was saved in."""
    from safetensors import safe_open

    is_opt = _read_config_json(model_dir / "config.json").get("model_type") == "opt"
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                yield (_normalise_opt_name(key) if is_opt else key), f.get_tensor(key)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files, per the shard index when there is one.

    Without an index, every `*.safetensors` except Mistral's `consolidated*` (the same
    weights again under Mistral's own names, shipped next to the HF shards in some repos).
    """
    index = model_dir / _SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists missing shard(s): {', '.join(missing)}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if len(files) > 1:
            files = [f for f in files if not f.name.startswith("consolidated")] or files
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights in {model_dir}; only safetensors checkpoints are supported "
            "(convert pytorch_model.bin with save_pretrained(safe_serialization=True))"
        )
    return files


def _normalise_opt_name(name: str) -> str:
    """Checkpoints saved from `OPTModel` lack the `model.` prefix of `OPTForCausalLM`."""
    if name.startswith("decoder."):
        return "model." + name
    return name
