"""Provenance stamps: which code, on which host, with which software and threads made a result.

Every result writer (`tandem bench *`, the baselines, `tandem loadgen`, `tandem sim`,
`loadgen/sim/validate.py`) puts `stamp(...).as_dict()` under the key ``provenance``, so a
number quoted in the README can be traced to a commit and a machine, and two results are only
compared when `same_host` says they came from the same one.

Decisions:
- The CPU description is `kernels.cpu_caps.probe()`, the same probe the engine chooses its fast
  paths from (model, vendor, ISA level after any cap, native bf16, flags, caps applied), so a
  stamp says what the engine could use, not just what /proc/cpuinfo lists. Where `kernels`
  cannot be imported (a baseline's virtualenv without torch), a stdlib reading of
  /proc/cpuinfo stands in and `cpu.source` says so.
- Versions come from package metadata (`importlib.metadata`), which neither imports the
  packages nor fails when one is missing ("absent").
- Threads: torch's intra- and inter-op counts only when torch is already imported (a stamp
  must not start torch's thread pools in a process that does not use them), plus every
  OpenMP/MKL/vLLM-CPU/ISA-cap variable in the environment. Not the process's CPU affinity:
  with OMP_PROC_BIND set, the OpenMP runtime narrows the main thread's mask to one core as soon
  as torch starts its pool, so it would describe the binding, not the host.
- No git, or not a checkout: commit and dirty are "unknown" (never a crash).

Standard library only at import time: `vllm_bench.py` stamps its results from vLLM's own
virtualenv.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = "unknown"

# Environment variables that change how many threads run where, or which ISA is used.
THREAD_ENV_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "VLLM_CPU_", "LLAMA_ARG_THREADS")
ISA_ENV_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TANDEM_CPU_ISA", "DNNL_MAX_CPU_ISA")
BASE_PACKAGES = ("torch", "transformers", "numpy")


@dataclass(frozen=True)
class GitInfo:
    commit: str  # full hash, or "unknown"
    dirty: bool | str  # uncommitted changes to tracked files; "unknown" without git


@dataclass(frozen=True)
class HostInfo:
    hostname: str
    platform: str  # kernel and libc, platform.platform()
    machine: str  # x86_64, aarch64, ...
    logical_cpus: int
    physical_cores: int
    cpu: dict[str, Any]  # kernels.cpu_caps.CpuCaps.as_dict() (+ "source")


@dataclass(frozen=True)
class ThreadSettings:
    torch_num_threads: int | None  # None: torch not imported in this process
    torch_num_interop_threads: int | None
    env: dict[str, str]  # OMP_*, KMP_*, MKL_*, VLLM_CPU_*, ISA caps ... as set


@dataclass(frozen=True)
class Provenance:
    """Where a result came from. Serialised as a plain dict under ``provenance``."""

    schema_version: int
    git: GitInfo
    timestamp_utc: str  # ISO 8601, seconds, "Z"
    host: HostInfo
    python: str
    versions: dict[str, str]  # package -> version ("absent" when not installed)
    threads: ThreadSettings
    dtype: str | None  # the dtype the measured system ran in (None where not applicable)
    load_average: list[float] | None  # 1, 5, 15 min when stamped: other work on the machine skews timings
    extra: dict[str, Any] = field(default_factory=dict)  # system-specific (llama.cpp build, ...)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON types (tuples become lists), so a stamp equals its own JSON round trip."""
        return json.loads(json.dumps(asdict(self)))


