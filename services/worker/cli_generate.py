"""`tandem generate`: one prompt through the offline engine, printed as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time

from shared.engine_options import add_cache_form_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion for one prompt",
        description="Generate a completion for one prompt with the offline engine.",
    )
    p.add_argument("--model", default="default", help="model name or path (default: bundled SmolLM2-135M-Instruct)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument(
        "--prompt-ids", help="the prompt as comma-separated token ids (for a model without a tokenizer)"
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto (default): bfloat16 where the CPU has native bf16, else float32",
    )
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument(
        "--load-format",
        default=None,
        choices=["auto", "dummy"],
        help="dummy: random weights in the model's architecture (or a built-in one: qwen3-0.6b, llama-3-8b, opt-13b)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (default: engine default)")
    add_cache_form_options(p)
    p.set_defaults(kv_heads_expand=False)  # its JSON config reports false, not null, when not given
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import LLM, EngineConfig, SamplingParams

    cfg = {"model": args.model, "dtype": args.dtype}
    if args.kv_cache_gib is not None:
        cfg["kv_cache_gib"] = args.kv_cache_gib
    if args.device is not None:
        cfg["device"] = args.device
    if args.load_format is not None:
        cfg["load_format"] = args.load_format
    if args.kv_heads_expand:
        cfg["kv_heads_expand"] = True
    if args.cache_form is not None:
        cfg["cache_form"] = args.cache_form
    if args.uncached_ratio is not None:
        cfg["uncached_ratio"] = args.uncached_ratio
    if args.uncached_source is not None:
        cfg["uncached_source"] = args.uncached_source
    prompt = args.prompt if args.prompt is not None else _token_ids(args.prompt_ids)
    t0 = time.perf_counter()
    llm = LLM(EngineConfig(**cfg))
    load_s = time.perf_counter() - t0

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=False,
    )
    t1 = time.perf_counter()
    out = llm.generate([prompt], params, chat=args.chat, progress=False)[0]
    gen_s = time.perf_counter() - t1

    if not args.json:
        sys.stdout.write(out.text)
        if not out.text.endswith("\n"):
            sys.stdout.write("\n")
        return 0

    m = out.metrics
    n = len(out.token_ids)
    ttft = (m.first_token_time - m.arrival_time) if m is not None and m.first_token_time else None
    total = (m.finish_time - m.arrival_time) if m is not None and m.finish_time else gen_s
    decode_s = (m.finish_time - m.first_token_time) if ttft is not None and m.finish_time else None
    res = {
        "text": out.text,
        "token_ids": list(out.token_ids),
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": n,
        "timing": {
            "load_s": load_s,
            "generate_s": gen_s,
            "ttft_s": ttft,
            "e2e_s": total,
            "decode_tokens_per_s": (n - 1) / decode_s if decode_s and n > 1 else None,
        },
        "config": {
            k: getattr(args, k)
            for k in (
                "model",
                "load_format",
                "kv_heads_expand",
                "cache_form",
                "dtype",
                "max_tokens",
                "temperature",
                "top_p",
                "top_k",
                "seed",
                "chat",
            )
        },
    }
    print(json.dumps(res, ensure_ascii=False))
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-ids takes comma-separated integers, not {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids
