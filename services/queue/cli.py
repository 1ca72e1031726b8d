"""`tandem queue`: the BE queue service (batch jobs)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "queue",
        help="run the BE queue service (batch jobs)",
        description="Run the queue service. Settings come from TANDEM_* environment variables; "
        "it must share TANDEM_DATABASE_URL (or TANDEM_DATA_DIR) with the gateway.",
    )
    p.add_argument("--queue-id")
    p.add_argument("--database-url")
    p.add_argument("--data-dir")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.queue.service import QueueService
    from services.queue.settings import QueueSettings
    from services.runtime import run_service

    overrides = {k: v for k, v in vars(args).items() if k in QueueSettings.model_fields and v is not None}
    settings = QueueSettings(**overrides)
    return run_service("queue", settings, QueueService(settings))
