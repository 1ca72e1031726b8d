"""How a consumer fetches on the configured broker: the consumer class and its fetch options.

One decision, made in one place for every consumer a `KafkaClient` opens (`shared/kafka.py`):

- **Apache Kafka** (`TANDEM_KAFKA_LONG_POLL=true`): the broker holds a fetch until data arrives, so
  every consumer is a plain `AIOKafkaConsumer` that long-polls (`kafka_long_poll_wait_ms`); that
  costs no latency there.
- **tansu** (the embedded broker answers a fetch at its deadline only): a `QuietConsumer` that
  fetches with short waits while records flow, stops fetching when idle and wakes on the
  doorbell (`shared/quiet_consumer.py`, docs/services.md "Fetch waits"). A `hot` reader (the
  request and token path) fetches with `kafka_fetch_wait_ms`, others with 100 ms.

A reader sleeps as soon as it has read what it was rung for (`settle_early`), on the token path
too since the ninth session (`kafka_hot_settle`, on by default; off, a hot reader stays awake for
its window, so the next token finds a fetch in flight). Why (issue 21, eighth session):
tansu answers a fetch with what it read when the fetch began, so a token that lands during an
awake reader's fetch waits out that fetch's wait and then one more fetch, while a sleeping
reader's ring sends a fetch that finds the token already there and answers at once. Idle, both
cost nothing; while streaming, the sleeper sends one fetch per token instead of one per wait.
Measured (docs/services.md, ninth session): the same send → read p50, 10-29% less CPU in the
reader's process and the broker; and the worker's dispatch reader no longer answers fetches on
its event loop while the engine computes a new request's first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer

from shared.quiet_consumer import QuietConsumer
from shared.settings import ServiceSettings

# The fetch wait of a reader off the request/token path on tansu: nothing there needs
# milliseconds, and a longer wait costs fewer answers while awake.
COLD_FETCH_WAIT_MS = 100


@dataclass(frozen=True)
class FetchPolicy:
    """The consumer class to build and the keyword options that set how it fetches."""

    consumer_class: type[AIOKafkaConsumer]
    options: dict[str, Any]


def fetch_policy(settings: ServiceSettings, *, hot: bool, idle_poll_s: float | None = None) -> FetchPolicy:
    """How a consumer of this service fetches. `hot`: on the request/token path. `idle_poll_s`:
    the longest a sleeping reader may go without looking by itself (at most `kafka_idle_poll_ms`;
    a lease reader asks for less)."""
    s = settings
    if s.kafka_long_poll:
        return FetchPolicy(AIOKafkaConsumer, {"fetch_max_wait_ms": s.kafka_long_poll_wait_ms})
    wait_ms = s.kafka_fetch_wait_ms if hot else COLD_FETCH_WAIT_MS
    # Two fetch waits: a fetch in flight when the last record or ring came may have read the
    # partition before that record existed (tansu answers with what it read at the start), so
    # the window must see one more fetch answer, sent after it.
    awake_s = max(s.kafka_awake_ms, 2 * wait_ms) / 1000
    poll_s = s.kafka_idle_poll_ms / 1000 if idle_poll_s is None else min(idle_poll_s, s.kafka_idle_poll_ms / 1000)
    settle = s.kafka_hot_settle or not hot  # (module doc)
    return FetchPolicy(
        QuietConsumer,
        {"fetch_max_wait_ms": wait_ms, "awake_s": awake_s, "idle_poll_s": poll_s, "settle_early": settle},
    )
