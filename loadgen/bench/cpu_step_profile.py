"""`tandem bench profile`: where a CPU engine step goes, by category (issue 15's step profile).

    tandem bench profile --json OUT.json --markdown OUT.md      # the README workload's steps
    python -m loadgen.bench.cpu_step_profile ...                  # the same tool

Two measurements on the default model (or `--model`), each step timed without the profiler
(median wall time of `--steps`) and then once more under `torch.profiler`:
- *prefill*: a step of prompts U(50, 300) filling the token budget (`--prefill-len`, 1,024,
  the engine's default budget), as the README workload's first steps see it (the default
  `--prefill-shape workload`), or one prompt of that length (`one`);
- *decode*: `--seqs` requests with prompts U(50, 300) (the workload's), prefilled, then
  `--steps` decode-only steps (through the compiled layer graph where the engine uses one).
Per step: the wall time and the profiler's self time by category: GEMMs, attention,
norms/RoPE/activation/residual (fused C++ ops or op by op), the KV write, sampling,
index/copy ops, the compiled layer graph's own loops (Inductor's fused code, which the
profiler sees as the compiled region's self time), the graph's guard checks (Dynamo's cache
lookup), other ops, and *Python/dispatch*: the profiled wall time minus all op time
(scheduling, the runner's tables, the sampler's Python, op dispatch outside kernels), what no
kernel speeds up. The profiler's own cost inflates that remainder a little; the unprofiled
median bounds it. The JSON carries the provenance stamp; the markdown is the table the README
quotes, with the host, commit and load average under it. About 1-2 minutes on a quiet 2-core
host with warm caches; one dtype per run (`--dtype float32` for the other).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

# operator names (lower-cased substrings) by category, first match wins; exact aten names for
# the generic ones ("to" as a substring would catch "Torch-Compiled Region")
CATEGORIES = (
    # Dynamo's guard check and the wrappers around a compiled graph's call
    ("graph guards", ("torchdynamo cache lookup", "pregraph bytecode", "aotdispatcher")),
    # Inductor's own code: the profiler sees it as the self time of the graph's call event
    ("compiled graph loops", ("call compiledfxgraph", "torch-compiled region", "compiledfunction")),
    ("attention", ("::decode", "scaled_dot_product", "flash_attention", "_prefill")),
    ("gemm", ("packed_linear", "linear", "addmm", "aten::mm", "matmul", "mkldnn", "bmm")),
    ("kv write", ("write_kv", "index_copy")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "aten::max")),
    (
        "norms/rope/act",
        (
            "add_rms_norm",
            "qk_norm_rope",
            "silu_mul",
            "aten::mul",
            "aten::add",
            "aten::pow",
            "aten::mean",
            "aten::rsqrt",
            "aten::neg",
            "aten::silu",
            "aten::sum",
            "aten::cat",
        ),
    ),  # fmt: skip
    (
        "index/copy",
        (
            "aten::index",
            "aten::copy",
            "aten::_to_copy",
            "aten::to",
            "aten::gather",
            "aten::select",
            "aten::slice",
            "aten::view",
            "aten::reshape",
            "aten::empty",
            "aten::where",
            "aten::contiguous",
            "aten::clone",
            "aten::stack",
            "aten::zeros",
            "aten::fill",
            "aten::expand",
            "aten::as_strided",
            "aten::split",
        ),
    ),  # fmt: skip
)
COLUMNS = (
    "gemm",
    "attention",
    "norms/rope/act",
    "kv write",
    "sampling",
    "index/copy",
    "compiled graph loops",
    "graph guards",
    "other",
)


def category(name: str) -> str:
    lowered = name.lower()
    for cat, needles in CATEGORIES:
        if any(n in lowered for n in needles):
            return cat
    return "other"


def _engine(args, budget: int):
    from engine import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            fused_ops=args.fused_ops,
            prefill_attention=args.prefill_attention,
            max_num_seqs=max(args.seqs, 1),
            max_num_batched_tokens=budget,
            kv_cache_gib=args.kv_cache_gib,
        )
    )


def _profile_step(engine) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
    by_cat: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        by_cat[category(evt.key)] += evt.self_cpu_time_total / 1e6
        by_op[evt.key] += evt.self_cpu_time_total / 1e6
    op_s = sum(by_cat.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:15]
    return {
        "profiled_wall_s": wall,
        "op_s": op_s,
        "outside_ops_s": wall - op_s,
        "by_category_s": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top_ops_s": dict(top),
        "ops_s": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),  # every op, to re-file later
    }


def prefill(args) -> dict:
    from engine import SamplingParams

    engine = _engine(args, budget=max(1024, args.prefill_len))
    rng = random.Random(0)
    walls = []
    for i in range(args.steps + 1):  # the last one under the profiler
        for j, n in enumerate(_prompt_lens(args, rng)):
            prompt = [rng.randrange(1000, 20000) for _ in range(n)]
            engine.add_request(f"p{i}.{j}", prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        if i == args.steps:
            result = _profile_step(engine)
        else:
            t0 = time.perf_counter()
            engine.step()
            if i:  # the first step pays first-call costs
                walls.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
    return {"rows": args.prefill_len, "wall_s_median": statistics.median(walls) if walls else None, **result}


def _prompt_lens(args, rng: random.Random) -> list[int]:
    """One `--prefill-len` prompt, or with `--prefill-shape workload` prompts U(50, 300) (the
    bench's) until `--prefill-len` tokens, the last one cut: a prefill step as the README
    workload's first steps see it (attention over several short prompts, not one long one)."""
    if args.prefill_shape == "one":
        return [args.prefill_len]
    lens, total = [], 0
    while total < args.prefill_len:
        lens.append(min(rng.randint(50, 300), args.prefill_len - total))
        total += lens[-1]
    return lens


def decode(args) -> dict:
    from engine import SamplingParams

    engine = _engine(args, budget=1024)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0)
    for i in range(args.seqs):
        engine.add_request(f"d{i}", [rng.randrange(1000, 20000) for _ in range(rng.randint(50, 300))], params)
    sched = engine.scheduler
    while sched.waiting or not all(r.is_prefill_done for r in sched.running):
        engine.step()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    return {"seqs": args.seqs, "wall_s_median": statistics.median(walls), **_profile_step(engine)}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="auto: as the engine decides it"
    )
    p.add_argument("--fused-ops", default="auto", choices=["auto", "cpp", "off"])
    p.add_argument("--prefill-attention", default="auto", choices=["auto", "sdpa"])
    p.add_argument("--prefill-len", type=int, default=1024, help="prefill tokens in the step (the default budget)")
    p.add_argument(
        "--prefill-shape", default="workload", choices=["one", "workload"], help="prompts U(50, 300), or one prompt"
    )
    p.add_argument("--seqs", type=int, default=64, help="decode rows (the README workload's 64)")
    p.add_argument("--steps", type=int, default=3, help="unprofiled steps timed per kind")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE")
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the table as markdown")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="where a CPU engine step goes (prefill and decode, by category)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_args(p)
    p.set_defaults(func=run)


