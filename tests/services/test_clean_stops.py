"""Every service stops cleanly on SIGTERM, again and again, while requests run through the stack.

A scheduler once did not stop within 40 s of SIGTERM at a test module's teardown (its log ended
at "scheduler stopping"), once in a full suite run: a hang at stop that one stop per module
seldom shows. Here the scheduler, advisory, queue and gateway are each stopped and started
again `ROUNDS` times while a client keeps chat requests in flight, alone and (the services that
hold leases) together, and every stop must end in a clean exit within the stack's stop limit
(`Stack.stop_together`; a hung service dumps its asyncio
tasks into its log 30 s into the stop, services/runtime.py, which the failure shows). The
worker's stop (drain, engine close) is the module teardown's, checked the same way.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.services.conftest import Stack, chat_body

pytestmark = pytest.mark.timeout(900)

ROUNDS = 4
# Stopped together as a stack's teardown does: each one's lease release rings the others' lease
# consumers as they stop (the ring that hung a scheduler's stop: shared/aio.py).
LEASED = ("scheduler", "advisory", "queue")


class Traffic:
    """Chat requests back to back through whichever gateway the stack has now, until stopped;
    failures are expected while a service restarts (nothing is asserted on them here)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.done = threading.Event()
        self.served = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                r = httpx.post(f"{self.stack.url}/v1/chat/completions", json=chat_body("Hi there", 8), timeout=30)
                self.served += r.status_code == 200
            except httpx.HTTPError:
                pass  # the gateway itself is restarting

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def stack(make_stack):
    s = make_stack()
    s.advisory()
    return s.start(("w0",), queue=True)


def _ready_lines(stack: Stack, name: str) -> int:
    return (stack.log_dir / f"{name}.log").read_text(errors="replace").count(f"{stack.roles[name]} ready")


def _restart(stack: Stack, name: str) -> None:
    """Start `name` again (its log is appended to) and wait until it says it is ready."""
    if name == "gateway":  # uvicorn's, not services.runtime's: ready once it serves on every worker
        stack.gateway(name)
        stack.wait_workers()
        return
    before = _ready_lines(stack, name)
    {"scheduler": stack.scheduler, "advisory": stack.advisory, "queue": stack.queue}[name](name)
    stack.wait_until(f"{name} ready again", lambda: _ready_lines(stack, name) > before)
    if name == "scheduler":
        stack.wait_workers()  # places on every worker again


@pytest.mark.parametrize("names", [("scheduler",), ("advisory",), ("queue",), ("gateway",), LEASED])
def test_services_stop_cleanly_every_time_under_traffic(stack, names):
    with Traffic(stack):
        for _ in range(ROUNDS):
            problems = stack.stop_together(*names)
            assert not problems, "\n".join(problems)
            for name in names:
                _restart(stack, name)
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body("Hello again", 8), timeout=120)
    assert r.status_code == 200, r.text  # and the stack still serves
