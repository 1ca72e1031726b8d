"""`tandem advisory`: typing hints → session placements and KV prefetches."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "advisory",
        help="run the advisory service (typing hints -> session placement, KV prefetch)",
        description="Run the advisory service. Settings come from TANDEM_* environment variables.",
    )
    p.add_argument("--target-policy", help="how a hint's target worker is chosen (least-loaded, holder)")
    p.add_argument("--placement-ttl-s", type=float, help="seconds a placement lasts past the expected arrival")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.advisory.service import AdvisoryService
    from services.advisory.settings import AdvisorySettings
    from services.runtime import run_service

    overrides = {k: v for k, v in vars(args).items() if k in AdvisorySettings.model_fields and v is not None}
    settings = AdvisorySettings(**overrides)
    return run_service("advisory", settings, AdvisoryService(settings))
