"""`tandem drain WORKER`: take a worker out of placement before stopping or upgrading it.

Sends `Drain(worker_id)` on the control topic. The worker marks itself draining in its next
heartbeat (sent at once), the scheduler stops placing on it (RT, BE and session turns alike:
sessions whose KV lives there are re-placed like after a loss, by recompute or a peer pull),
and what it already holds runs to the end. With `--wait` the command returns once the worker
reports draining and holds no request (its heartbeat's `running_ids`), so a script can stop it
next without cutting a stream. There is no undrain: a drained worker rejoins by restarting
(a new process is a new epoch), which is what an operator does after maintenance anyway.

Exit status: 0 sent (and, with `--wait`, drained); 1 the broker did not answer or `--wait`
timed out (the message says which and what the worker still holds); 2 bad arguments.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drain",
        help="stop placing work on a worker; optionally wait until it holds none",
        description="Send Drain for WORKER on the control topic (KAFKA_BOOTSTRAP, TANDEM_TOPIC_PREFIX).",
    )
    p.add_argument("worker_id", metavar="WORKER", help="the worker id (`tandem status` lists them)")
    p.add_argument("--wait", action="store_true", help="return once the worker is draining and holds no request")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits (default 300)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    if args.timeout <= 0:
        raise ValueError("--timeout must be > 0")
    if not args.worker_id.strip():
        raise ValueError("WORKER must not be empty")
    return asyncio.run(_run(args.worker_id, args.wait, args.timeout))


async def _run(worker_id: str, wait: bool, timeout_s: float) -> int:
    import asyncio
    import time

    from services.status import collect
    from shared.kafka import KafkaClient
    from shared.schemas.control import ControlEnvelope, Drain
    from shared.settings import ServiceSettings
    from shared.topics import Topics

    settings = ServiceSettings()
    kafka = KafkaClient(settings, f"tandem-drain-{worker_id}")
    try:
        async with asyncio.timeout(10.0):
            await kafka.start()
        control = Topics(settings.topic_prefix).control.name
        await kafka.send(control, ControlEnvelope(message=Drain(worker_id=worker_id)), key=worker_id)
    except Exception as exc:  # noqa: BLE001 - any broker failure is "not sent", said plainly
        print(f"tandem drain: could not reach the broker at {settings.kafka_bootstrap}: {exc}")
        return 1
    finally:
        await kafka.stop()
    print(f"drain sent to {worker_id}")
    if not wait:
        return 0
    deadline = time.monotonic() + timeout_s
    held: int | None = None
    while time.monotonic() < deadline:
        status = await collect(settings, timeout_s=min(5.0, max(0.5, deadline - time.monotonic())))
        row = next((w for w in status.workers if w.worker_id == worker_id), None)
        if row is not None and row.state == "draining":
            held = row.held
            if held == 0:
                print(f"{worker_id} is drained: placed nothing new, holds no request")
                return 0
        await asyncio.sleep(0.5)
    what = "never reported draining" if held is None else f"still holds {held} request(s)"
    print(f"tandem drain: {worker_id} {what} after {timeout_s:.0f} s")
    return 1
