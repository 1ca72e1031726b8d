"""`tandem bench compare-vllm`: our engine vs vLLM on the identical workload, one after the other.

1. exports the bundled GGUF model to a Hugging Face directory once (vLLM cannot load GGUF);
2. runs `tandem bench engine` in a subprocess of this interpreter (our venv), which also dumps
   the exact prompts it ran;
3. runs ``loadgen/baselines/vllm_bench.py`` under the vLLM virtualenv's Python on those prompts;
4. prints both results side by side with the ratio and writes one JSON file.

The two systems never run concurrently (the benchmark machine has 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loadgen.bench.common import add_workload_args, write_json
from loadgen.provenance import stamp

REPO_ROOT = Path(__file__).resolve().parents[2]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare-vllm",
        help="ours vs vLLM on the identical workload",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_workload_args(p)
    p.add_argument("--max-num-seqs", type=int, default=None, help="ours (default: engine default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="ours (default: engine default)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="ours (default: engine default)")
    p.add_argument(
        "--vllm-python",
        default=str(REPO_ROOT / ".venv-vllm" / "bin" / "python"),
        help="the vLLM virtualenv's interpreter",
    )
    p.add_argument(
        "--vllm-kv-cache-gib", type=int, default=None, help="vLLM KV cache, whole GiB (default: vllm_bench.py's, 4)"
    )
    p.add_argument("--skip-tandem", action="store_true", help="run only vLLM (on freshly generated prompts)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate ours/vLLM this many times and report the median-ratio round (default 1)",
    )
    p.set_defaults(func=run)


def _workload_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        args.model,
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len[0]),
        str(args.input_len[1]),
        "--output-len",
        str(args.output_len),
        "--dtype",
        args.dtype,
        "--seed",
        str(args.seed),
    ]


def _run(cmd: list[str], log_path: Path, env: dict | None = None) -> None:
    print(f"$ {' '.join(cmd)}\n  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(f"command failed with exit code {proc.returncode}:\n" + "\n".join(tail))


def run(args: argparse.Namespace) -> int:
    from kernels.cpu_caps import resolve_dtype

    args.dtype = resolve_dtype(args.dtype, "cpu")[0]  # both systems run the same, decided dtype
    out_dir = Path(args.json_path).parent if args.json_path else Path(tempfile.mkdtemp(prefix="tandem-compare-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(args.json_path).stem if args.json_path else "vllm-compare"

    if not Path(args.vllm_python).exists():
        raise SystemExit(f"{args.vllm_python} not found: run `make bench-vllm` (it builds .venv-vllm)")

    # The model vLLM can load: a dequantised HF export of the same GGUF (made once, cached).
    if args.model == "default":
        _run([sys.executable, "-m", "loadgen.baselines.export_hf"], out_dir / f"{stem}.export.log")

    # Alternate the systems round by round: on a noisy machine one pair is not evidence, the
    # median of per-round ratios (each taken minutes apart at most) is.
    rounds = []
    for i in range(args.rounds):
        tag = stem if args.rounds == 1 else f"{stem}.round{i + 1}"
        ours, theirs = _run_pair(args, out_dir, tag)
        rounds.append({"tandem": ours, "vllm": theirs, "ratio_output_tokens_per_s": _ratio(ours, theirs)})
        if args.rounds > 1:
            print(f"round {i + 1}: ratio {_fmt_ratio(rounds[-1]['ratio_output_tokens_per_s'])}", flush=True)

    ratios = sorted(r["ratio_output_tokens_per_s"] for r in rounds if r["ratio_output_tokens_per_s"] is not None)
    shown = rounds[-1]
    if ratios:  # show the round whose ratio is the median (upper median for even counts)
        shown = next(r for r in rounds if r["ratio_output_tokens_per_s"] == ratios[len(ratios) // 2])
    result = {
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": list(args.input_len),
            "output_len": args.output_len,
            "dtype": args.dtype,
            "seed": args.seed,
            "model": args.model,
            "identical_prompts": shown["tandem"] is not None,
        },
        "tandem": shown["tandem"],
        "vllm": shown["vllm"],
        "ratio_output_tokens_per_s": shown["ratio_output_tokens_per_s"],
        "ratios_per_round": [r["ratio_output_tokens_per_s"] for r in rounds],
        "rounds": rounds,
        "provenance": stamp(dtype=args.dtype).as_dict(),
    }
    print()
    print(format_comparison(result))
    if args.rounds > 1:
        print(
            "ratio per round: "
            + ", ".join(_fmt_ratio(r) for r in result["ratios_per_round"])
            + " (table shows the median round)"
        )
    write_json(result, args.json_path)
    if args.json_path:
        print(f"wrote {args.json_path}")
    return 0


def _run_pair(args: argparse.Namespace, out_dir: Path, tag: str) -> tuple[dict | None, dict]:
    """Ours, then vLLM on the very same prompts; returns both result dicts."""
    prompts_file = out_dir / f"{tag}.prompts.json"
    ours_json, vllm_json = out_dir / f"{tag}.tandem.json", out_dir / f"{tag}.vllm.json"
    ours = None
    if not args.skip_tandem:
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "bench",
            "engine",
            *_workload_argv(args),
            "--json",
            str(ours_json),
            "--dump-prompts",
            str(prompts_file),
            "--quiet",
        ]
        for flag, val in (
            ("--max-num-seqs", args.max_num_seqs),
            ("--max-num-batched-tokens", args.max_num_batched_tokens),
            ("--kv-cache-gib", args.kv_cache_gib),
        ):
            if val is not None:
                cmd += [flag, str(val)]
        _run(cmd, out_dir / f"{tag}.tandem.log")
        ours = json.loads(ours_json.read_text())

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [
        args.vllm_python,
        str(REPO_ROOT / "loadgen" / "baselines" / "vllm_bench.py"),
        *_workload_argv(args),
        "--json",
        str(vllm_json),
        "--quiet",
    ]
    if ours is not None:
        cmd += ["--prompts-file", str(prompts_file)]
    if args.vllm_kv_cache_gib is not None:
        cmd += ["--kv-cache-gib", str(args.vllm_kv_cache_gib)]
    _run(cmd, out_dir / f"{tag}.vllm.log", env=env)
    return ours, json.loads(vllm_json.read_text())


def _ratio(ours: dict | None, theirs: dict) -> float | None:
    if ours and ours.get("output_tokens_per_s") and theirs.get("output_tokens_per_s"):
        return ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    return None


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def format_comparison(result: dict) -> str:
    ours, theirs = result.get("tandem") or {}, result.get("vllm") or {}

    def f(v, scale=1.0, unit=""):
        return "n/a" if v is None else f"{v * scale:,.1f}{unit}"

    rows = [("", "tandem", "vllm", "tandem/vllm")]
    for label, key, scale, unit in (
        ("output tokens/s", "output_tokens_per_s", 1.0, ""),
        ("total tokens/s", "total_tokens_per_s", 1.0, ""),
        ("elapsed", "elapsed_s", 1.0, " s"),
        ("TTFT p50", "ttft_p50_s", 1000.0, " ms"),
        ("TTFT p99", "ttft_p99_s", 1000.0, " ms"),
        ("peak RSS", "peak_rss_gib", 1.0, " GiB"),
    ):
        a, b = ours.get(key), theirs.get(key)
        r = f"{a / b:.2f}x" if a is not None and b else "n/a"
        rows.append((label, f(a, scale, unit), f(b, scale, unit), r))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    wl = result["workload"]
    head = (
        f"workload: {wl['num_prompts']} prompts, input U[{wl['input_len'][0]},{wl['input_len'][1]}], "
        f"output {wl['output_len']} (ignore_eos, greedy), {wl['dtype']}"
    )
    lines = [head] + ["  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    return "\n".join(lines)
