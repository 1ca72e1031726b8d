"""What this CPU computes natively, probed once per process.

Every fast CPU path (bfloat16 weights, oneDNN's packed bf16 GEMMs, the vector ISA the compiled
kernels are built for) is chosen from this probe, never assumed: hosts differ (Intel with AMX,
AMD Zen 4/5 with AVX512-BF16, AMD Zen 3 and older Intel with AVX2 only, laptops), and a path
that only exists on some of them must fall back, with a log line, on the others.

The probe reads the kernel's CPU flags (`/proc/cpuinfo`) and caps them by what torch itself was
told to use (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`), so one host can emulate a lesser one.
`TANDEM_CPU_ISA=avx2` (or `avx512`, `amx`) caps our own probe the same way; to emulate an
AVX2-only host on a better one, set all three:

    TANDEM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

(`make test` runs the engine's core tests once more in that mode.)
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger(__name__)

# ISA levels, lowest first. "avx512" means the AVX-512 subsets oneDNN needs for bf16 (F, BW, VL, DQ).
ISA_LEVELS = ("baseline", "avx2", "avx512", "amx")
ENV_OVERRIDE = "TANDEM_CPU_ISA"

_AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
_LEVEL_OF_ATEN = {"default": "baseline", "no avx": "baseline", "avx2": "avx2", "avx512": "avx512"}
_LEVEL_OF_ONEDNN = (("AMX", "amx"), ("AVX512", "avx512"), ("AVX2", "avx2"), ("AVX", "baseline"), ("SSE", "baseline"))


@dataclass(frozen=True)
class CpuCaps:
    """The CPU as the engine may use it (after any cap), for choices and for result stamps."""

    model: str  # "AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+", ...
    vendor: str  # "AuthenticAMD", "GenuineIntel", ""
    logical_cpus: int  # the host's logical CPUs
    isa: str  # highest usable level in ISA_LEVELS
    native_bf16: bool  # bf16 dot products in hardware (AVX512-BF16 or AMX-BF16), usable at `isa`
    flags: tuple[str, ...]  # the SIMD flags that matter here, after the cap (sorted)
    capped_by: tuple[str, ...]  # which settings lowered `isa` below the hardware's ("TANDEM_CPU_ISA=avx2", ...)
    aten_capability: str  # torch's own dispatch level (torch.backends.cpu.get_cpu_capability())

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        cap = f", capped by {' '.join(self.capped_by)}" if self.capped_by else ""
        bf16 = "yes" if self.native_bf16 else "no"
        return f"{self.model} ({self.logical_cpus} CPUs, {self.isa}, native bf16 {bf16}{cap})"


def _read_cpuinfo() -> tuple[str, str, set[str]]:
    """(model name, vendor, flags) of the first CPU in /proc/cpuinfo; empty where there is none."""
    model, vendor, flags = platform.processor() or platform.machine(), "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key == "vendor_id":
                    vendor = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model, vendor, flags


def _hardware_level(flags: set[str]) -> str:
    if {"amx_bf16", "amx_tile"} <= flags and all(f in flags for f in _AVX512_CORE):
        return "amx"
    if all(f in flags for f in _AVX512_CORE):
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "baseline"


def _caps_from_environment() -> list[tuple[str, str]]:
    """(setting, level) for each setting that limits the usable ISA."""
    caps = []
    ours = os.environ.get(ENV_OVERRIDE, "").strip().lower()
    if ours and ours not in ("native", "auto"):
        if ours not in ISA_LEVELS:
            raise ValueError(f"{ENV_OVERRIDE}={ours!r}: expected one of {', '.join(ISA_LEVELS)} or native")
        caps.append((f"{ENV_OVERRIDE}={ours}", ours))
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in _LEVEL_OF_ATEN:
        caps.append((f"ATEN_CPU_CAPABILITY={aten}", _LEVEL_OF_ATEN[aten]))
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if onednn and onednn != "ALL":
        level = next((lvl for prefix, lvl in _LEVEL_OF_ONEDNN if onednn.startswith(prefix)), None)
        if level is not None:
            caps.append((f"ONEDNN_MAX_CPU_ISA={onednn}", level))
    return caps


def _visible_flags(flags: set[str], level: str) -> tuple[str, ...]:
    """The SIMD flags a `level` machine could have: AVX-512 and AMX flags vanish below their level."""
    rank = ISA_LEVELS.index(level)
    keep = {f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))}
    if rank < ISA_LEVELS.index("amx"):
        keep = {f for f in keep if not f.startswith("amx")}
    if rank < ISA_LEVELS.index("avx512"):
        keep = {f for f in keep if not f.startswith("avx512")}
    if rank < ISA_LEVELS.index("avx2"):
        keep = {f for f in keep if f not in ("avx2", "fma", "avx_vnni")}
    return tuple(sorted(keep))


@functools.cache
def probe() -> CpuCaps:
    """The usable capabilities of this CPU (cached: one probe per process)."""
    model, vendor, flags = _read_cpuinfo()
    level = _hardware_level(flags)
    capped_by = []
    for setting, cap in _caps_from_environment():
        if ISA_LEVELS.index(cap) < ISA_LEVELS.index(level):
            level = cap
            capped_by.append(setting)
    visible = _visible_flags(flags, level)
    # os.cpu_count(), not the affinity mask: OpenMP binding (OMP_PROC_BIND) narrows the main
    # thread's mask to one core once torch starts its threads, which says nothing of the host.
    return CpuCaps(
        model=model,
        vendor=vendor,
        logical_cpus=os.cpu_count() or 1,
        isa=level,
        native_bf16="avx512_bf16" in visible or "amx_bf16" in visible,
        flags=visible,
        capped_by=tuple(capped_by),
        aten_capability=torch.backends.cpu.get_cpu_capability(),
    )


def resolve_dtype(requested: str, device: str) -> tuple[str, str]:
    """The dtype an engine runs in, and why, for `requested` in auto/float32/bfloat16/float16.

    `auto`: on CPU, bfloat16 where the hardware computes it natively (AVX512-BF16 or AMX),
    float32 elsewhere (an AVX2 CPU emulates bf16 GEMMs several times slower than float32 ones);
    on CUDA, bfloat16 where supported, else float16. An explicit choice is kept as is, with a
    warning when it is bf16 on a CPU without native bf16.
    """
    if requested not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {requested!r}")
    if device.startswith("cuda"):
        if requested != "auto":
            return requested, "requested"
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ("bfloat16", "the GPU supports bf16") if bf16 else ("float16", "the GPU has no bf16")
    caps = probe()
    if requested == "auto":
        if caps.native_bf16:
            return "bfloat16", f"native bf16 on this CPU ({caps.describe()})"
        return "float32", f"no native bf16 on this CPU ({caps.describe()})"
    if requested == "bfloat16" and not caps.native_bf16:
        log.warning(
            "dtype bfloat16 requested on a CPU without native bf16 (%s): it is emulated and runs several "
            "times slower than float32; dtype auto would pick float32",
            caps.describe(),
        )
    return requested, "requested"


def isolate_compile_cache() -> None:
    """Give Inductor's on-disk caches one directory per vector ISA (unless the user chose one).

    Inductor's caches are not keyed by the ISA that `ATEN_CPU_CAPABILITY` selects: on one host,
    kernels cached by a native (AVX-512) run and reused by an `ATEN_CPU_CAPABILITY=avx2` run
    returned garbage (values ~1e37; measured with tests/kernels/test_compiled_decode.py). A
    cache shared between different hosts (a home directory on NFS) would meet the same.
    Importing `torch._dynamo` already sets `TORCHINDUCTOR_CACHE_DIR` to torch's default, so a
    value equal to that default counts as unset; Inductor reads the variable at each use.
    Called before every compilation (`kernels/compiled/decode.py: compile_copy`).
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = default_cache_dir()
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", base) != base:
        return
    isa = torch.backends.cpu.get_cpu_capability().lower().replace(" ", "-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"tandem-{isa}")
