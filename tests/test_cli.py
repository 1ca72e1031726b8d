"""The `tandem` command line, run as a user would (a subprocess of the installed entry point)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A safety net for one run, under pytest's 600 s per test: a default-model `generate` is ~15
# CPU-s quiet (torch's import, the model's build and load, 20 tokens), which at load 25 on two
# cores took past the 300 s this used to be.
RUN_TIMEOUT_S = 540


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def test_generate_json_chat():
    res = _tandem(
        "generate",
        "--model",
        "default",
        "--prompt",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "20",
        "--temperature",
        "0",
        "--dtype",
        "float32",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["text"] == "The capital of France is Paris."
    assert out["token_ids"] and out["finish_reason"] == "stop"


def test_generate_with_uncached_ratio_matches_full_residency(tiny_model_dir):
    """`--uncached-ratio`: the oldest half of the context rebuilt each step (from the first
    decode on: the prompt is over two blocks long), same greedy tokens (a tiny model: the
    default model's equality is tests/engine/test_partial_residency.py's)."""
    ids = ",".join(str(1000 + 37 * i) for i in range(40))
    args = ["generate", "--model", str(tiny_model_dir("llama")), "--prompt-ids", ids, "--max-tokens", "12"]
    args += ["--dtype", "float32", "--json"]
    full = _tandem(*args)
    partial = _tandem(*args, "--uncached-ratio", "0.5")
    assert full.returncode == 0 and partial.returncode == 0, partial.stderr
    assert json.loads(partial.stdout)["token_ids"] == json.loads(full.stdout)["token_ids"]
    host = _tandem(*args, "--uncached-ratio", "0.5", "--uncached-source", "host")  # read from host swap space
    assert host.returncode == 0, host.stderr
    assert json.loads(host.stdout)["token_ids"] == json.loads(full.stdout)["token_ids"]
    bad = _tandem(*args, "--uncached-ratio", "1.5")
    assert bad.returncode == 2 and "uncached ratio must be in" in bad.stderr and "Traceback" not in bad.stderr


def test_missing_model_is_a_clear_error():
    res = _tandem("generate", "--model", "/no/such/model", "--prompt", "hi")
    assert res.returncode == 2
    assert "tandem: error:" in res.stderr and "Traceback" not in res.stderr


def test_help_lists_subcommands():
    res = _tandem("--help")
    assert res.returncode == 0
    for cmd in ("generate", "chat", "bench"):
        assert cmd in res.stdout


def test_a_service_builds_its_own_parser_only_and_no_parser_imports_torch():
    """Every process of a stack parses its argv first: a service registers only its own
    subcommand (`_SERVICE_COMMANDS` must name the module that registers it), and building the
    whole parser (`tandem --help`) imports neither torch nor transformers (they cost ~2 CPU-s
    per process; docs/testing.md, "Stack start-up")."""
    probe = """
import json, sys
from services.cli import _SERVICE_COMMANDS, build_parser
def commands(parser):
    return sorted(parser._subparsers._group_actions[0].choices)
only = {name: commands(build_parser([name, "--help"])) for name in _SERVICE_COMMANDS}
full = commands(build_parser())
print(json.dumps({"only": only, "full": full, "heavy": [m for m in ("torch", "transformers") if m in sys.modules]}))
"""
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["heavy"] == []
    for name, choices in out["only"].items():
        assert choices == [name], (name, choices)
        assert name in out["full"]


@pytest.mark.parametrize("extra", [(), ("--kv-heads-expand",)], ids=["gqa", "mha-expanded"])
def test_generate_with_the_hybrid_cache_forced_hidden(extra):
    """The default model (GQA) and its MHA expansion, every request HIDDEN: the same answer. One
    test each, so each run has its own time budget (the two in one test overran it under load),
    on a 0.1 GiB pool: the 1 GiB default is zeroed at start, 6 s of a 33 s run at load 4, for a
    prompt of 37 tokens."""
    res = _tandem(
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "20",
        "--dtype",
        "float32",
        "--kv-cache-gib",
        "0.1",
        "--cache-form",
        "hidden",
        *extra,
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["text"] == "The capital of France is Paris."
    assert out["config"]["cache_form"] == "hidden"
