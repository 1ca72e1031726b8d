"""`tandem scheduler`: places requests on workers."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scheduler",
        help="run the scheduler (placement over Kafka)",
        description="Run the scheduler. Settings come from TANDEM_* environment variables.",
    )
    p.add_argument("--placement", help="placement policy (default: least-loaded)")
    p.add_argument("--session-routing", help="where session turns go: advisory (default), sticky, none")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.runtime import run_service
    from services.scheduler.service import SchedulerService
    from services.scheduler.settings import SchedulerSettings

    overrides = {k: v for k, v in vars(args).items() if k in SchedulerSettings.model_fields and v is not None}
    settings = SchedulerSettings(**overrides)
    return run_service("scheduler", settings, SchedulerService(settings))
