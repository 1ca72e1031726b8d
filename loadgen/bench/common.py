"""Helpers shared by `tandem bench engine` and the baseline scripts.

Standard library only (psutil when available): the vLLM baseline imports this from its own
virtualenv, so nothing here may import torch or the engine at import time. Every result record
carries a provenance stamp (`loadgen/provenance.py`).
"""

from __future__ import annotations

import json
import os
import resource
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def add_workload_args(ap, *, dtype_choices: Sequence[str] = ("auto", "bfloat16", "float32")) -> None:
    """The workload arguments every benchmark in this repository accepts, with the same defaults."""
    ap.add_argument(
        "--model", default="default", help="model name or path (default: the bundled SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=[50, 300],
        metavar=("LO", "HI"),
        help="prompt lengths are uniform in [LO, HI] (inclusive)",
    )
    ap.add_argument("--output-len", type=int, default=128, help="tokens generated per request (EOS ignored)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=list(dtype_choices),
        help="auto: bfloat16 where the CPU has native bf16, else float32 (kernels/cpu_caps.py)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="also write the results here")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    if len(vals) == 1:
        return float(vals[0])
    pos = (len(vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return float(vals[lo] + (vals[hi] - vals[lo]) * (pos - lo))


def self_peak_rss_bytes() -> int:
    """Peak RSS of this process (ru_maxrss is KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class TreeRssSampler:
    """Samples the summed RSS of a process (default: this one) and all its descendants.

    vLLM runs its engine core in a child process, so the process's own ru_maxrss would under-count
    it; summing the tree makes the systems comparable. For llama.cpp the tree is the
    `llama-server` process's (`pid`), the serving system a user runs, not the HTTP client's.
    Falls back to ru_maxrss without psutil (only for this process).
    """

    def __init__(self, interval_s: float = 0.1, pid: int | None = None) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._own = pid is None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import psutil

            self._proc = psutil.Process(os.getpid() if pid is None else pid)
        except ImportError:  # pragma: no cover - psutil missing
            self._proc = None

    def sample(self) -> int:
        if self._proc is None:
            return self_peak_rss_bytes() if self._own else 0
        total = 0
        import psutil

        try:
            procs = [self._proc] + self._proc.children(recursive=True)
        except psutil.Error:
            procs = [self._proc]
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:  # a child that exited meanwhile
                pass
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> TreeRssSampler:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


def summarize(
    *,
    system: str,
    num_requests: int,
    input_tokens: int,
    output_tokens: int,
    elapsed_s: float,
    ttfts_s: Sequence[float] | None,
    peak_rss_bytes: int | None,
    config: dict[str, Any],
    extra: dict[str, Any] | None = None,
    packages: tuple[str, ...] = (),
    provenance_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result record every benchmark writes (same keys for ours and the baselines).

    `packages`: versions to stamp besides Python/torch/transformers/numpy (e.g. "vllm");
    `provenance_extra`: system-specific provenance (a llama.cpp build's version and options).
    """
    from loadgen.provenance import stamp

    ttfts = [t for t in (ttfts_s or []) if t is not None]
    res: dict[str, Any] = {
        "system": system,
        "requests": num_requests,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s if elapsed_s > 0 else None,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed_s if elapsed_s > 0 else None,
        "requests_per_s": num_requests / elapsed_s if elapsed_s > 0 else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "peak_rss_bytes": peak_rss_bytes,
        "peak_rss_gib": peak_rss_bytes / 2**30 if peak_rss_bytes else None,
        "config": config,
        "provenance": stamp(dtype=config.get("dtype"), packages=packages, extra=provenance_extra).as_dict(),
    }
    if extra:
        res.update(extra)
    return res


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.3f}{unit}" if abs(v) < 10 else f"{v:,.1f}{unit}"
    return f"{v:,}{unit}"


def format_table(res: dict[str, Any]) -> str:
    """A small human-readable table of one result record."""
    ms = lambda v: None if v is None else v * 1000.0  # noqa: E731
    rows = [
        ("system", res.get("system")),
        ("requests", _fmt(res.get("requests"))),
        ("input tokens", _fmt(res.get("input_tokens"))),
        ("output tokens", _fmt(res.get("output_tokens"))),
        ("elapsed", _fmt(res.get("elapsed_s"), " s")),
        ("output tokens/s", _fmt(res.get("output_tokens_per_s"))),
        ("total tokens/s", _fmt(res.get("total_tokens_per_s"))),
        ("TTFT p50", _fmt(ms(res.get("ttft_p50_s")), " ms")),
        ("TTFT p99", _fmt(ms(res.get("ttft_p99_s")), " ms")),
        ("peak RSS", _fmt(res.get("peak_rss_gib"), " GiB")),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def write_json(res: Any, path: str | os.PathLike | None) -> None:
    if not path:
        return
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(res, indent=2, sort_keys=False) + "\n")
