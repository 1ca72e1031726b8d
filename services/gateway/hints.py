"""Typing hints: a burst of keystrokes becomes one `TypingHint` on the advisory topic.

Front-ends send an event per keystroke (or per "started typing"); the advisory service needs
one hint per upcoming turn. Per session, at most one hint leaves every `interval_s`; the rest
are answered "debounced". Each gateway replica debounces on its own; the advisory service
treats a repeated hint for a session with a live placement as a refresh, so that is harmless.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from shared.kafka import KafkaClient
from shared.schemas.sessions import TypingHint

HintStatus = Literal["sent", "debounced"]


class HintDebouncer:
    def __init__(
        self, interval_s: float, clock: Callable[[], float] = time.monotonic, max_sessions: int = 100_000
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._max = max_sessions
        self._last_sent: OrderedDict[str, float] = OrderedDict()  # oldest send first

    def admit(self, session_id: str) -> bool:
        """True when a hint for the session may leave now (and records it)."""
        now = self._clock()
        self._forget_older_than(now - self.interval_s)
        if session_id in self._last_sent:
            return False
        self._last_sent[session_id] = now
        while len(self._last_sent) > self._max:
            self._last_sent.popitem(last=False)
        return True

    def _forget_older_than(self, cutoff: float) -> None:
        while self._last_sent:
            first_key, first_time = next(iter(self._last_sent.items()))
            if first_time > cutoff:
                return
            del self._last_sent[first_key]


class HintPublisher:
    def __init__(self, kafka: KafkaClient, topic: str, debounce_s: float) -> None:
        self._kafka = kafka
        self._topic = topic
        self.debouncer = HintDebouncer(debounce_s)

    async def hint(self, session_id: str, expected_arrival_s: float | None, source: str) -> HintStatus:
        if not self.debouncer.admit(session_id):
            return "debounced"
        msg = TypingHint(
            hint_id=uuid.uuid4().hex,
            session_id=session_id,
            sent_at=time.time(),
            expected_arrival_s=expected_arrival_s,
            source=source,
        )
        await self._kafka.send(self._topic, msg, key=session_id)
        return "sent"
