"""The re-send rules of shared/produce_resend.py, alone.

What they are for, a record a restarted tansu refused, is exercised on real brokers by
tests/services/test_broker_restart.py (the stack survives a restart) and test_up.py (HA pairs
survive one). tansu's refusal could not be made on demand here: the same recipe (records written
to a topic the new broker does not have yet, then the topic created) refused the next produce in
some runs and stored it in others, so a test of `KafkaClient.send` on it would pass without the
re-send. The send here is a plain coroutine that fails as aiokafka does.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiokafka.errors import KafkaTimeoutError, UnknownError

from shared.produce_resend import NO_RESEND, ResendPolicy, with_resend

FAST = ResendPolicy(attempts=3, first_delay_s=0.001, max_delay_s=0.001)


class Sends:
    """A send that the broker refuses `refusals` times, then acknowledges (returns its count)."""

    def __init__(self, refusals: int, error: Exception | None = None) -> None:
        self.refusals, self.error, self.calls = refusals, error, 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.refusals:
            raise self.error or UnknownError()
        return self.calls


def test_a_refused_record_is_sent_again_until_it_is_stored(caplog):
    sends = Sends(refusals=2)
    with caplog.at_level(logging.WARNING, logger="shared.produce_resend"):
        assert asyncio.run(with_resend("record to t", sends, FAST)) == 3
    assert sends.calls == 3
    assert sum("refused by the broker" in r.getMessage() for r in caplog.records) == 2


def test_a_broker_that_keeps_refusing_gets_a_bounded_number_of_sends_then_the_caller_the_error(caplog):
    sends = Sends(refusals=10)
    with caplog.at_level(logging.WARNING, logger="shared.produce_resend"), pytest.raises(UnknownError):
        asyncio.run(with_resend("record to t", sends, FAST))
    assert sends.calls == FAST.attempts + 1
    assert any("giving up" in r.getMessage() for r in caplog.records)


def test_no_resend_and_other_errors_go_to_the_caller_at_once():
    refused = Sends(refusals=1)
    with pytest.raises(UnknownError):
        asyncio.run(with_resend("lease record", refused, NO_RESEND))
    timed_out = Sends(refusals=1, error=KafkaTimeoutError())  # may have been stored: not re-sent
    with pytest.raises(KafkaTimeoutError):
        asyncio.run(with_resend("record to t", timed_out, FAST))
    assert (refused.calls, timed_out.calls) == (1, 1)


def test_a_pipelined_send_refused_is_sent_again():
    """`send_nowait`'s path: the first ack (already handed to the producer) is refused, the
    record is sent again."""

    async def run() -> tuple[int, int]:
        first: asyncio.Future = asyncio.get_running_loop().create_future()
        first.set_exception(UnknownError())
        sends = Sends(refusals=0)
        return await with_resend("record to t", sends, FAST, first_ack=first), sends.calls

    assert asyncio.run(run()) == (1, 1)


def test_a_policy_waits_longer_after_each_refusal_up_to_its_cap():
    assert ResendPolicy(attempts=5, first_delay_s=0.1, max_delay_s=0.5).delays() == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert NO_RESEND.delays() == []
