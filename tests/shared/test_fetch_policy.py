"""`fetch_policy`: which consumer and fetch options each kind of reader gets on each broker."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer

from shared.fetch_policy import COLD_FETCH_WAIT_MS, fetch_policy
from shared.quiet_consumer import QuietConsumer
from shared.settings import ServiceSettings


def test_tansu_hot_reader_fetches_with_the_token_path_wait_and_sleeps_on_the_rung_records_answer():
    p = fetch_policy(ServiceSettings(kafka_fetch_wait_ms=2, kafka_awake_ms=50), hot=True)
    assert p.consumer_class is QuietConsumer
    assert p.options["fetch_max_wait_ms"] == 2
    assert p.options["awake_s"] == 0.05
    assert p.options["settle_early"] is True  # kafka_hot_settle, on by default (ninth session)


def test_hot_settle_off_keeps_a_hot_reader_awake_for_its_window():
    p = fetch_policy(ServiceSettings(kafka_fetch_wait_ms=2, kafka_hot_settle=False), hot=True)
    assert p.options["settle_early"] is False and p.options["fetch_max_wait_ms"] == 2


def test_tansu_cold_reader_sleeps_early_and_its_window_covers_two_fetch_waits():
    p = fetch_policy(ServiceSettings(kafka_awake_ms=50), hot=False)
    assert p.options["fetch_max_wait_ms"] == COLD_FETCH_WAIT_MS
    assert p.options["awake_s"] == 2 * COLD_FETCH_WAIT_MS / 1000  # above the 50 ms setting
    assert p.options["settle_early"] is True


def test_idle_poll_is_capped_by_the_setting():
    s = ServiceSettings(kafka_idle_poll_ms=5000)
    assert fetch_policy(s, hot=False).options["idle_poll_s"] == 5.0
    assert fetch_policy(s, hot=False, idle_poll_s=1.5).options["idle_poll_s"] == 1.5
    assert fetch_policy(s, hot=False, idle_poll_s=60).options["idle_poll_s"] == 5.0


def test_apache_kafka_long_polls_with_plain_consumers():
    p = fetch_policy(ServiceSettings(kafka_long_poll=True, kafka_long_poll_wait_ms=500), hot=True)
    assert p.consumer_class is AIOKafkaConsumer
    assert p.options == {"fetch_max_wait_ms": 500}
