"""`tandem bench compare`: our engine against vLLM and llama.cpp on the identical workload.

`compare --baselines vllm,llamacpp` (or `compare-vllm`, `compare-llamacpp`) runs, in every round,
one after the other (never concurrently; the machine has 2 cores):

- ``tandem``: `tandem bench engine` in a subprocess of this interpreter, which also writes the
  exact prompts it ran (the others replay them);
- ``vllm-default`` and ``vllm-all-cores``: `loadgen/baselines/vllm_bench.py` under the vLLM
  virtualenv with vLLM's own CPU binding and bound to every physical core;
- ``llamacpp-<dtype>`` and ``llamacpp-q4_1``: `loadgen/baselines/llamacpp_bench.py` serving the
  parity GGUF (the shipped weights dequantised to our dtype, `llamacpp_gguf.py`) and the shipped
  Q4_1 file itself ("what a user runs").

Fairness, decided here: every system gets our engine's KV size, `max_num_seqs` and
`max_num_batched_tokens` explicitly (resolved from `EngineConfig` and the flags, recorded under
``budgets``), all cores, the same dtype and prompts; the rows rotate round by round; our ratio
against vLLM is against the better of its two bindings in that round (`comparison.py`); every
row carries a provenance stamp and the comparison says whether they all name one host.

Two process-level decisions keep the rows from inheriting this process's state:
- Every row starts on every CPU this process was allowed when `run` began. The `tandem` CLI sets
  `OMP_PROC_BIND=close OMP_PLACES=cores` (our engine's tuning), so once this process loads torch
  (to decide the dtype) OpenMP pins its main thread to one core, and a child inherits that
  one-CPU mask: our engine then ran with one thread and vLLM's binding found one CPU (seen in a
  smoke run's provenance). Each child's mask is reset before it starts.
- Baseline rows run without the OpenMP placement variables (`BASELINE_DROPPED_ENV`): those are
  our engine's settings, not vLLM's (it sets its own for its engine core) nor llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.bench.common import add_workload_args, write_json
from loadgen.bench.comparison import (
    OURS,
    Budgets,
    comparison_document,
    format_comparison,
    ratios_against_best,
    round_order,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
BASELINE_DROPPED_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "OMP_WAIT_POLICY", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
BASELINES = ("vllm", "llamacpp")
VLLM_BINDINGS = ("default", "all-cores")
LLAMACPP_WEIGHTS = ("parity", "q4_1")


@dataclass(frozen=True)
class Row:
    """One system configuration: the command that measures it, and the group it competes in."""

    name: str
    group: str | None  # None for ours
    argv: list[str]
    out: Path | None  # the result JSON the command writes
    env: dict[str, str] | None = field(default=None)


def groups_of(rows: list[Row]) -> dict[str, list[str]]:
    """Baseline group -> its rows' names, in row order."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.group:
            groups.setdefault(r.group, []).append(r.name)
    return groups


def add_parser(sub: argparse._SubParsersAction) -> None:
    for name, baselines, help_ in (
        ("compare", None, "ours vs vLLM and/or llama.cpp on the identical workload"),
        ("compare-vllm", "vllm", "ours vs vLLM (default binding and all cores) on the identical workload"),
        ("compare-llamacpp", "llamacpp", "ours vs llama.cpp (parity GGUF and Q4_1) on the identical workload"),
    ):
        p = sub.add_parser(name, help=help_, description=__doc__.split("\n\n")[0] if __doc__ else None)
        _add_args(p, baselines)
        p.set_defaults(func=run)


