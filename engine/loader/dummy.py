"""`load_format="dummy"` (vLLM's `--load-format dummy`): a real architecture, random weights.

Throughput does not depend on weight values, and the GPU machine has no model hub and takes at
most 64 MiB of files, so benchmarks of large shapes run on random weights. `model` is then
either one of the built-in architectures below (no files, no tokenizer: prompts are token ids)
or any local model (its config and tokenizer are used, its weights are not read).

The built-in architectures are the published `config.json` of each model, verbatim for every
key the engine reads, parsed by the same code as a downloaded checkpoint
(`hf.parse_hf_config`), so a dummy run has exactly the real model's shapes.

Weights: matrices and embeddings normal(0, 0.02) (the models' `initializer_range`), norm
scales 1, biases 0, each tensor from its own generator seeded by (seed, name), drawn on the
device the model lives on (drawing 8B values on the CPU first would take minutes). Values
are deterministic per device type, not equal across CPU and CUDA: GPU-versus-CPU equality
checks use real (tiny) checkpoints instead.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from ..config import ModelConfig
from .hf import parse_hf_config

_STD = 0.02

# https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
_QWEN3_0_6B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "sliding_window": None,
    "use_sliding_window": False,
}

# https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
_LLAMA_3_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

# https://huggingface.co/facebook/opt-13b/blob/main/config.json
_OPT_13B = {
    "model_type": "opt",
    "vocab_size": 50272,
    "hidden_size": 5120,
    "ffn_dim": 20480,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 5120,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "enable_bias": True,
    "bos_token_id": 2,
    "eos_token_id": 2,
}

BUILTIN_ARCHITECTURES: dict[str, dict] = {
    "qwen3-0.6b": _QWEN3_0_6B,
    "llama-3-8b": _LLAMA_3_8B,
    "opt-13b": _OPT_13B,
}

LOAD_FORMATS = ("auto", "dummy")  # auto: the weights in the model's files


def builtin_model_config(name: str) -> ModelConfig | None:
    """The built-in architecture called `name` (case-insensitive), or None if there is none."""
    cfg = BUILTIN_ARCHITECTURES.get(name.lower())
    if cfg is None:
        return None
    return parse_hf_config(dict(cfg), name.lower(), f"the built-in {name.lower()!r} architecture")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` in place (see the module docstring)."""
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.normal_(0.0, _STD, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:  # RMSNorm / LayerNorm scales
            param.fill_(1.0)
