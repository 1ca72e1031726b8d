"""Decode-step breakdown against the memory-bandwidth roofline (issue 19, docs/gpu.md step 4).

A tool for the device machine, not a test (pytest does not collect it):

    python tests/gpu/step_breakdown.py --model qwen3-0.6b --seqs 256 --context 850 --json OUT.json

It fills the engine with `--seqs` requests of `--context` prompt tokens (dummy weights of a
built-in architecture), runs their prefills, then times `--steps` decode-only steps (median
wall time, the device synchronised) and profiles them with `torch.profiler`: device time by
category (attention kernels, GEMMs, everything else) and the host's share (the step's wall
time minus the device's busy time: Python, launches, the runner's tables). The roofline is
the bytes a decode step must read (every weight once, every running sequence's K/V) over
`--bandwidth-gbs` (about 3000 GB/s measured for an H100 copy, KINDS.md). The goal of the
issue is a decode step within 2x of it.

On CPU (`--device cpu`, a dry run with small sizes) the same code runs; categories then come
from the profiler's CPU operators, and the roofline number means nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

# kernel or operator names, lower-cased, by category (first match wins)
CATEGORIES = {
    "attention": ("_decode_split", "_merge_splits", "_extend", "_attend_segments", "_merge_parts", "attention"),
    "gemm": ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::linear"),
}


def category(name: str) -> str:
    lowered = name.lower()
    for cat, needles in CATEGORIES.items():
        if any(n in lowered for n in needles):
            return cat
    return "other"


def build_engine(args):
    from engine import EngineConfig, LLMEngine

    return LLMEngine(
        EngineConfig(
            model=args.model,
            load_format="dummy",
            device=args.device,
            dtype=args.dtype,
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=args.seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            attention=args.attention,
        )
    )


def fill(engine, args) -> None:
    """Admit every request and run steps until each has its first token (all decoding after)."""
    from engine import SamplingParams

    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.warmup + args.steps + 8, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(args.context)], params)
    started: set[str] = set()
    while len(started) < args.seqs:
        for out in engine.step():
            if out.new_token_ids:
                started.add(out.request_id)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_steps(engine, args) -> list[float]:
    """Wall seconds of `--steps` decode steps, after `--warmup` untimed ones (compilation, caches)."""
    for _ in range(args.warmup):
        engine.step()
    times = []
    for _ in range(args.steps):
        synchronize(args.device)
        start = time.perf_counter()
        engine.step()
        synchronize(args.device)
        times.append(time.perf_counter() - start)
    return times


def profiled_step(engine, args) -> dict[str, float]:
    """One more decode step under torch.profiler: seconds per category, device (or CPU ops)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        engine.step()
        synchronize(args.device)
    seconds = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    for event in prof.key_averages():
        if on_cuda:
            us = getattr(event, "self_device_time_total", None)
            if us is None:
                us = event.self_cuda_time_total
        else:
            us = event.self_cpu_time_total if event.key.startswith("aten::") else 0.0
        seconds[category(event.key)] += us / 1e6
    return seconds


def roofline(engine, args) -> dict[str, float]:
    """Bytes a decode step must read and the time they take at `--bandwidth-gbs`."""
    from engine.models import build_model

    cfg = engine.model_config
    # the architecture's parameters, counted on a meta build: the engine's own may be packed
    # into opaque CPU layouts; a tied head is counted once and read once
    shapes = build_model(cfg, 16, engine.config.torch_dtype, "meta")
    weights = sum(p.numel() * p.element_size() for p in shapes.parameters())
    element = torch.empty(0, dtype=engine.config.torch_dtype).element_size()
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element
    context = args.context + 1 + args.warmup + args.steps // 2  # the timed steps' mean context
    kv = kv_per_token * context * args.seqs
    return {
        "weight_bytes": weights,
        "kv_bytes": kv,
        "roofline_s": (weights + kv) / (args.bandwidth_gbs * 1e9),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="a built-in architecture (dummy weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention", default="auto")
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--context", type=int, default=850, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (compilation, allocator)")
    p.add_argument("--kv-cache-gib", type=float, default=40.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--bandwidth-gbs", type=float, default=3000.0, help="memory bandwidth for the roofline")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)

    engine = build_engine(args)
    fill(engine, args)
    times = timed_steps(engine, args)
    step_s = statistics.median(times)
    by_category = profiled_step(engine, args)
    device_s = sum(by_category.values())
    bound = roofline(engine, args)
    result = {
        "model": args.model,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "dtype": args.dtype,
        "attention": engine.runner.decode_kernel,
        "seqs": args.seqs,
        "context": args.context,
        "decode_step_s": {"median": step_s, "min": min(times), "max": max(times)},
        "output_tokens_per_s": args.seqs / step_s,
        "profiled_step_s": by_category,
        "host_s": max(0.0, step_s - device_s),  # Python, launches, host tables (device: busy time only)
        **bound,
        "step_over_roofline": step_s / bound["roofline_s"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
