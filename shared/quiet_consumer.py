"""A consumer that stops fetching when idle and wakes on a doorbell, for the embedded broker.

tansu answers a fetch at its deadline only (docs/services.md, "Fetch waits"), so a consumer
that keeps a fetch in flight pays one broker round trip per `fetch_max_wait_ms` forever: with
the 2 ms the token path needs, ~500 fetches a second per consumer, idle or not. A
`QuietConsumer` fetches like any aiokafka consumer while records flow; once it has seen neither
a record nor a ring for `awake_s`, and a fetch has answered since (`_drained`), it pauses its
partitions (no fetch is sent while paused) and sleeps until a producer rings its topic
(`shared/doorbell.py`) or `idle_poll_s` passes (a safety net for a lost ring: a record is then
late, never lost). A ring resumes the partitions at once,
from the doorbell's callback, so the next fetch (one `fetch_max_wait_ms` later on tansu) carries
the record: the same latency as a consumer that never slept.

**Sleeping on the answer that carried the rung record** (`settle_early`, off the token path;
issue 21, sixth session). A ring says where its record landed (`partition:offset`, see
`ring_payload`), so the reader knows what it was woken for: once its position on every rung
partition is past the rung offset, nothing it holds is unread (no buffered records) and the last
answer showed no more (`highwater`), it sleeps at once instead of waiting out the awake window,
which cost about three fetches per record. A fetch that was in flight when the record landed
answers without it and leaves the position short, so the reader simply fetches again: no
assumption about when a fetch was sent. A ring with no position (a bare `wake()`, a safety look,
a ring from older code) keeps the awake-window rule, which is also the upper bound in every case
(a rung offset above a restarted broker's end is never reached). A record produced without a
ring while the reader sleeps waits for the next ring or look, as before.

**Catching up on a broker that answers with what it read in time** (issue 21, seventh session).
tansu reads a fetch's records only until its `fetch_max_wait_ms` deadline and answers with what it
has by then: with one-record batches (the token path's) a 1 ms fetch read 129 records of 1,000 on a
fresh broker, a 2 ms one 532, and on the busy broker of a stack test a 1 ms fetch read *nothing*
from a backlog of ~600 records, over and over (215 empty answers in 300 ms, each with the
high-water mark far above the position), while a 2 ms fetch read 50-200 of them. That was the
1 ms token-path wait's failure: the gateway's results reader fell behind on a burst, every
answer came back empty, and after the awake window it slept with 359 records unread; each
ring and safety look fetched once more, empty, and it slept again: requests answered 503 after
the gateway's 60 s first-event timeout. Two rules make any wait safe: a reader never sleeps
while the last answer shows records beyond its position (`_drained`), and an answer that came
back empty while records wait doubles the next fetch's wait (`_CATCH_UP_MAX_MS` at most) until
an answer brings records, which restores the configured wait (`_after_answer`).

**Foreign rings** (issue 21, eighth session). A topic's bell rings for a record on any of its
partitions, and some readers hold only one: each gateway and the queue service read their own
partition of `<p>.results`. A ring that names only partitions this reader does not hold is
ignored; it used to wake the reader for a whole awake window, so every token streamed to a
gateway kept the queue's results reader fetching every 2 ms (and the broker answering), on the
cores the token path runs on. A bare ring (no position) still wakes it: it cannot tell.

It subclasses `AIOKafkaConsumer` (rather than wrapping it) because it must see the service's own
`pause`/`resume` (the scheduler pauses its BE partitions for flow control): a partition the
service paused is never resumed by a wake-up, and `getmany`/`getone` mark activity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import IllegalStateError
from aiokafka.structs import RecordMetadata

from shared import stale_batches

log = logging.getLogger(__name__)


# An event loop may fire a timer up to its clock's resolution early (uvloop: 1 ms), so a wait
# that ends "almost" at the deadline would re-arm a sub-millisecond timer again and again, a
# busy loop that cost ~40 wake-ups a second per consumer on an idle stack. Within this much of
# the deadline the window counts as over.
_TIMER_SLACK_S = 0.002

# The longest fetch wait a starved reader grows to (see "Catching up" above): long enough for a
# busy tansu to read at least one batch, short enough that catching up never waits long.
_CATCH_UP_MAX_MS = 64


def _wall_ms() -> int:
    return int(time.time() * 1000)


def ring_payload(landed: RecordMetadata | None) -> bytes:
    """What a ring carries: where the record landed (`partition:offset`), or nothing."""
    return b"" if landed is None else f"{landed.partition}:{landed.offset}".encode()


def _rung_offsets(topic: str, payloads: list[bytes]) -> dict[TopicPartition, int] | None:
    """The highest rung offset per partition, or None when any ring did not say (look anyway)."""
    out: dict[TopicPartition, int] = {}
    for p in payloads:
        try:
            partition, offset = (int(x) for x in p.split(b":"))
        except ValueError:
            return None
        tp = TopicPartition(topic, partition)
        out[tp] = max(out.get(tp, -1), offset)
    return out


class QuietConsumer(AIOKafkaConsumer):
    def __init__(self, *topics: str, awake_s: float, idle_poll_s: float, settle_early: bool = False, **kwargs) -> None:
        super().__init__(*topics, **kwargs)
        self._awake_s = awake_s
        self._idle_poll_s = idle_poll_s
        self._settle_early = settle_early
        # Since it last fell asleep: the offset each rung partition must pass (None: a wake-up
        # that did not say where, so the awake window decides).
        self._due: dict[TopicPartition, int] | None = {}
        self._held: set[TopicPartition] = set()  # paused by the service: never resumed here
        self._asleep: set[TopicPartition] = set()  # paused here, resumed by a wake-up
        self._last_activity = time.monotonic()
        self._activity_ms = _wall_ms()  # the same moment on the clock aiokafka stamps fetches with
        self._rung = asyncio.Event()
        self._watch_task: asyncio.Task | None = None
        self._base_wait_ms = kwargs.get("fetch_max_wait_ms", 500)
        self.starved_answers = 0  # answers that came back empty while records waited (a count)
        # The level of the "asleep at position/high watermark" line: the broker watch sets its
        # recovery window after a restart (INFO for a while, DEBUG otherwise), so a reader that
        # sleeps with a position a restarted broker will not reach can be seen in the logs.
        self.sleep_log_level = lambda: logging.DEBUG

    async def start(self) -> None:
        stale_batches.install()  # once per process: read what a restarted tansu hides (its module doc)
        await super().start()
        self._hook_answers()
        self._watch_task = asyncio.create_task(self._watch(), name="quiet-consumer")

    def _hook_answers(self) -> None:
        """Call `_after_answer` once each fetch's answer is applied. aiokafka has no hook for it:
        this wraps the fetcher's per-request coroutine, which its fetch routine looks up on the
        instance for every request, and changes nothing of what it does or returns.

        The wrapper runs on every answer, the token path's included, so an answer that brought
        records (the coroutine says so: True) costs one comparison (`_after_answer`); only an
        empty answer looks at its partitions (issue 21, eighth session)."""
        fetcher = self._fetcher
        apply_answer = getattr(fetcher, "_proc_fetch_request", None)
        if apply_answer is None:  # another aiokafka than constraints.txt pins: no catch-up, never a crash
            log.warning("aiokafka's fetcher has no _proc_fetch_request: a starved fetch's wait is not grown")
            return

        async def answered(assignment, node_id, request):
            with stale_batches.answering(assignment):  # the answer's high watermark for its records
                brought = await apply_answer(assignment, node_id, request)
            try:
                self._after_answer(assignment, request, brought)
            except Exception:  # noqa: BLE001 (an error here would end aiokafka's fetch routine)
                log.exception("fetch wait not adjusted")
            return brought

        fetcher._proc_fetch_request = answered  # noqa: SLF001

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            # gather, not `suppress(CancelledError)`: that would also swallow a cancellation of
            # this stop itself (its caller's timeout)
            await asyncio.gather(self._watch_task, return_exceptions=True)
            self._watch_task = None
        await super().stop()

    # The service's flow control ---------------------------------------------------------------
    def pause(self, *partitions: TopicPartition) -> None:
        self._held.update(partitions)
        self._asleep.difference_update(partitions)
        super().pause(*partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        """Lift the service's pause; a partition asleep here stays asleep until a wake-up (the
        scheduler resumes its BE partitions after every batch it reads, asleep or not)."""
        self._held.difference_update(partitions)
        awake = [tp for tp in partitions if tp not in self._asleep]
        if awake:
            super().resume(*awake)

    # Activity -----------------------------------------------------------------------------------
    async def getmany(self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None):
        batches = await super().getmany(*partitions, timeout_ms=timeout_ms, max_records=max_records)
        if batches:
            self._mark_activity()
            self._settle_if_read()
        return batches

    async def getone(self, *partitions: TopicPartition):
        record = await super().getone(*partitions)
        self._mark_activity()
        self._settle_if_read()
        return record

    def wake(self, topic: str | None = None, payloads: list[bytes] | None = None) -> None:
        """A producer rang: fetch again now (called from the doorbell on the event loop, with
        what the rings said; with nothing, a plain "look")."""
        if self._watch_task is None:
            return  # stopped (or not started): nothing to wake
        rung = None if topic is None or payloads is None else _rung_offsets(topic, payloads)
        if rung is not None:
            assigned = self.assignment()
            rung = {tp: offset for tp, offset in rung.items() if tp in assigned}
            if not rung:
                return  # only records for partitions other readers hold (module doc, "Foreign rings")
        if rung is None or self._due is None:
            self._due = None
        else:
            for tp, offset in rung.items():
                self._due[tp] = max(self._due.get(tp, -1), offset)
            if self._asleep and self._read_all_rung():
                return  # read already (an awake fetch got there before the ring): stay asleep
        self._mark_activity()
        self._resume_slept()
        self._rung.set()

    def _mark_activity(self) -> None:
        self._last_activity = time.monotonic()
        self._activity_ms = _wall_ms()

    @property
    def sleeping(self) -> bool:
        return bool(self._asleep)

    # Sleep and wake -----------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            if not self._asleep:  # (asleep already: it settled early, on the rung record's answer)
                awake_left = self._awake_s - (time.monotonic() - self._last_activity)
                if awake_left > _TIMER_SLACK_S:
                    await asyncio.sleep(awake_left)  # a timer, not a poll of the broker
                    continue
                if not self._drained():
                    await asyncio.sleep(self._fetch_wait_s() + 0.001)  # a fetch is still on its way
                    continue
                self._fall_asleep()
            try:
                async with asyncio.timeout(self._idle_poll_s):  # not wait_for: see shared/aio.py
                    await self._rung.wait()
            except TimeoutError:
                # Safety net: look once (a short awake window, and until a fetch has answered).
                self._due = None
                self._mark_activity()
                self._last_activity = time.monotonic() - self._awake_s + self._probe_s()
                self._resume_slept()

    def _probe_s(self) -> float:
        return min(self._awake_s, 2.5 * self._fetch_wait_s() + 0.002)

    def _fetch_wait_s(self) -> float:
        return self._fetcher._fetch_max_wait_ms / 1000  # noqa: SLF001 (set by us at construction)

    def _drained(self) -> bool:
        """Whether sleeping now loses nothing: every partition it would pause has had a fetch
        answered since the last activity (a ring, a record), no fetched records wait to be read,
        and the last answer showed nothing beyond the position (a broker that ran out of time
        answers short: module doc, "Catching up"). aiokafka drops what a fetch brings for a
        partition that is paused by the time it is read (it fetches it again on resume); under
        load a fetch can outlast `awake_s`, and sleeping then would leave a rung record unread
        until the next ring."""
        buffered = self._fetcher._records  # noqa: SLF001 (aiokafka has no public "pending records")
        for tp in self.assignment() - self._held:
            polled = self.last_poll_timestamp(tp)
            if tp in buffered or polled is None or polled <= self._activity_ms:
                return False
            state = self._subscription.subscription.assignment.state_value(tp)  # noqa: SLF001
            if state.has_valid_position and state.highwater is not None and state.highwater > state.position:
                return False  # the broker has more than it answered with (module doc, "Catching up")
        return True

    def _after_answer(self, assignment, request, brought: bool) -> None:
        """Grow the fetch wait while answers come back empty with records waiting; restore it
        once one brings records (module doc, "Catching up"). `brought`: the answer added records
        to the fetcher's buffer (what aiokafka's coroutine returned)."""
        fetcher = self._fetcher
        if brought:  # the common case on the token path: O(1)
            if fetcher._fetch_max_wait_ms != self._base_wait_ms:  # noqa: SLF001
                fetcher._fetch_max_wait_ms = self._base_wait_ms  # noqa: SLF001
            return
        if not assignment.active:
            return
        buffered = self._fetcher._records  # noqa: SLF001
        starved = False
        for topic, partitions in request.topics:
            for partition, offset, _max_bytes in partitions:
                tp = TopicPartition(topic, partition)
                if tp in buffered:
                    return  # records from an earlier answer still wait: not starved
                state = assignment.state_value(tp)
                if state is not None and state.highwater is not None and state.highwater > offset:
                    starved = True
        if starved:
            self.starved_answers += 1
            wait = fetcher._fetch_max_wait_ms  # noqa: SLF001
            fetcher._fetch_max_wait_ms = min(max(2 * wait, 1), max(_CATCH_UP_MAX_MS, self._base_wait_ms))  # noqa: SLF001

    def _settle_if_read(self) -> None:
        """Off the token path: sleep now if everything rung since the last sleep has been read."""
        if self._settle_early and self._due and not self._asleep and self._read_all_rung():
            self._fall_asleep()

    def _read_all_rung(self) -> bool:
        """Every rung partition's position is past its rung offset, nothing fetched waits unread
        and the latest answers showed nothing beyond the position."""
        buffered = self._fetcher._records  # noqa: SLF001 (aiokafka has no public "pending records")
        assignment = self._subscription.subscription.assignment  # noqa: SLF001 (sync position read)
        for tp, offset in (self._due or {}).items():
            state = assignment.state_value(tp) if tp in self.assignment() else None
            if state is None or not state.has_valid_position or state.position <= offset or tp in buffered:
                return False
            if state.highwater is not None and state.highwater > state.position:
                return False
        return bool(self._due)

    def _fall_asleep(self) -> None:
        self._rung.clear()
        self._due = {}
        tps = self.assignment() - self._held
        if not tps:
            return
        super().pause(*tps)
        self._asleep = set(tps)
        level = self.sleep_log_level()
        if log.isEnabledFor(level):
            log.log(level, "reader asleep at (position, high watermark) %s", self._positions(tps))

    def _positions(self, tps) -> str:
        """`topic[partition]=(position, high watermark)` for each of `tps`, from what the
        consumer already holds (no request)."""
        assignment = self._subscription.subscription.assignment  # noqa: SLF001 (sync position read)
        out = []
        for tp in sorted(tps):
            state = assignment.state_value(tp)
            position = state.position if state is not None and state.has_valid_position else None
            out.append(f"{tp.topic}[{tp.partition}]=({position}, {self.highwater(tp)})")
        return " ".join(out)

    def _resume_slept(self) -> None:
        if not self._asleep:
            return
        tps = (self._asleep & self.assignment()) - self._held
        self._asleep = set()
        for tp in tps:
            with contextlib.suppress(IllegalStateError):  # unassigned by a rebalance meanwhile
                super().resume(tp)
