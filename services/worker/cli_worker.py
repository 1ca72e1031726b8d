"""`tandem worker`: one engine process serving its Kafka dispatch topic."""

from __future__ import annotations

import argparse

from shared.engine_options import add_aptserve_options, add_cache_form_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="run a worker (engine + Kafka)",
        description="Run one worker: an engine fed by its dispatch topic. Flags override TANDEM_* "
        "environment variables.",
    )
    p.add_argument("--model", help="model name or path (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="model id clients use (default: 'default' or the path's name)")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        help="dummy: random weights in the model's architecture (or a built-in one: qwen3-0.6b, llama-3-8b, opt-13b)",
    )
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-gib", type=float)
    p.add_argument("--policy", help="scheduling policy (fcfs, ...)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--attention",
        choices=["auto", "cpp", "fused", "triton", "reference"],
        help="attention kernel (default auto: triton on CUDA, the C++ kernel on CPU; EngineConfig.attention)",
    )
    p.add_argument(
        "--no-compile-layers",
        dest="compile_layers",
        action="store_false",
        default=None,
        help="run decode-only steps op by op instead of through compiled decoder layers",
    )
    add_cache_form_options(p)
    add_aptserve_options(p)
    p.add_argument("--worker-id", help="stable id (default: host-pid-random)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.runtime import run_service
    from services.worker.service import WorkerService

    settings = settings_from_args(args)
    return run_service("worker", settings, WorkerService(settings))


def settings_from_args(args: argparse.Namespace):
    """The worker's settings: `TANDEM_*` variables, overridden by the flags that were given."""
    from services.worker.settings import WorkerSettings

    overrides = {k: v for k, v in vars(args).items() if k in WorkerSettings.model_fields and v is not None}
    return WorkerSettings(**overrides)
