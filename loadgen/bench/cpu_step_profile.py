"""Where a CPU engine step goes: ops by category, and the Python around them (issue 15).

A measurement tool (JSON out, with the provenance stamp every result carries):

    python -m loadgen.bench.cpu_step_profile --dtype float32 --fused-ops auto --json OUT.json

Two measurements on the default model (or `--model`), each step timed without the profiler
(median wall time) and then once more under `torch.profiler`:
- *prefill*: one step of one `--prefill-len`-token prompt (the token budget is raised to fit),
  or of prompts U(50, 300) filling it (`--prefill-shape workload`);
- *decode*: `--seqs` requests with prompts U(50, 300) (the bench workload's), prefilled, then
  `--steps` decode-only steps.
Per step: the wall time, the profiler's op time (the sum of every operator's self time on the
calling thread; work on OpenMP threads is inside its op), op time by category, and the
remainder, wall minus op time under the profiler: Python, scheduling, the runner's tables and
the sampler's Python, i.e. what no kernel speeds up. The profiler's own cost inflates that
remainder a little; the unprofiled wall time bounds it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict

import torch

# operator names (lower-cased substrings) by category, first match wins
CATEGORIES = (
    ("attention", ("::decode", "scaled_dot_product", "flash_attention", "_prefill")),
    ("gemm", ("packed_linear", "linear", "addmm", "aten::mm", "matmul", "mkldnn", "bmm")),
    ("fused elementwise", ("add_rms_norm", "qk_norm_rope", "silu_mul")),
    ("kv write", ("write_kv", "index_copy")),
    ("norm/rope/act/residual (op by op)", ("mul", "add", "pow", "mean", "rsqrt", "cat", "neg", "silu", "sum")),
    ("index/copy", ("index", "copy", "cat", "gather", "select", "slice", "view", "reshape", "to", "empty", "where")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "max")),
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--fused-ops", default="auto", choices=["auto", "cpp", "off"])
    p.add_argument("--prefill-attention", default="auto", choices=["auto", "sdpa"])
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument(
        "--prefill-shape", default="one", choices=["one", "workload"], help="one prompt, or prompts U(50, 300)"
    )
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    out = {
        "dtype": args.dtype,
        "fused_ops": args.fused_ops,
        "prefill_attention": args.prefill_attention,
        "prefill_shape": args.prefill_shape,
        "prefill": prefill(args),
        "decode": decode(args),
    }
    from loadgen.bench.common import write_json
    from loadgen.provenance import decided_dtype, stamp

    out["provenance"] = stamp(dtype=decided_dtype(args.dtype)).as_dict()
    write_json(out, args.json)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
