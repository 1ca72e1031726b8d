"""The re-send rules of shared/produce_resend.py, alone.

The rules are driven with a plain coroutine that fails as aiokafka does; the last test makes a
real tansu refuse a produce (a record written to a topic the restarted broker does not have yet,
then the topic created: the next produce is given the orphan's offset) and checks that
`KafkaClient.send` re-sends it and it is stored. The stacks survive refusals too:
tests/services/test_broker_restart.py and test_up.py (HA pairs).
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


def test_kafka_client_re_sends_what_a_restarted_tansu_refuses(caplog):
    """On a real tansu, made to refuse on demand by the recipe of shared/hole_guard.py: a producer
    with cached metadata writes a record to a topic the restarted broker does not have yet
    (acknowledged at offset 0, the topic not created), then the topic is created (its watermark
    back to 0). `KafkaClient.send` is then given offset 0 again, refused (`UnknownError`: that
    slot's batch exists), sends it again, and it is stored at offset 1 and read back there.
    (A second topic made the same way in the same run was refused in only 3 of 5 runs, so only
    the first is used; `NO_RESEND` is checked by the rules above.)"""
    import subprocess

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from services.broker import start_broker
    from shared.kafka import KafkaClient
    from shared.schemas.control import Cancel, ControlEnvelope
    from shared.settings import ServiceSettings
    from tests.shared.admin import create_topic

    topic = "resend.t"
    proc, bootstrap = start_broker(tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host, port = bootstrap.rsplit(":", 1)

    async def run() -> tuple[int, str]:
        nonlocal proc
        await create_topic(bootstrap, topic)
        stale = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        await stale.start()
        await stale.send_and_wait(topic, b"before", partition=0)  # the topic's metadata, cached
        proc.kill()
        proc.wait()
        proc = start_broker(host, int(port), tied=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)[0]
        await stale.send_and_wait(topic, b"orphan", partition=0)  # no topic yet: stored anyway, at 0
        await stale.stop()
        await create_topic(bootstrap, topic)  # the watermark back to 0
        kafka = KafkaClient(ServiceSettings(kafka_bootstrap=bootstrap), "resend-test")
        await kafka.start()
        try:
            landed = await kafka.send(topic, ControlEnvelope(message=Cancel(request_id="kept")), partition=0)
        finally:
            await kafka.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek(tp, landed.offset)
        try:
            m = await asyncio.wait_for(consumer.getone(), 60)
        finally:
            await consumer.stop()
        return landed.offset, ControlEnvelope.decode(m.value).message.request_id

    try:
        with caplog.at_level(logging.WARNING, logger="shared.produce_resend"):
            offset, read = asyncio.run(run())
    finally:
        proc.kill()
        proc.wait()
    assert offset == 1 and read == "kept"  # refused at 0 (the orphan's slot), stored at 1
    assert [r.getMessage() for r in caplog.records if "refused by the broker" in r.getMessage()], caplog.text
