"""Re-sending a record the broker refused, for `KafkaClient.send` and `send_nowait`.

Why. Right after an in-memory restart the embedded broker (tansu 0.6) refuses some produces with
`UnknownError` (-1): it gave the batch an offset whose slot a record written before the topic was
re-created already holds (docs/reliability.md, "Broker restarts"; shared/hole_guard.py). Nothing
of a refused batch is stored, and the slot is used up, so the same record sent again gets the
next offset and is stored. Before this, nobody sent it again: a worker's last result batch of a
batch item was lost, the item stayed in flight until the queue restarted, and the broker-restart
stack test failed about one run in three under load.

What is re-sent, by topic kind (the caller chooses with `resend=`):
- dispatch, results (tokens), requests, state (`scheduler.state`, sessions), control, fences:
  re-sent (`RESEND`). Every reader is idempotent: a worker runs a dispatched attempt once, the
  gateway and the queue place deltas by index and drop what they have, compacted topics keep the
  last value per key. A re-sent record lands after whatever the producer sent meanwhile; a reader
  that needs order (the gateway and the queue read deltas by index) sees a gap and repairs it as
  after any lost record: the gateway resumes the stream, the queue runs the item again.
- periodic reports (heartbeats, telemetry, gateway owner beats, BE capacity) and lease records:
  not re-sent (`NO_RESEND`): the next beat carries newer state within its period, and a
  heartbeat or renewal loop that waited seconds on a re-send would itself look dead. A worker's
  heartbeat is the exception, handled by its sender rather than here: a refused one is built
  afresh and sent again within its interval, by a task of its own that the heartbeat loop does
  not wait for (`services/worker/reports.py`, `send_heartbeat`; eleventh session).
Only `UnknownError` is re-sent: it is the refusal, and nothing was stored. A timeout may have
been stored and already took the producer's request timeout (10 s); it goes to the caller, as
does anything else. Bounded: a broker that keeps refusing raises after `attempts` re-sends
(about 5 s with the defaults), so a caller is never held for long; each refusal is logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from aiokafka.errors import UnknownError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ResendPolicy:
    """How often, and how soon, a refused record is sent again (0 attempts: never)."""

    # Each refusal uses up one stale slot, so what bounds recovery is how many slots a record may
    # try, not how long it waits between tries: after a restart `scheduler.state` held more stale
    # slots than 8 re-sends could pass, and a dispatch and a reroute's tombstone were given up
    # (`tandem chaos --faults broker`, tenth session). 24 tries within about the same 5 s.
    attempts: int = 24
    first_delay_s: float = 0.02
    max_delay_s: float = 0.25

    def delays(self) -> list[float]:
        """The wait before each re-send: doubling from `first_delay_s`, capped at `max_delay_s`."""
        return [min(self.first_delay_s * 2**i, self.max_delay_s) for i in range(self.attempts)]


RESEND = ResendPolicy()
NO_RESEND = ResendPolicy(attempts=0)


async def with_resend(
    what: str, send_once: Callable[[], Awaitable[T]], policy: ResendPolicy, first_ack: Awaitable[T] | None = None
) -> T:
    """The ack of `send_once()` (or of `first_ack`, a send of the same record already handed to
    the producer), sent again after each refusal (module doc) up to `policy.attempts` times; the
    last refusal, and any other error, goes to the caller."""
    delays = iter(policy.delays())
    pending = first_ack
    while True:
        try:
            return await (pending if pending is not None else send_once())
        except UnknownError as exc:
            delay = next(delays, None)
            if delay is None:
                if policy.attempts:
                    log.error("%s refused by the broker %d times (%r); giving up", what, policy.attempts + 1, exc)
                raise
            log.warning("%s refused by the broker (%r); sending it again in %.2fs", what, exc, delay)
            await asyncio.sleep(delay)
            pending = None
