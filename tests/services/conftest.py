"""A real Tandem stack for service tests: the tansu broker, and scheduler, workers and gateways
as separate processes (`python -m services.cli ...`), on a tiny random-weight Llama model.

Each stack uses its own topic prefix, so stacks sharing the session's broker never see each
other's messages. Child logs go to files under the test's tmp dir (printed on failure).

Tests run on busy machines (CI, a laptop doing other things), so nothing here waits a fixed
time: every wait ends on the event it needs (a worker in the scheduler's view, a gateway
answering, a log line) and fails at once if a child died. What each waits for is listed in
docs/services.md, "Testing under load". The `Stack` class and its timing constants live in
tests/services/stack.py; they are re-exported here, where tests have always imported them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest
from aiokafka.errors import KafkaConnectionError

from shared.kafka import KafkaClient
from shared.schemas.base import WireModel
from shared.schemas.telemetry import Heartbeat
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.stack import (  # noqa: F401 (re-exported: tests import them from here)
    HEARTBEAT_INTERVAL_S,
    LEASE_S,
    READY_LINES,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    WORKER_TIMEOUT_S,
    Stack,
)

M = TypeVar("M", bound=WireModel)


@pytest.fixture(scope="module")
def make_stack(kafka_bootstrap, tiny_model_dir, tmp_path_factory, request):
    """Factory for stacks torn down at the end of the module, on the tiny model `model`
    (a `tiny_model_dir` name)."""
    stacks: list[Stack] = []

    def make(model: str = "llama", **env) -> Stack:
        prefix = f"t{len(stacks)}-{request.module.__name__.rsplit('.', 1)[-1].replace('_', '-')}"
        stack = Stack(kafka_bootstrap, tiny_model_dir(model), tmp_path_factory.mktemp(prefix), prefix, **env)
        stacks.append(stack)
        return stack

    yield make
    hung = [problem for s in stacks for problem in s.stop()]
    if hung:
        pytest.fail("a child of the test stack did not stop cleanly:\n" + "\n".join(hung), pytrace=False)
    losses = [line for s in stacks for line in s.spurious_losses()]
    if losses:  # the tests may have passed, but on wrong decisions (re-placed work, a lost worker)
        pytest.fail("the scheduler declared a live worker lost:\n" + "\n".join(losses), pytrace=False)


def chat_body(content: str, max_tokens: int = 16, **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def openai_client(stack: Stack):
    import openai

    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


async def current_term(stack, role: str) -> int:
    """The lease term `role` ("advisory", "scheduler", "queue") holds now, read from the leases
    topic: what a test must stamp on a record it publishes in that service's name, since readers
    drop records of an older term than one they have seen (docs/reliability.md, HA pairs)."""
    from shared.kafka import read_to_end
    from shared.lease import LeaseLog
    from shared.schemas.lease import LeaseRecord

    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-probe")
    consumer = await kafka.consumer(group=None)
    log = LeaseLog(role)
    try:
        await _assign(kafka, consumer, Topics(stack.prefix).leases.name, from_end=False)
        await read_to_end(consumer, lambda m: log.apply(LeaseRecord.decode(m.value), time.monotonic()))
    finally:
        await kafka.stop()
    return log.current.term if log.current is not None else 0


async def _assign(kafka: KafkaClient, consumer, topic: str, *, from_end: bool) -> None:
    """`assign_all`, waiting for the topic to exist: a service creates its topics as it starts,
    and `assign_all` gives up after ~50 s of retries, which a start on a starved host outlasts
    (a lone worker's took longer at load 40). START_TIMEOUT_S is the safety net, as for starts."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            await kafka.assign_all(consumer, topic, from_end=from_end)
            return
        except KafkaConnectionError:
            if time.monotonic() > deadline:
                raise


async def next_message(stack, topic: str, cls: type[M], match: Callable[[M], bool], *, from_end: bool) -> M:
    """The first message of `topic` (decoded as `cls`) that `match`es, read straight from the
    broker, from the topic's end (the next one) or its start (one sent before this reader began)."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-probe")
    consumer = await kafka.consumer(group=None)
    try:
        await _assign(kafka, consumer, topic, from_end=from_end)
        while True:
            msg = cls.decode((await consumer.getone()).value)
            if match(msg):
                return msg
    finally:
        await kafka.stop()


async def worker_heartbeat(stack, worker_id: str, match: Callable[[Heartbeat], bool] = lambda hb: True) -> Heartbeat:
    """The next heartbeat of a worker (that `match`es), read straight from the broker."""
    topic = Topics(stack.prefix).heartbeats.name
    wanted = lambda hb: hb.worker_id == worker_id and match(hb)  # noqa: E731
    return await next_message(stack, topic, Heartbeat, wanted, from_end=True)
