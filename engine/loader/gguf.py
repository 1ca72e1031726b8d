"""GGUF files (llama.cpp format): metadata -> `ModelConfig`, tensors -> float32 HF-named tensors.

Only `general.architecture == "llama"` is supported (Llama, Mistral, SmolLM2 ... all export
as "llama"). Quantised tensors are dequantised to float32 once, at load time.

Two llama.cpp conventions are undone so the tensors match a Hugging Face Llama exactly:
  * dimension order: GGUF lists dims fastest-first (ne[0] = columns), torch is the reverse;
  * rotary layout: llama.cpp's converter permutes q_proj/k_proj rows from HF's
    "rotate-half" layout to interleaved pairs; `_unpermute_rows` is its inverse.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig
from .errors import ModelLoadError

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def _open(path: Path) -> Any:
    """A memory-mapped `gguf.GGUFReader`; wraps parse failures in ModelLoadError."""
    from gguf import GGUFReader  # the PyPI `gguf` package (absolute import)

    try:
        return GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# ----------------------------------------------------------------------------- config


def load_gguf_config(path: Path, name: str = "") -> ModelConfig:
    """Map GGUF metadata to a `ModelConfig` (architecture "llama")."""
    return _config_from_reader(_open(path), path, name)


def _config_from_reader(reader: Any, path: Path, name: str) -> ModelConfig:
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} in {path} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.x rope scaling is baked into this tensor; its HF parameters
        # (factor, low/high_freq_factor, ...) are not in the metadata, so we cannot
        # reproduce it and would silently compute wrong positions.
        raise ModelLoadError(
            f"{path} uses llama.cpp rope_freqs (Llama 3.x rope scaling), which is not supported "
            "from GGUF; load the Hugging Face checkpoint directory instead"
        )

    def need(key: str) -> Any:
        value = _meta(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF file {path} lacks metadata {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    eos = _meta(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="llama",
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(
            _meta(reader, f"{arch}.attention.key_length")
            or _meta(reader, f"{arch}.rope.dimension_count")
            or hidden // heads
        ),
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        hidden_act="silu",
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=name,
    )


def _vocab_size(reader: Any, arch: str) -> int:
    """Explicit metadata first, then the token list, then the embedding's row count."""
    explicit = _meta(reader, f"{arch}.vocab_size")
    if explicit is not None:
        return int(explicit)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF order: (hidden, vocab)
    raise ModelLoadError("cannot determine vocab size: no vocab_size, token list or token_embd")


def _rope_scaling(reader: Any, arch: str) -> dict | None:
    """GGUF `rope.scaling.*` -> HF rope_scaling dict ("linear" / "yarn"), or None."""
    rope_type = _meta(reader, f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type}
    factor = _meta(reader, f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


# ----------------------------------------------------------------------------- weights


def iter_gguf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, float32 tensor)` for every tensor in the file."""
    from gguf import dequantize

    reader = _open(path)
    cfg = _config_from_reader(reader, path, "")
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        # GGUF dims are fastest-first; `dequantize` already yields rows x cols in numpy
        # order, the explicit reshape guards the 1-D and multi-row cases alike.
        array = dequantize(tensor.data, tensor.tensor_type)
        array = np.array(array, dtype=np.float32, copy=True).reshape(tuple(reversed(tensor.shape)))
        weight = torch.from_numpy(array)
        if ".self_attn.q_proj." in name:
            weight = _unpermute_rows(weight, cfg.num_heads)
        elif ".self_attn.k_proj." in name:
            weight = _unpermute_rows(weight, cfg.num_kv_heads)
        yield name, weight


def hf_name(gguf_name: str) -> str:
    """Translate a llama GGUF tensor name to the Hugging Face Llama parameter name."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def _unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's `permute(w, n_head, n_head_kv)` for q/k rows (weights or biases).

    llama.cpp: `w.reshape(n, 2, rows//n//2, ...).swapaxes(1, 2)` turns HF's per-head
    [first half | second half] rotary layout into interleaved (even, odd) pairs. Reading the
    rows as (n, rows//n//2, 2) and swapping back restores HF's order. For k, n is the
    number of KV heads (k has only that many heads' rows).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"q/k tensor with {rows} rows does not split into {n_heads} heads")
    rest = weight.shape[1:]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()
