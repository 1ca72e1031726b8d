"""`tandem bench engine`: offline throughput of our engine on a random-token workload.

Workload (identical to the vLLM and transformers baselines): ``--num-prompts`` prompts of random
token ids with lengths uniform in ``--input-len LO HI``, each generating exactly ``--output-len``
tokens (greedy, EOS ignored), all submitted at once. Model loading and first-call costs are
excluded by a tiny warm-up generate before the timed call.

``--output-len-range LO HI`` draws each request's output length uniformly instead (nano-vllm's
benchmark: 256 sequences, input and output U(100, 1024)); ``--load-format dummy`` runs a
built-in architecture (qwen3-0.6b, llama-3-8b, opt-13b) on random weights, without a tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

from loadgen.bench.common import TreeRssSampler, add_workload_args, format_table, summarize, write_json
from loadgen.bench.timeline import timed_run
from loadgen.workloads.random_tokens import random_token_prompts, special_token_ids, warmup_prompt
from shared.engine_options import add_cache_form_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engine",
        help="offline throughput of the Tandem engine",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_engine_args(p)
    p.set_defaults(func=run)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "dummy"],
        help="dummy: random weights in the model's architecture (or a built-in one: qwen3-0.6b, llama-3-8b, opt-13b)",
    )
    p.add_argument(
        "--output-len-range",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="per-request output lengths uniform in [LO, HI] (overrides --output-len)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: engine default")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: engine default")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="default: engine default")
    p.add_argument("--block-size", type=int, default=None, help="KV block size in tokens; default: engine default")
    p.add_argument(
        "--attention",
        default=None,
        choices=["auto", "cpp", "fused", "triton", "reference"],
        help="attention kernel; default: engine default (auto: triton on CUDA)",
    )
    p.add_argument(
        "--no-compile-layers",
        dest="compile_layers",
        action="store_false",
        default=None,
        help="run decode-only steps op by op instead of through compiled layers",
    )
    p.add_argument(
        "--fused-ops",
        default=None,
        choices=["auto", "cpp", "off"],
        help="the layers' fused C++ elementwise kernels (off: PyTorch op by op, for A/B runs); default: auto",
    )
    p.add_argument(
        "--prefill-attention",
        default=None,
        choices=["auto", "sdpa"],
        help="prefill rows through the C++ paged kernel with the decode rows (auto) or one SDPA call per "
        "prompt (sdpa, for A/B runs); default: auto",
    )
    add_cache_form_options(p)
    p.add_argument(
        "--dump-prompts",
        default=None,
        metavar="FILE",
        help="write the prompts (JSON list of token-id lists) so another system can run the same ones",
    )
    p.add_argument("--quiet", action="store_true", help="no table on stdout (JSON file only)")


def run(args: argparse.Namespace) -> int:
    res = bench_engine(args)
    write_json(res, args.json_path)
    if not args.quiet:
        print(format_table(res))
        b = res["timeline"]["ttft_breakdown"]
        if b:
            m = b["median_request"]
            print(
                f"median TTFT: queued {m['queue_s']:.3f} s + own prefill {m['prefill_s']:.3f} s; "
                f"{b['steps_before_first_token']} steps before it (first {b['first_step_s']:.3f} s), "
                f"{b['decode_rows_before_first_token']} decode rows among them"
            )
        if args.json_path:
            print(f"wrote {args.json_path}")
    return 0


def bench_engine(args: argparse.Namespace) -> dict:
    import torch

    from engine import LLM, EngineConfig, SamplingParams

    cfg: dict = {"model": args.model, "dtype": args.dtype, "seed": args.seed}
    for name in (
        "device",
        "load_format",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_gib",
        "block_size",
        "attention",
        "compile_layers",
        "fused_ops",
        "prefill_attention",
        "kv_heads_expand",
        "cache_form",
        "uncached_ratio",
        "uncached_source",
    ):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    t0 = time.perf_counter()
    llm = LLM(EngineConfig(**cfg))
    load_s = time.perf_counter() - t0

    mc = llm.model_config
    prompts = random_token_prompts(
        args.num_prompts,
        tuple(args.input_len),
        mc.vocab_size,
        args.seed,
        exclude_ids=special_token_ids(llm.tokenizer, extra=[mc.bos_token_id, *mc.eos_token_ids]),
    )
    if args.dump_prompts:
        Path(args.dump_prompts).parent.mkdir(parents=True, exist_ok=True)
        Path(args.dump_prompts).write_text(json.dumps(prompts))

    # Warm-up: one tiny request, so lazy initialisation and first-call costs are not timed, on a
    # prompt outside the workload that seeds no prefix-cache entry it could hit (warmup_prompt).
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([warmup_prompt(prompts)], warm, progress=False)

    output_lens = _output_lens(args, len(prompts))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    with TreeRssSampler() as rss:
        run = timed_run(llm.engine, prompts, params)  # what LLM.generate does, step by step
    elapsed = run.elapsed_s

    out_tokens = sum(r.output_tokens for r in run.requests)
    in_tokens = sum(len(p) for p in prompts)
    ttfts = [r.first_token_s - r.arrival_s for r in run.requests if r.first_token_s is not None]
    if out_tokens != sum(output_lens):
        print(f"warning: expected {sum(output_lens)} output tokens, got {out_tokens}", file=sys.stderr)

    engine_cfg = llm.engine.config  # resolved: dtype "auto" decided
    stats = llm.engine.stats
    config = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": list(args.input_len),
        "output_len": args.output_len if args.output_len_range is None else list(args.output_len_range),
        "dtype": engine_cfg.dtype,
        "seed": args.seed,
        "engine_args": cfg,
        "engine_config": _asdict(engine_cfg),
        "layer_ops": llm.engine.model.ops.name,  # what fused_ops resolved to: cpp or torch
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }
    return summarize(
        system="tandem",
        num_requests=len(run.requests),
        input_tokens=in_tokens,
        output_tokens=out_tokens,
        elapsed_s=elapsed,
        ttfts_s=ttfts,
        peak_rss_bytes=rss.peak_bytes,
        config=config,
        extra={
            "load_s": load_s,
            "num_preemptions": stats.preemptions,
            "num_cached_prompt_tokens": stats.prompt_tokens_cached,
            "process_peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
            "timeline": run.as_dict(),  # per step and per request: where first tokens wait
        },
    )


def _output_lens(args: argparse.Namespace, n: int) -> list[int]:
    """Each request's output length: --output-len, or uniform in --output-len-range (seeded)."""
    if args.output_len_range is None:
        return [args.output_len] * n
    lo, hi = args.output_len_range
    if not 1 <= lo <= hi:
        raise ValueError(f"--output-len-range must satisfy 1 <= LO <= HI, got {lo} {hi}")
    rng = random.Random(args.seed + 1)  # not the prompts' stream: changing the range keeps the prompts
    return [rng.randint(lo, hi) for _ in range(n)]


def _asdict(obj) -> dict | None:
    import dataclasses

    if obj is None or not dataclasses.is_dataclass(obj):
        return None
    return {
        k: (v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else str(v))
        for k, v in dataclasses.asdict(obj).items()
    }