def _add_args(p: argparse.ArgumentParser, fixed_baselines: str | None) -> None:
    add_workload_args(p)
    if fixed_baselines is None:
        p.add_argument("--baselines", default="vllm,llamacpp", help="comma-separated: vllm, llamacpp")
    else:
        p.set_defaults(baselines=fixed_baselines)
    p.add_argument("--max-num-seqs", type=int, default=None, help="every system (default: our engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="every system (default: our engine's)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="every system (default: our engine's)")
    p.add_argument("--vllm-python", default=str(REPO_ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--vllm-bindings", default=",".join(VLLM_BINDINGS), help="comma-separated: default, all-cores")
    p.add_argument("--llamacpp-dir", default=str(REPO_ROOT / ".llamacpp"), help="where `make bench-llamacpp` built")
    p.add_argument("--llamacpp-weights", default=",".join(LLAMACPP_WEIGHTS), help="comma-separated: parity, q4_1")
    p.add_argument("--skip-tandem", action="store_true", help="baselines only (prompts generated here)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of all rows, order rotated each round")


def _split(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"{what}: expected a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    return items


def resolve_budgets(args: argparse.Namespace) -> Budgets:
    """Our engine's limits (EngineConfig's defaults unless given): what every system gets."""
    from engine.config import EngineConfig

    d = EngineConfig()
    pick = lambda v, default: default if v is None else v  # noqa: E731
    return Budgets(
        kv_cache_gib=float(pick(args.kv_cache_gib, d.kv_cache_gib)),
        max_num_seqs=int(pick(args.max_num_seqs, d.max_num_seqs)),
        max_num_batched_tokens=int(pick(args.max_num_batched_tokens, d.max_num_batched_tokens)),
    )


def workload_argv(args: argparse.Namespace) -> list[str]:
    lo, hi = args.input_len
    return [
        *("--model", args.model, "--num-prompts", str(args.num_prompts), "--input-len", str(lo), str(hi)),
        *("--output-len", str(args.output_len), "--dtype", args.dtype, "--seed", str(args.seed)),
    ]


def _budget_argv(b: Budgets) -> list[str]:
    return [
        *("--kv-cache-gib", str(b.kv_cache_gib), "--max-num-seqs", str(b.max_num_seqs)),
        *("--max-num-batched-tokens", str(b.max_num_batched_tokens)),
    ]


def tandem_row(args: argparse.Namespace, budgets: Budgets, out: Path, prompts: Path) -> Row:
    argv = [sys.executable, "-m", "services.cli", "bench", "engine", *workload_argv(args), *_budget_argv(budgets)]
    return Row(OURS, None, [*argv, "--json", str(out), "--dump-prompts", str(prompts), "--quiet"], out)


def baseline_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a baseline row runs in: ours minus our OpenMP placement tuning."""
    env = dict(os.environ if environ is None else environ)
    for var in BASELINE_DROPPED_ENV:
        env.pop(var, None)
    return env


def vllm_row(args: argparse.Namespace, budgets: Budgets, binding: str, out: Path, prompts: Path) -> Row:
    """vLLM with `binding` (vllm_bench.py sets its VLLM_CPU_* variables), our budgets and prompts."""
    env = baseline_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(var, None)  # the binding is the row's, not inherited from the caller's shell
    script = str(REPO_ROOT / "loadgen" / "baselines" / "vllm_bench.py")
    argv = [args.vllm_python, script, *workload_argv(args), *_budget_argv(budgets), "--binding", binding]
    argv += ["--prompts-file", str(prompts), "--json", str(out), "--quiet"]
    return Row(f"vllm-{binding}", "vllm", argv, out, env)


def llamacpp_row(
    args: argparse.Namespace, budgets: Budgets, weights: str, model_file: Path, out: Path, prompts: Path
) -> Row:
    """llama-server on `model_file`: the parity GGUF (row named after our dtype) or the shipped Q4_1."""
    label = args.dtype if weights == "parity" else "q4_1"
    argv = [
        *(sys.executable, "-m", "loadgen.baselines.llamacpp_bench", "--llamacpp-dir", args.llamacpp_dir),
        *("--model-file", str(model_file), "--label", label, "--dtype", label, "--prompts-file", str(prompts)),
        *("--output-len", str(args.output_len), *_budget_argv(budgets), "--json", str(out), "--quiet"),
    ]
    group = "llamacpp-parity" if weights == "parity" else "llamacpp-q4_1"
    return Row(f"llamacpp-{label}", group, argv, out, baseline_env())


def build_rows(args: argparse.Namespace, budgets: Budgets, out_dir: Path, tag: str, prompts: Path) -> list[Row]:
    """Every row of one round, ours first (the order they run in is `round_order`'s)."""
    baselines = _split(args.baselines, BASELINES, "--baselines")
    rows = [] if args.skip_tandem else [tandem_row(args, budgets, out_dir / f"{tag}.tandem.json", prompts)]
    if "vllm" in baselines:
        for b in _split(args.vllm_bindings, VLLM_BINDINGS, "--vllm-bindings"):
            rows.append(vllm_row(args, budgets, b, out_dir / f"{tag}.vllm-{b}.json", prompts))
    if "llamacpp" in baselines:
        for w in _split(args.llamacpp_weights, LLAMACPP_WEIGHTS, "--llamacpp-weights"):
            model = _llamacpp_model(args, w)
            out = out_dir / f"{tag}.llamacpp-{args.dtype if w == 'parity' else 'q4_1'}.json"  # named as the row
            rows.append(llamacpp_row(args, budgets, w, model, out, prompts))
    return rows


def _llamacpp_model(args: argparse.Namespace, weights: str) -> Path:
    from loadgen.baselines.export_hf import default_gguf_path
    from loadgen.baselines.llamacpp_gguf import default_output

    if args.model != "default":
        raise SystemExit("llama.cpp rows need --model default (the bundled GGUF and its parity copies)")
    src = default_gguf_path()
    return src if weights == "q4_1" else default_output(args.dtype, src)


def _run(row: Row, log_path: Path, cpus: set[int]) -> None:
    """Run `row` on `cpus` (its CPU mask reset before it starts; see the module docstring)."""
    print(f"$ {' '.join(row.argv)}\n  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(
            row.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=row.env,
            cwd=REPO_ROOT,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(f"{row.name} failed with exit code {proc.returncode}:\n" + "\n".join(tail))


def _prepare(args: argparse.Namespace, out_dir: Path, stem: str, cpus: set[int]) -> None:
    """One-off inputs: the HF export for vLLM, the parity GGUF and built binaries for llama.cpp."""
    baselines = _split(args.baselines, BASELINES, "--baselines")
    if "vllm" in baselines:
        if not Path(args.vllm_python).exists():
            raise SystemExit(f"{args.vllm_python} not found: run `make bench-vllm` (it builds .venv-vllm)")
        if args.model == "default":
            prep = [sys.executable, "-m", "loadgen.baselines.export_hf"]
            _run(Row("export", None, prep, None), out_dir / f"{stem}.export.log", cpus)
    if "llamacpp" in baselines:
        from loadgen.baselines import llamacpp_build

        if not llamacpp_build.binary(Path(args.llamacpp_dir), "llama-server").is_file():
            raise SystemExit(f"no llama-server under {args.llamacpp_dir}: run `make bench-llamacpp` (it builds it)")
        if "parity" in _split(args.llamacpp_weights, LLAMACPP_WEIGHTS, "--llamacpp-weights"):
            prep = [sys.executable, "-m", "loadgen.baselines.llamacpp_gguf", "--dtype", args.dtype]
            _run(Row("parity-gguf", None, prep, None), out_dir / f"{stem}.gguf.log", cpus)


def _generate_prompts(args: argparse.Namespace, path: Path) -> None:
    """--skip-tandem: the workload's prompts from the model's tokenizer, as our bench makes them."""
    from engine.loader import load_model_config, load_tokenizer, resolve_model
    from loadgen.workloads.random_tokens import random_token_prompts, special_token_ids

    source = resolve_model(args.model)
    cfg = load_model_config(source)
    tok = load_tokenizer(source)
    extra = [cfg.bos_token_id, *cfg.eos_token_ids]
    prompts = random_token_prompts(
        args.num_prompts, tuple(args.input_len), cfg.vocab_size, args.seed, special_token_ids(tok, extra=extra)
    )
    path.write_text(json.dumps(prompts))


def run(args: argparse.Namespace) -> int:
    cpus = os.sched_getaffinity(0)  # before torch loads and OpenMP pins this process to one core
    from kernels.cpu_caps import resolve_dtype
    from loadgen.provenance import stamp

    args.dtype = resolve_dtype(args.dtype, "cpu")[0]  # every system runs the same, decided dtype
    out_dir = Path(args.json_path).parent if args.json_path else Path(tempfile.mkdtemp(prefix="tandem-compare-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(args.json_path).stem if args.json_path else "compare"
    budgets = resolve_budgets(args)
    _prepare(args, out_dir, stem, cpus)
    prompts = out_dir / f"{stem}.prompts.json"
    if args.skip_tandem:
        _generate_prompts(args, prompts)

    rounds = []
    names: list[str] = []
    groups: dict[str, list[str]] = {}
    for i in range(args.rounds):
        tag = f"{stem}.round{i + 1}"
        rows = build_rows(args, budgets, out_dir, tag, prompts)
        names, groups = [r.name for r in rows], groups_of(rows)
        by_name = {r.name: r for r in rows}
        order = round_order(names, i)
        results = {}
        for name in order:
            _run(by_name[name], out_dir / f"{tag}.{name}.log", cpus)
            results[name] = json.loads(by_name[name].out.read_text())
        ratios = ratios_against_best(results, groups)
        rounds.append({"order": order, "results": results, "ratios": ratios})
        print(f"round {i + 1}: " + ", ".join(f"{g} {_fmt_ratio(r['ratio'])}" for g, r in ratios.items()), flush=True)

    workload = {
        "num_prompts": args.num_prompts,
        "input_len": list(args.input_len),
        "output_len": args.output_len,
        "dtype": args.dtype,
        "seed": args.seed,
        "model": args.model,
        "identical_prompts": True,
        "prompts_file": str(prompts),
    }
    prov = stamp(dtype=args.dtype, extra={"command": "tandem bench compare"}).as_dict()
    result = comparison_document(workload, budgets, names, groups, rounds, prov)
    print()
    print(format_comparison(result))
    write_json(result, args.json_path)
    if args.json_path:
        print(f"wrote {args.json_path}")
    return 0


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"
