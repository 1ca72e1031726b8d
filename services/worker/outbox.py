"""Coalesces result events into one `ResultBatch` per gateway partition.

An engine step wakes every running request's stream task in the same event-loop turn; each
appends its delta here and the first one schedules a flush with `call_soon`, which runs after
all of them. So one step's tokens for N requests leave as one message per gateway partition,
with no timer delay added to any token.

An `Accepted` is held back (`put_held`) until the request's first step puts its first delta,
or `hold_s` passes, whichever comes first: the two then leave as one message. Sent alone it was
a produce, an ack, a ring and a gateway fetch on the event loops of the worker, the broker and
the gateway while the engine computed the request's first token on the same cores; the gateway
answers only once it has `Accepted`, which now comes with the first token instead of a
millisecond before it, or at most `hold_s` later on a long prefill (issue 21).

The messages for one partition are handed to the producer one at a time, in the order they
were flushed (`PartitionOrderedSender`); their acks are awaited outside that turn, so the
producer still batches and pipelines them. The gateway applies a request's deltas by index and
drops one that skips ahead (streams.py), so order on the partition is a must, and the producer
does not keep it for overlapping sends: when a partition's 16 KB batch is full, aiokafka parks
every further send until the batch drains, and a send made after the drain can overtake the
parked ones. On a loaded machine (a slow broker) that reordered deltas and left streams waiting
forever for a token the gateway had dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable

from aiokafka.structs import RecordMetadata

from shared.kafka import KafkaClient
from shared.schemas.base import WireModel
from shared.schemas.results import ResultBatch, ResultEvent
from shared.tracing import KafkaHeaders, Tracing

log = logging.getLogger(__name__)


class PartitionOrderedSender:
    """`send` for concurrent callers that keeps, per partition, the order of the calls: each
    message is appended to the producer in turn (asyncio locks are first come, first served),
    and its ack is awaited after the turn, so later messages can join the same request."""

    def __init__(self, kafka: KafkaClient) -> None:
        self._kafka = kafka
        self._turns: dict[tuple[str, int], asyncio.Lock] = defaultdict(asyncio.Lock)

    async def send(
        self, topic: str, message: WireModel, *, partition: int, headers: KafkaHeaders | None = None
    ) -> RecordMetadata:
        """Send and wait for the broker's ack (raises what the producer raises); returns where the
        record landed."""
        async with self._turns[topic, partition]:
            ack = await self._kafka.send_nowait(topic, message, partition=partition, headers=headers)
        return await ack


class ResultOutbox:
    def __init__(self, kafka: KafkaClient, topic: str, source: str) -> None:
        self._kafka = PartitionOrderedSender(kafka)  # in flush order per partition (module doc)
        self._topic = topic
        self._source = source
        self._pending: dict[int, list[ResultEvent]] = defaultdict(list)
        self._on_ack: dict[int, list[Callable[[], None]]] = defaultdict(list)
        self._flush_scheduled = False
        self._hold: asyncio.TimerHandle | None = None  # the flush of held events (put_held)
        self._inflight: set[asyncio.Task] = set()
        # The level of the per-batch "acknowledged at" line: the worker sets its broker watch's
        # recovery window (INFO for a while after a broker restart, DEBUG otherwise), so where
        # each result batch landed can be matched with the gateway reader's position then.
        self.ack_level: Callable[[], int] = lambda: logging.DEBUG

    def put(self, partition: int, event: ResultEvent, on_ack: Callable[[], None] | None = None) -> None:
        """Queue `event` for this step's batch to `partition`; `on_ack` runs once the broker has
        the batch (the worker times its first token's `worker.result_produce` hop with it)."""
        self._pending[partition].append(event)
        if on_ack is not None:
            self._on_ack[partition].append(on_ack)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def put_held(self, partition: int, event: ResultEvent, hold_s: float) -> None:
        """Queue `event` to leave with the next `put`'s batch, or alone after `hold_s`."""
        self._pending[partition].append(event)
        if not self._flush_scheduled and self._hold is None:
            self._hold = asyncio.get_running_loop().call_later(hold_s, self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._hold is not None:
            self._hold.cancel()  # a no-op when it is the hold itself that fired
            self._hold = None
        pending, self._pending = self._pending, defaultdict(list)
        on_ack, self._on_ack = self._on_ack, defaultdict(list)
        for partition, events in pending.items():
            task = asyncio.ensure_future(self._send(partition, events, on_ack.get(partition, [])))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _send(self, partition: int, events: list[ResultEvent], on_ack: list[Callable[[], None]]) -> None:
        batch = ResultBatch(source=self._source, events=events)
        try:
            # One batch serves many requests: it carries only its send time, for the gateway's
            # `gateway.consume` hop (shared/tracing.py).
            landed = await self._kafka.send(
                self._topic, batch, partition=partition, headers=Tracing.kafka_headers(None)
            )
        except Exception:  # noqa: BLE001 (a lost batch must not kill the worker; the client times out)
            # named by request: a lost batch is a request whose client waits out its timeout
            log.exception("failed to publish %d result events (requests %s)", len(events), _named(events))
            return
        level = self.ack_level()
        if log.isEnabledFor(level):
            log.log(
                level,
                "%d result events acknowledged at %s[%d]@%d (requests %s)",
                len(events),
                landed.topic,
                landed.partition,
                landed.offset,
                _named(events),
            )
        for cb in on_ack:
            cb()

    async def drain(self) -> None:
        """Wait until everything put so far is acknowledged (shutdown)."""
        if self._flush_scheduled or self._hold is not None:
            self._flush()
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)


def _named(events) -> str:
    """The requests (id:attempt) a batch of result events serves, for its log lines."""
    return ", ".join(sorted({f"{e.request_id}:{e.attempt}" for e in events}))
