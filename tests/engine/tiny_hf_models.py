"""Tiny random-weight Hugging Face checkpoints of each architecture the loader reads, with the
ModelConfig fields each must produce (shared by the loader and tokenizer tests)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def tiny_config(kind: str) -> tuple[transformers.PretrainedConfig, dict]:
    """A tiny config per architecture plus the ModelConfig fields it must produce."""
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    if kind == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg = transformers.LlamaConfig(
            **common,
            intermediate_size=128,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_parameters=rope,
            rms_norm_eps=1e-5,
            eos_token_id=[2, 3],
            bos_token_id=1,
        )
        expect = dict(
            architecture="llama",
            intermediate_size=128,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            attention_bias=False,
            qk_norm=False,
            eos_token_ids=(2, 3),
            bos_token_id=1,
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
        )
    elif kind == "mistral":
        cfg = transformers.MistralConfig(
            **common,
            intermediate_size=128,
            num_key_value_heads=1,
            sliding_window=32,
            max_position_embeddings=512,
        )
        expect = dict(
            architecture="llama",
            num_kv_heads=1,
            head_dim=16,
            sliding_window=32,
            max_position_embeddings=512,
            rope_scaling=None,
            tie_word_embeddings=False,
        )
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(
            **common,
            intermediate_size=96,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            eos_token_id=7,
        )
        expect = dict(
            architecture="llama",
            intermediate_size=96,
            attention_bias=True,
            qk_norm=False,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            rope_scaling=None,
            eos_token_ids=(7,),
            sliding_window=None,
            max_position_embeddings=32768,
        )
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(
            **common,
            intermediate_size=128,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
        )
        expect = dict(
            architecture="llama",
            head_dim=32,
            qk_norm=True,
            attention_bias=False,
            tie_word_embeddings=False,
            eos_token_ids=(),
        )
    elif kind == "opt":
        cfg = transformers.OPTConfig(
            **common,
            ffn_dim=128,
            word_embed_proj_dim=32,
            max_position_embeddings=128,
        )
        expect = dict(
            architecture="opt",
            intermediate_size=128,
            num_kv_heads=4,
            head_dim=16,
            hidden_act="relu",
            rms_norm_eps=1e-5,
            do_layer_norm_before=True,
            word_embed_proj_dim=32,
            tie_word_embeddings=True,
            attention_bias=True,
            max_position_embeddings=128,
            bos_token_id=2,
            eos_token_ids=(2,),
        )
    else:
        raise AssertionError(kind)
    return cfg, expect


def save_tiny(kind: str, directory: Path) -> transformers.PreTrainedModel:
    config, _ = tiny_config(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # make zero-initialised biases/norms distinguishable
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model.save_pretrained(directory)
    return model
