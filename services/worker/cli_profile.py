"""`tandem profile`: fit the BROS cost model for a model on this device (cached), print it."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="profile step times and fit the BROS cost model",
        description="Time dummy prefill/decode batches and host copies on a power-of-two grid, fit "
        "α0·Ln + α1·Σn·a + β per phase plus swap bandwidth, cache the profile by "
        "model+device+dtype and print it (JSON) with its fit errors.",
    )
    p.add_argument("--model", default="default", help="model name or path (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument(
        "--kv-heads-expand",
        action="store_true",
        help="profile the model with each KV head repeated for its query heads (MHA memory shape)",
    )
    p.add_argument("--force", action="store_true", help="re-profile even when a cached profile exists")
    p.add_argument("--out", default=None, help="also write the profile to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import EngineConfig, LLMEngine
    from engine.loader import resolve_model
    from engine.profiling import profile, profile_cached, profile_path

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_heads_expand=args.kv_heads_expand,
    )
    target = LLMEngine(config).profile_target()  # fcfs: the engine itself does not profile
    source = resolve_model(args.model)
    if args.force:
        model = profile(target)
        model.save(profile_path(target, source))
    else:
        model = profile_cached(target, source)
    if args.out:
        model.save(args.out)
    print(json.dumps(model.to_dict(), indent=2, sort_keys=True))
    return 0