def git_info(repo: Path = REPO_ROOT) -> GitInfo:
    """Commit and dirty flag of `repo`; "unknown" for both without git or outside a checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
        if head.returncode != 0:
            return GitInfo(UNKNOWN, UNKNOWN)
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return GitInfo(UNKNOWN, UNKNOWN)
    dirty: bool | str = bool(status.stdout.strip()) if status.returncode == 0 else UNKNOWN
    return GitInfo(head.stdout.strip(), dirty)


def package_versions(names: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Installed versions; for a distribution under another name (vLLM's CPU build installs the
    module `vllm` as the distribution `vllm-cpu`) an already imported module's __version__."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            module = sys.modules.get(name.replace("-", "_"))
            out[name] = str(getattr(module, "__version__", None) or "absent")
    return out


def physical_cores(cpus: list[int] | None = None) -> int:
    """Distinct (package, core) pairs among `cpus` (default: all online); logical count if unknown."""
    cpus = cpus if cpus is not None else sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    seen = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            seen.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus) or (os.cpu_count() or 1)
    return len(seen) or (os.cpu_count() or 1)


def cpu_description() -> dict[str, Any]:
    """kernels.cpu_caps.probe() as a dict, or a stdlib stand-in where it cannot be imported."""
    try:
        from kernels.cpu_caps import probe

        return {**probe().as_dict(), "source": "kernels.cpu_caps"}
    except Exception as e:  # noqa: BLE001 - no torch here, or a probe error: still stamp the result
        model, vendor, flags = UNKNOWN, "", []
        try:
            for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key == "vendor_id":
                    vendor = value.strip()
                elif key == "flags":
                    flags = sorted(f for f in value.split() if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
                    break
        except OSError:
            pass
        return {"model": model, "vendor": vendor, "flags": flags, "source": f"/proc/cpuinfo ({type(e).__name__})"}


def thread_settings(environ: dict[str, str] | None = None) -> ThreadSettings:
    env = os.environ if environ is None else environ
    picked = {k: v for k, v in sorted(env.items()) if k.startswith(THREAD_ENV_PREFIXES) or k in ISA_ENV_VARS}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return ThreadSettings(torch.get_num_threads(), torch.get_num_interop_threads(), picked)
    return ThreadSettings(None, None, picked)


def stamp(
    *, dtype: str | None = None, packages: tuple[str, ...] = (), extra: dict[str, Any] | None = None
) -> Provenance:
    """The stamp for a result made now in this process. `packages`: versions to add (e.g. "vllm")."""
    host = HostInfo(
        hostname=socket.gethostname(),
        platform=platform.platform(),
        machine=platform.machine(),
        logical_cpus=os.cpu_count() or 1,
        physical_cores=physical_cores(list(range(os.cpu_count() or 1))),
        cpu=cpu_description(),
    )
    return Provenance(
        schema_version=SCHEMA_VERSION,
        git=git_info(),
        timestamp_utc=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        host=host,
        python=sys.version.split()[0],
        versions=package_versions(list(dict.fromkeys(("tandem", *BASE_PACKAGES, *packages)))),
        threads=thread_settings(),
        dtype=dtype,
        load_average=[round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        extra=dict(extra or {}),
    )


def host_fingerprint(prov: dict[str, Any]) -> tuple:
    """What must match for two stamped results to be compared: the machine, not the moment."""
    host = prov.get("host", {})
    cpu = host.get("cpu", {})
    return (
        host.get("hostname"),
        host.get("machine"),
        host.get("logical_cpus"),
        cpu.get("model"),
        tuple(cpu.get("flags") or ()),
    )


def same_host(*provs: dict[str, Any] | None) -> bool:
    """True when every given stamp names the same host (missing stamps never match)."""
    if not provs or any(p is None for p in provs):
        return False
    first = host_fingerprint(provs[0])
    return all(host_fingerprint(p) == first for p in provs[1:])


def decided_dtype(requested: str | None, device: str = "cpu") -> str | None:
    """`requested` with "auto" decided as the engine decides it on this host (as given if it cannot be)."""
    if requested != "auto":
        return requested
    try:
        from kernels.cpu_caps import resolve_dtype

        return resolve_dtype(requested, device)[0]
    except Exception:  # noqa: BLE001 - no torch in this interpreter: keep what was asked
        return requested
