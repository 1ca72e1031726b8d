"""engine.loader on the packaged default GGUF: resolution, config and weights against
transformers' own GGUF import, llama.cpp's row permutation, the cached config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from engine.loader import ModelSource, iter_weights, load_model_config, resolve_model
from engine.loader import gguf as gguf_loader
from tests.conftest import GGUF_NAME


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