def profile(args: argparse.Namespace) -> dict:
    """Both measurements and the stamp (the JSON `tandem bench profile` writes)."""
    import torch  # here, not at the top: `tandem --help` (every service's start) builds this parser

    from loadgen.provenance import decided_dtype, stamp

    torch.manual_seed(0)
    load_before = [round(x, 2) for x in os.getloadavg()]
    dtype = decided_dtype(args.dtype)
    args = argparse.Namespace(**{**vars(args), "dtype": dtype})
    out = {
        "model": args.model,
        "dtype": dtype,
        "fused_ops": args.fused_ops,
        "prefill_attention": args.prefill_attention,
        "prefill_shape": args.prefill_shape,
        "prefill": prefill(args),
        "decode": decode(args),
    }
    out["load_average_before"] = load_before  # the stamp's is taken at the end
    out["provenance"] = stamp(dtype=dtype).as_dict()
    return out


def markdown(out: dict) -> str:
    """The step profile as a markdown table: each category's share of the profiled step's wall
    time, and the host, commit and load it was measured with."""
    header = "| step | wall (median) | " + " | ".join(COLUMNS) + " | Python/dispatch |"
    rows = [header, "|" + "---|" * (len(COLUMNS) + 3)]
    for kind, label in (("prefill", f"prefill, {out['prefill']['rows']} tokens"), ("decode", "decode")):
        step = out[kind]
        if kind == "decode":
            label = f"decode, {step['seqs']} rows"
        wall = step["profiled_wall_s"]
        cats = step["by_category_s"]
        cells = [f"{100 * cats.get(c, 0.0) / wall:.1f}%" for c in COLUMNS]
        cells.append(f"{100 * step['outside_ops_s'] / wall:.1f}%")
        median = "n/a" if step["wall_s_median"] is None else f"{1000 * step['wall_s_median']:.1f} ms"
        rows.append(f"| {label} | {median} | " + " | ".join(cells) + " |")
    prov = out["provenance"]
    git, host = prov.get("git", {}), prov.get("host", {})
    cpu = host.get("cpu", {})
    load = f"{out.get('load_average_before')} before, {prov.get('load_average')} after"
    rows += [
        "",
        f"{out['dtype']}, model {out['model']}; shares of the profiled step's wall time "
        f"(Python/dispatch: wall minus op time). Commit `{str(git.get('commit'))[:7]}`"
        f"{' (dirty tree)' if git.get('dirty') else ''}; CPU {cpu.get('model')} ({cpu.get('isa')}), "
        f"{host.get('logical_cpus')} logical CPUs, {prov.get('threads', {}).get('torch_num_threads')} torch "
        f"threads; load average {load}.",
    ]
    return "\n".join(rows) + "\n"


def run(args: argparse.Namespace) -> int:
    from loadgen.bench.common import write_json

    out = profile(args)
    write_json(out, args.json_path)
    table = markdown(out)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(table)
    print(table)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p)
    raise SystemExit(run(p.parse_args()))


if __name__ == "__main__":
    main()
