"""`tandem gateway`: the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gateway",
        help="run the HTTP gateway (OpenAI-compatible API)",
        description="Run the gateway. Flags override TANDEM_* environment variables.",
    )
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--gateway-id")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings
    from shared.logs import configure_logging

    overrides = {k: v for k, v in vars(args).items() if k in GatewaySettings.model_fields and v is not None}
    settings = GatewaySettings(**overrides)
    configure_logging("gateway", settings.log_level, settings.log_json)
    from services import lifeline

    lifeline.adopt_parent()  # started by `up`: its death arrives as SIGTERM (uvicorn's graceful stop)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()
    return 0
