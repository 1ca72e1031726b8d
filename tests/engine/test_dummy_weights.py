"""`load_format="dummy"`: real architectures with random weights (engine/loader/dummy.py).

The built-in architectures resolve to the published models' parameter counts (built on the
meta device, nothing allocated); a tiny architecture given as a config.json alone runs on the
CPU without weights or tokenizer, token ids in and out, deterministically per seed; and the
CLI flags reach the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import Qwen3Config

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.loader.dummy import builtin_model_config
from engine.loader.errors import ModelLoadError
from engine.models import build_model


@pytest.mark.parametrize(
    "name,params,layers,heads,kv_heads,head_dim",
    [
        # 0.6B total, 0.44B without the (tied) embedding, as Qwen's model card says; the
        # checkpoint stores the tied head a second time (751,632,384 tensors' elements)
        ("qwen3-0.6b", 596_049_920, 28, 16, 8, 128),
        ("llama-3-8b", 8_030_261_248, 32, 32, 8, 128),  # Meta's 8.03B
        ("opt-13b", 12_853_473_280, 40, 40, 40, 128),  # 12.85B (positions: 2048 + 2 rows)
    ],
)
def test_builtin_architectures_have_the_published_sizes(name, params, layers, heads, kv_heads, head_dim):
    config = builtin_model_config(name)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        layers,
        heads,
        kv_heads,
        head_dim,
    )
    model = build_model(config, 16, torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == params


def _tiny_config_dir(tmp_path):
    """A Qwen3 architecture as config.json alone: no weights, no tokenizer."""
    Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    ).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    return tmp_path


def test_tiny_architecture_runs_on_random_weights(tmp_path):
    path = str(_tiny_config_dir(tmp_path))
    prompts = [[1, 2, 3, 4, 5], [9] * 20]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    runs = {}
    for seed in (0, 0, 1):
        # packed_weights=False: the weights are read back as plain parameters below; whether
        # float32 packing pays is a timing probe (models/packed_linear.py), which would rename them
        config = EngineConfig(
            model=path, load_format="dummy", dtype="float32", num_blocks=32, seed=seed, packed_weights=False
        )
        llm = LLM(config)
        assert llm.tokenizer is None
        runs.setdefault(seed, []).append([o.token_ids for o in llm.generate(prompts, params)])
        weights = dict(llm.engine.model.named_parameters())
        assert weights["layers.0.self_attn.qkv_proj.weight"].std().item() == pytest.approx(0.02, rel=0.1)
        assert torch.equal(weights["norm.weight"], torch.ones(64))
    assert runs[0][0] == runs[0][1]  # the same seed, the same weights
    assert runs[0][0] != runs[1][0]  # another seed, other weights
    assert all(len(t) == 5 for t in runs[0][0])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.engine.add_request("s", [1, 2], SamplingParams(stop=["x"]))
    assert not llm.engine.has_unfinished()  # the refused request left nothing behind


def test_load_format_errors_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="load_format='dummy'"):
        LLMEngine(EngineConfig(model="qwen3-0.6b", dtype="float32"))
    with pytest.raises(ValueError, match="load_format must be"):
        LLMEngine(EngineConfig(model="qwen3-0.6b", load_format="random", dtype="float32"))
    with pytest.raises(ModelLoadError, match="Built-in architectures: qwen3-0.6b"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nothing"), load_format="dummy", dtype="float32"))


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_flags(tmp_path):
    path = str(_tiny_config_dir(tmp_path / "model"))
    out = tmp_path / "bench.json"
    res = _tandem(
        "bench", "engine", "--model", path, "--load-format", "dummy", "--dtype", "float32", "--num-prompts", "4",
        "--input-len", "3", "9", "--output-len-range", "2", "6", "--kv-cache-gib", "0.01", "--json", str(out),
        "--quiet",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert result["config"]["engine_args"]["load_format"] == "dummy"
    assert result["config"]["output_len"] == [2, 6]
    assert 4 * 2 <= result["output_tokens"] <= 4 * 6 and "warning" not in res.stderr
    res = _tandem(
        "generate", "--model", path, "--load-format", "dummy", "--prompt-ids", "5,6,7", "--max-tokens", "3",
        "--dtype", "float32", "--kv-cache-gib", "0.01", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["token_ids"]) == 3
    res = _tandem("generate", "--model", "llama-3-8b", "--prompt", "hi")
    assert res.returncode == 2 and "--load-format dummy" in res.stderr and "Traceback" not in res.stderr
