"""llama.cpp baseline: the `tandem bench engine` workload through `llama-server`.

Runs under OUR virtualenv (httpx, psutil, gguf) against the binaries `make bench-llamacpp`
builds (`loadgen/baselines/llamacpp_build.py`)::

    python -m loadgen.baselines.llamacpp_bench --model-file M.gguf --label bfloat16 \
        --prompts-file prompts.json --output-len 128 --kv-cache-gib 1 --max-num-seqs 128 \
        --max-num-batched-tokens 1024 --json out.json

What is measured is what the other systems report: the same token-id prompts, all sent at
once (one streaming `/completion` request each), exactly ``--output-len`` tokens each (greedy,
``ignore_eos``), after one tiny warm-up request; output tokens per second of the whole run, TTFT
per request (first streamed token minus the common start, as our engine's arrival time is the
submission), and the peak RSS of the `llama-server` process tree (the HTTP client is not the
serving system and is left out).

Server configuration (`plan_server`; every flag is recorded in the JSON):
- continuous batching with one slot per request (``-np``: all prompts at once, capped by our
  engine's `max_num_seqs`), llama.cpp's per-slot KV streams (``--no-kv-unified``: its
  high-throughput mode, where each sequence attends only its own cells; a unified pool makes
  every sequence scan every other's);
- context per slot: the longest request (prompt + output), or the slot's share of our engine's
  KV bytes if that is more, rounded up to 256 tokens, so every request fits and llama.cpp gets
  at least the KV memory we have;
- the token budget per step (``-b`` and ``-ub``) is our engine's `max_num_batched_tokens`;
- threads for generation and for prompt batches (``-t``, ``-tb``) on every physical core;
- KV cache type, flash attention, mmap: llama.cpp's defaults (f16 K/V, auto).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadgen.baselines import llamacpp_build  # noqa: E402
from loadgen.bench.common import TreeRssSampler, format_table, summarize, write_json  # noqa: E402
from loadgen.provenance import physical_cores  # noqa: E402
from loadgen.workloads.random_tokens import warmup_prompt  # noqa: E402
from services import lifeline  # noqa: E402
from services.broker import free_port  # noqa: E402

CTX_ROUND = 256
F16_BYTES = 2


@dataclass(frozen=True)
class ServerPlan:
    """One `llama-server` configuration."""

    binary: str
    model: str
    port: int
    slots: int
    ctx_per_slot: int
    batch: int  # -b: logical tokens per step
    ubatch: int  # -ub: physical tokens per compute graph
    threads: int  # -t
    threads_batch: int  # -tb
    host: str = "127.0.0.1"

    @property
    def ctx_size(self) -> int:
        return self.slots * self.ctx_per_slot


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, elem_bytes: int = F16_BYTES) -> int:
    """K and V bytes per token over all layers (llama.cpp's default cache type is f16)."""
    return 2 * n_layers * n_kv_heads * head_dim * elem_bytes


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def plan_server(
    *,
    binary: str,
    model: str,
    port: int,
    num_prompts: int,
    longest_request: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_gib: float,
    kv_bytes_token: int,
    threads: int,
) -> ServerPlan:
    """The server for this workload with our engine's budgets (pure; see the module docstring)."""
    if min(num_prompts, max_num_seqs, longest_request, max_num_batched_tokens, threads) < 1:
        raise ValueError("prompts, max_num_seqs, request length, token budget and threads must be >= 1")
    slots = min(num_prompts, max_num_seqs)
    share = int(kv_cache_gib * 2**30) // kv_bytes_token // slots
    ctx = _round_up(max(longest_request, share), CTX_ROUND)
    return ServerPlan(
        binary=binary,
        model=model,
        port=port,
        slots=slots,
        ctx_per_slot=ctx,
        batch=max_num_batched_tokens,
        ubatch=max_num_batched_tokens,
        threads=threads,
        threads_batch=threads,
    )


def server_command(plan: ServerPlan) -> list[str]:
    """`llama-server` argv for `plan`."""
    return [
        plan.binary,
        "--model",
        plan.model,
        "--host",
        plan.host,
        "--port",
        str(plan.port),
        "--parallel",
        str(plan.slots),
        "--ctx-size",
        str(plan.ctx_size),
        "--no-kv-unified",
        "--cont-batching",
        "--batch-size",
        str(plan.batch),
        "--ubatch-size",
        str(plan.ubatch),
        "--threads",
        str(plan.threads),
        "--threads-batch",
        str(plan.threads_batch),
        "--no-webui",
    ]


def request_body(prompt: list[int], max_tokens: int) -> dict:
    """One native `/completion` request: token ids in, exactly `max_tokens` greedy tokens out."""
    return {
        "prompt": prompt,
        "n_predict": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "stream": True,
        "return_tokens": True,
    }


def gguf_kv_bytes_per_token(path: str) -> int:
    """KV bytes per token (f16 cache) from a GGUF's metadata."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    arch = r.fields["general.architecture"].contents()

    def meta(key: str, default=None):
        f = r.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else default

    heads = meta("attention.head_count")
    head_dim = meta("attention.key_length") or meta("embedding_length") // heads
    return kv_bytes_per_token(meta("block_count"), meta("attention.head_count_kv", heads), head_dim)


# --- running it ---------------------------------------------------------------------------


class Server:
    """A `llama-server` child process with its log in a file; stopped on exit."""

    def __init__(self, cmd: list[str], log_path: Path, port: int) -> None:
        self.cmd, self.log_path, self.port = cmd, log_path, port
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in __exit__
        # Tied to this process (services.lifeline): a killed benchmark leaves no server behind.
        self.proc = subprocess.Popen(
            lifeline.tied_argv(self.cmd),
            env=lifeline.tied_env(dict(os.environ)),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Until /health answers 200 (the model is loaded and warmed up) or the server dies."""
        import httpx

        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(url, timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"llama-server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


async def _one(client, url: str, body: dict, start: float) -> tuple[float | None, int]:
    """Stream one completion: (time to its first token since `start`, tokens generated)."""
    first = None
    n_tokens = 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"llama-server answered {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            toks = chunk.get("tokens") or []
            if toks and first is None:
                first = time.perf_counter() - start
            n_tokens += len(toks)
            if chunk.get("stop"):
                n_tokens = chunk.get("tokens_predicted", n_tokens)
                break
    return first, n_tokens


async def _run_all(port: int, prompts: list[list[int]], max_tokens: int) -> tuple[float, list, list]:
    import httpx

    url = f"http://127.0.0.1:{port}/completion"
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        # warm-up, on a prompt outside the workload (no prompt-cache hit for prompt 0)
        await _one(client, url, request_body(warmup_prompt(prompts), 4), time.perf_counter())
        start = time.perf_counter()
        outs = await asyncio.gather(*(_one(client, url, request_body(p, max_tokens), start) for p in prompts))
        elapsed = time.perf_counter() - start
    return elapsed, [t for t, _ in outs], [n for _, n in outs]


def bench(args: argparse.Namespace) -> dict:
    root = Path(args.llamacpp_dir)
    exe = llamacpp_build.binary(root, "llama-server")
    if not exe.is_file():
        raise SystemExit(f"{exe} not found: run `make bench-llamacpp` (it builds llama.cpp into {root})")
    prompts = json.loads(Path(args.prompts_file).read_text())
    port = args.port or free_port()
    plan = plan_server(
        binary=str(exe),
        model=args.model_file,
        port=port,
        num_prompts=len(prompts),
        longest_request=max(map(len, prompts)) + args.output_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gib=args.kv_cache_gib,
        kv_bytes_token=gguf_kv_bytes_per_token(args.model_file),
        threads=args.threads or physical_cores(),
    )
    cmd = server_command(plan)
    log_path = Path(args.log or (Path(args.json_path).with_suffix(".server.log") if args.json_path else "server.log"))
    with Server(cmd, log_path, port) as server:
        t0 = time.perf_counter()
        server.wait_ready(args.ready_timeout)
        load_s = time.perf_counter() - t0
        with TreeRssSampler(pid=server.proc.pid) as rss:
            elapsed, ttfts, counts = asyncio.run(_run_all(port, prompts, args.output_len))
    out_tokens = sum(counts)
    if out_tokens != len(prompts) * args.output_len:
        print(f"warning: expected {len(prompts) * args.output_len} output tokens, got {out_tokens}", file=sys.stderr)
    build = llamacpp_build.read_build_info(root) or {}
    config = {
        "model": args.model_file,
        "weights": args.label,
        "num_prompts": len(prompts),
        "output_len": args.output_len,
        "dtype": args.dtype,
        "prompts_file": args.prompts_file,
        "server_plan": {**asdict(plan), "ctx_size": plan.ctx_size},
        "server_command": cmd,
        "budgets": {
            "kv_cache_gib": args.kv_cache_gib,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
    }
    return summarize(
        system=f"llamacpp-{args.label}",
        num_requests=len(prompts),
        input_tokens=sum(map(len, prompts)),
        output_tokens=out_tokens,
        elapsed_s=elapsed,
        ttfts_s=[t for t in ttfts if t is not None],
        peak_rss_bytes=rss.peak_bytes,
        config=config,
        extra={"load_s": load_s, "ttft_source": "client: first streamed token since the common start"},
        packages=("gguf", "httpx"),
        provenance_extra={"llamacpp_build": build},
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp-dir", default=str(Path(__file__).resolve().parents[2] / ".llamacpp"))
    ap.add_argument("--model-file", required=True, help="GGUF to serve")
    ap.add_argument("--label", required=True, help="row name: the weights' type (bfloat16, float32, q4_1)")
    ap.add_argument("--dtype", required=True, help="the weights' dtype as recorded (bfloat16, float32, q4_1)")
    ap.add_argument("--prompts-file", required=True, help="JSON list of token-id lists (what our engine ran)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-gib", type=float, required=True, help="our engine's KV size")
    ap.add_argument("--max-num-seqs", type=int, required=True, help="our engine's")
    ap.add_argument("--max-num-batched-tokens", type=int, required=True, help="our engine's token budget per step")
    ap.add_argument("--threads", type=int, default=None, help="default: every physical core")
    ap.add_argument("--port", type=int, default=None, help="default: a free one")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--log", default=None, help="server log (default: next to --json)")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    lifeline.interrupt_on_termination()  # SIGTERM unwinds through `Server.__exit__`
    res = bench(args)
    write_json(res, args.json_path)
    if not args.quiet:
        print(format_table(res), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
