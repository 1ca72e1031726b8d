"""The test run's own set-up, as pytest hooks (imported into tests/conftest.py, which pytest
registers): work every process of a run needs before its first test, done once and outside every
test's timeout (the C++ kernels built, Inductor's first compile), the xdist scheduler that keeps a
module (or a group of modules sharing a costly fixture) on one worker, and the per-run lock files
that let the controller and the workers share that work (docs/testing.md, "Two pytest workers")."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest
import torch

# The fused decode kernel is compiled by Inductor to C++ at run time (kernels/compiled/).
HAS_CXX = any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c)


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
