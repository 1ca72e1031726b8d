"""Builds and loads the C++ CPU kernels (`kernels/cpu/*.cpp`) for this host's vector ISA.

The kernels are compiled once per machine with the system's C++ compiler, for exactly one
*target* chosen from the CPU probe (`kernels/cpu_caps.py`): AVX-512 with the AVX512-BF16 dot
product, AVX-512 without it, or AVX2. A host therefore never runs an instruction it lacks, and
`TANDEM_CPU_ISA=avx2` (the AVX2 emulation) builds and runs the AVX2 code. Each target
registers its ops under its own namespace (`torch.ops.tandem_avx2.decode`, ...), so tests can
load a lesser target next to the native one and compare them.

Decisions:
- *One compiler call, no ninja.* `torch.utils.cpp_extension.load` needs ninja, which is not
  one of our dependencies; the kernels are two small files, so one `c++` invocation builds
  the shared library (decode attention and the fused elementwise ops) (~20 s cold on the 2-core development machine).
- *Cached by content.* The library is written under `$TANDEM_CACHE_DIR/cpu-kernels/` (default
  `~/.cache/tandem`) with a name hashing the sources, the flags, the compiler's version and
  torch's version; a changed source or toolchain builds a new file, and concurrent builders
  (two workers starting at once) each write a temporary file and rename it into place.
- *Explicit ISA flags, never `-march=native`*: the cache may be shared between hosts (a home
  directory on NFS), and the emulated AVX2 host must not get AVX-512 code.
- No compiler, or a failed build: `load` raises `KernelBuildError`; callers that chose the
  kernel automatically fall back to the plain-PyTorch reference with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from kernels.cpu_caps import CpuCaps, probe

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("decode.cpp", "elementwise.cpp", "argmax.cpp")
HEADERS = ("simd.h",)

_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DTANDEM_TARGET_AVX512")
TARGET_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512_bf16": (*_AVX512, "-mavx512bf16", "-DTANDEM_DPBF16"),
    "avx512": _AVX512,
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-DTANDEM_TARGET_AVX2"),
}


class KernelBuildError(RuntimeError):
    """The C++ kernels cannot be built or loaded on this machine."""


def target_for(caps: CpuCaps | None = None) -> str | None:
    """The build target for this CPU (after any ISA cap), or None where there is no kernel."""
    caps = caps or probe()
    if caps.isa in ("avx512", "amx"):
        return "avx512_bf16" if "avx512_bf16" in caps.flags else "avx512"
    if caps.isa == "avx2":
        return "avx2"
    return None


def namespace(target: str) -> str:
    return f"tandem_{target}"


@functools.cache
def load(target: str | None = None) -> str:
    """Build (if not cached) and load the kernels for `target` (default: this CPU's); returns
    the `torch.ops` namespace the ops are registered under. Raises KernelBuildError."""
    target = target or target_for()
    if target is None:
        raise KernelBuildError(f"no C++ kernel target for this CPU ({probe().describe()})")
    library = build(target)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        raise KernelBuildError(f"cannot load {library}: {exc}") from exc
    log.info("C++ CPU kernels loaded: target %s (%s)", target, library.name)
    return namespace(target)


def build(target: str) -> Path:
    """The shared library of `target`, compiled now unless the cache already has it."""
    if target not in TARGET_FLAGS:
        raise KernelBuildError(f"unknown kernel target {target!r}")
    compiler = _compiler()
    flags = _flags(target)
    library = _cache_dir() / f"{namespace(target)}-{_fingerprint(compiler, flags)}.so"
    if not library.exists():
        _compile(compiler, flags, library)
    return library


def _compiler() -> str:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise KernelBuildError("no C++ compiler found (set CXX or install g++)")


def _flags(target: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = library_paths()
    return [
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp",
        "-fno-math-errno",
        "-ffp-contract=off",  # a*b + c stays two roundings unless the source asks for an FMA
        "-Wno-unused-function",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DTANDEM_OPS={namespace(target)}",
        *TARGET_FLAGS[target],
        *(f"-I{p}" for p in include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        *(f"-L{p}" for p in libs),
        *(f"-Wl,-rpath,{p}" for p in libs),
        "-lc10",
        "-ltorch_cpu",
    ]


def _fingerprint(compiler: str, flags: list[str]) -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((SOURCE_DIR / name).read_bytes())
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError as exc:
        raise KernelBuildError(f"cannot run the C++ compiler {compiler}: {exc}") from exc
    for part in (version, torch.__version__, sys.version, *flags):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _cache_dir() -> Path:
    root = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem").expanduser()
    path = root / "cpu-kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(f"cannot create the kernel cache {path}: {exc}") from exc
    return path


def _compile(compiler: str, flags: list[str], library: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    cmd = [compiler, *(str(SOURCE_DIR / s) for s in SOURCES), "-o", tmp, *flags]
    log.info("building the C++ CPU kernels (%s), once per machine", library.name)
    start = time.perf_counter()
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise KernelBuildError(f"cannot run the C++ compiler {compiler}: {exc}") from exc
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-20:])
            raise KernelBuildError(f"C++ kernel build failed ({compiler}):\n{tail}")
        os.replace(tmp, library)  # atomic: a concurrent builder's identical file is simply replaced
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s in %.1f s", library.name, time.perf_counter() - start)
