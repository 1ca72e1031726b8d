"""Same-process A/B of two engine configurations, step by step (issue 15's measurements).

A measurement tool (JSON out, with the provenance stamp every result carries):

    python -m loadgen.bench.cpu_step_ab --dtype float32 --a fused_ops=off --b fused_ops=auto --json OUT.json

Two engines of the same model get the same workload (the bench's: random-token prompts with
lengths U(--input-len), each generating exactly --output-len tokens, greedy, EOS ignored) and
are stepped alternately, the one going first swapped every step, so each pair of steps sees
the same machine. With FCFS and fixed output lengths both engines schedule the same batches,
so step i of A and step i of B have the same shape and their time ratio is a paired sample.
On a shared, loaded machine absolute times are noise; the paired ratios are what this is for.
Reports whole-run time per engine, and the median paired ratio (B / A) for decode-only steps
and for steps with prefill rows, with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = {"true": True, "false": False, "none": None}.get(value.lower(), value)
    return out


def _engine(args, overrides: dict):
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, **overrides))
    engine.add_request("warm", list(range(100, 116)), SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--a", nargs="*", default=["fused_ops=off"], help="EngineConfig overrides of engine A")
    p.add_argument("--b", nargs="*", default=["fused_ops=auto"], help="EngineConfig overrides of engine B")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(50, 300))
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from engine import SamplingParams
    from loadgen.workloads.random_tokens import random_token_prompts

    engines = {"a": _engine(args, _parse_overrides(args.a)), "b": _engine(args, _parse_overrides(args.b))}
    vocab = engines["a"].model_config.vocab_size
    prompts = random_token_prompts(args.num_prompts, tuple(args.input_len), vocab, args.seed, exclude_ids=set())
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    requests = {
        name: [e.add_request(str(i), p_, params) for i, p_ in enumerate(prompts)] for name, e in engines.items()
    }
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {"a": [], "b": []}
    kinds: list[str] = []
    step = 0
    while engines["a"].has_unfinished() or engines["b"].has_unfinished():
        order = ("a", "b") if step % 2 == 0 else ("b", "a")
        step_kinds = []
        for name in order:
            reqs = requests[name]
            before = [r.num_computed_tokens for r in reqs]
            t0 = time.perf_counter()
            engines[name].step()
            times[name].append(time.perf_counter() - t0)
            advanced = [r.num_computed_tokens - b for r, b in zip(reqs, before)]
            step_kinds.append("decode" if max(advanced) <= 1 else "prefill")
        kinds.append(step_kinds[0])
        step += 1
    load_after = os.getloadavg()
    ratios = {"decode": [], "prefill": []}
    for kind, ta, tb in zip(kinds, times["a"], times["b"]):
        ratios[kind].append(tb / ta)
    summary = {
        "dtype": args.dtype,
        "a": args.a,
        "b": args.b,
        "workload": {"num_prompts": args.num_prompts, "input_len": list(args.input_len), "output_len": args.output_len},
        "steps": len(kinds),
        "same_schedule": len(times["a"]) == len(times["b"]),
        "whole_run_s": {"a": sum(times["a"]), "b": sum(times["b"])},
        "whole_run_ratio_b_over_a": sum(times["b"]) / sum(times["a"]),
        "median_paired_ratio_b_over_a": {k: statistics.median(v) for k, v in ratios.items() if v},
        "steps_by_kind": {k: len(v) for k, v in ratios.items()},
        "median_step_s": {
            name: {k: statistics.median([t for t, kk in zip(ts, kinds) if kk == k]) for k in ratios if ratios[k]}
            for name, ts in times.items()
        },
        "layer_ops": {name: e.model.ops.name for name, e in engines.items()},
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
    from loadgen.bench.common import write_json
    from loadgen.provenance import decided_dtype, stamp

    summary["provenance"] = stamp(dtype=decided_dtype(args.dtype)).as_dict()
    write_json(summary, args.json)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
