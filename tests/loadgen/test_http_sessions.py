"""The HTTP target's multi-turn sessions against a real stack, checked from the server's side.

A few sessions of a few turns go through `HttpRun` (the path `tandem bench sessions` takes),
in the bench's modes: `hints` and `sticky` on a default stack, `recompute` on one without the
prefix cache. What the server saw is read back from the broker: typing hints from the advisory
topic, requests (session id, conversation, gateway arrival time) from `requests.rt`, and the
workers' session-turn counters from `GET /v1/sessions/stats`.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import httpx
import numpy as np
import pytest

from loadgen.bench.sessions import MODES, Mode, stats_delta
from loadgen.targets.http import HttpClient, HttpRun
from loadgen.workloads.build import Workload, WorkloadConfig
from loadgen.workloads.datasets import LengthProfile
from loadgen.workloads.lengths import constant
from loadgen.workloads.sources import HumanSpeeds, Session
from loadgen.workloads.spec import SLOSpec
from shared.kafka import KafkaClient, read_to_end
from shared.schemas.requests import GenerateRequest
from shared.schemas.sessions import TypingHint
from shared.settings import ServiceSettings
from shared.topics import Topics
from tests.services.conftest import make_stack, worker_heartbeat  # noqa: F401  (fixture)

# The tests' own bodies: 180 s. The two stacks' start (six processes, set up once for the
# module) is bounded by the stack's own start-up waits (START_TIMEOUT_S each, failing with the
# children's logs), not by the first test's timeout: at load 33-38 it took over 180 s and the
# module errored before any test ran.
pytestmark = pytest.mark.timeout(300, func_only=True)
SESSIONS, TURNS = 3, 3
PROMPT_WORDS, OUTPUT_TOKENS = 20, 6
# The window: never what ends the run, the sessions do (a run ends when nothing is open or due;
# turns due after the window would never be sent). Far past the test's timeout, so a slow
# machine cannot cut the last turns off: it was 60 s, a hidden bound on the sessions' time.
DURATION_S = 3600.0
# 20 words typed in 0.6 s, 6 tokens read in 0.2 s: the hint leads its request by ~0.6 s
SPEEDS = HumanSpeeds(reading_wpm=1350.0, typing_wpm=1500.0)
TYPING_S = SPEEDS.typing_s(PROMPT_WORDS)
BLOCK_SIZE = 16  # the engine's KV block: kept and cached tokens come in whole blocks


@pytest.fixture(scope="module")
def stacks(make_stack):  # noqa: F811
    """`default` serves the hints and sticky modes, `recompute` the bench's recompute mode (no
    prefix cache, so nothing is reused without session ids). Started together: startup overlaps."""
    default = make_stack(TANDEM_TYPING_DEBOUNCE_S=0)  # a hint per turn, however quick
    recompute = make_stack(**MODES["recompute"].env)
    for s in (default, recompute):
        s.scheduler()
        s.worker("w0")
        s.gateway()
    for s in (default, recompute):
        s.wait_workers(1)
    return {"default": default, "recompute": recompute}


def _workload(tag: str) -> Workload:
    """SESSIONS sessions of exactly TURNS turns; the first turn's typing starts after the run does."""
    profile = LengthProfile("chat", constant(PROMPT_WORDS), constant(OUTPUT_TOKENS), SLOSpec())
    cfg = WorkloadConfig("sessions", duration_s=DURATION_S, seed=3, speeds=SPEEDS, max_len=512)
    starts = [TYPING_S + 0.1 + 0.2 * i for i in range(SESSIONS)]  # typing starts at 0.1 s, 0.3 s, ...
    sessions = [
        Session(f"{tag}-s{i}", at, TURNS, profile, SPEEDS, np.random.default_rng(i), cfg.duration_s, cfg.max_len)
        for i, at in enumerate(starts)
    ]
    return Workload(cfg, [], sessions)


def _run(url: str, mode: Mode, tag: str, hint_arrival: bool = False):
    async def main():
        client = HttpClient(url, "tiny", send_session_ids=mode.session_ids)
        try:
            return await HttpRun(
                client,
                _workload(tag),
                seed=3,
                drain_timeout_s=60.0,
                progress=False,
                send_hints=mode.hints,
                hint_arrival=hint_arrival,
            ).run()
        finally:
            await client.close()

    return asyncio.run(main())


async def _read_topic(stack, topic: str, decode) -> list:
    """Every message on a topic so far, decoded."""
    kafka = KafkaClient(ServiceSettings(kafka_bootstrap=stack.bootstrap), "test-http-sessions")
    consumer = await kafka.consumer(group=None)
    out = []
    try:
        await kafka.assign_all(consumer, topic, from_end=False)
        await read_to_end(consumer, lambda m: out.append(decode(m.value)))
    finally:
        await kafka.stop()
    return out


def _server_requests(stack, tag: str) -> list[GenerateRequest]:
    """The run's requests as the gateway published them: those with one of its session ids, or none."""
    reqs = asyncio.run(_read_topic(stack, Topics(stack.prefix).rt_requests.name, GenerateRequest.decode))
    return [r for r in reqs if r.session_id is None or r.session_id.startswith(f"{tag}-")]


def _hints(stack, tag: str, expected: int) -> list[TypingHint]:
    """The run's typing hints on the advisory topic, once there are `expected` of them."""

    def read() -> list[TypingHint]:
        hints = asyncio.run(_read_topic(stack, Topics(stack.prefix).advisory.name, TypingHint.decode))
        return [h for h in hints if h.session_id.startswith(f"{tag}-")]

    stack.wait_until(f"{expected} typing hints", lambda: len(read()) >= expected)
    return read()


def _session_turns(stack) -> int:
    r = httpx.get(f"{stack.url}/v1/sessions/stats", timeout=10)
    r.raise_for_status()
    return int(stats_delta({}, r.json()).get("turns", 0))


def _wait_session_turns(stack, at_least: int) -> int:
    """The workers' session-turn counter, once it reaches `at_least` (heartbeats carry it)."""
    stack.wait_until(f"{at_least} session turns", lambda: _session_turns(stack) >= at_least)
    return _session_turns(stack)


def _turn_of(req: GenerateRequest) -> int:
    return sum(m.role == "user" for m in req.messages) - 1


def _check_records(res, tag: str) -> None:
    """Every turn of every session completed, each record with its session and turn index."""
    recs = res.records
    assert all(r.completed for r in recs), [(r.request_id, r.error) for r in recs]
    expected = {(f"{tag}-s{i}", t) for i in range(SESSIONS) for t in range(TURNS)}
    assert {(r.session_id, r.turn) for r in recs} == expected and len(recs) == len(expected)
    assert all(r.request_id == f"{r.session_id}-t{r.turn}" for r in recs)
    assert res.target["typing_hints_unsupported"] == 0
    prompts = defaultdict(list)  # the server counted the whole conversation as the prompt: it grows
    for r in sorted(recs, key=lambda r: r.turn):
        prompts[r.session_id].append(r.usage_prompt_tokens)
    assert all(p[0] > PROMPT_WORDS and p == sorted(set(p)) for p in prompts.values()), prompts


def _check_conversations(reqs: list[GenerateRequest], res, with_ids: bool) -> dict:
    """The server got each turn once, with the whole conversation so far; returns its arrival
    time per (session, turn). Without session ids, turns are told apart by their first prompt."""
    by_first = defaultdict(list)
    for r in reqs:
        by_first[next(m.content for m in r.messages if m.role == "user")].append(r)
    assert len(by_first) == SESSIONS
    sent_ids = {r.session_id for r in res.records} if with_ids else {None}
    assert {r.session_id for r in reqs} == sent_ids
    created = {}
    for convo in by_first.values():
        turns = sorted(convo, key=_turn_of)
        assert [_turn_of(r) for r in turns] == list(range(TURNS)) and len({r.session_id for r in turns}) == 1
        for r in turns:
            roles = [m.role for m in r.messages]
            assert roles == ["user", "assistant"] * _turn_of(r) + ["user"], roles
            created[(r.session_id, _turn_of(r))] = r.created_at
    return created


def _check_hint_order(hints: list[TypingHint], created: dict) -> None:
    """Per session, hint k reached the gateway after turn k-1's request and well before turn k's:
    while its user typed (half the typing time leaves room for a loaded machine's jitter)."""
    per_session = defaultdict(list)
    for h in hints:
        per_session[h.session_id].append(h.sent_at)
    assert len(per_session) == SESSIONS
    for sid, sent in per_session.items():
        sent.sort()
        assert len(sent) == TURNS, (sid, sent)
        for k, at in enumerate(sent):
            assert created[(sid, k)] - at > TYPING_S / 2, (sid, k, created[(sid, k)] - at)
            assert k == 0 or at > created[(sid, k - 1)], (sid, k)


def _check_kv_reused(res) -> None:
    """With session ids the worker keeps each conversation's KV: every later turn reuses at least
    the full blocks of the previous turn's prompt."""
    by_key = {(r.session_id, r.turn): r for r in res.records}
    for r in res.records:
        if r.turn >= 1:
            prev_prompt_blocks = by_key[(r.session_id, r.turn - 1)].usage_prompt_tokens // BLOCK_SIZE
            assert r.cached_tokens >= prev_prompt_blocks * BLOCK_SIZE > 0, (r.request_id, r.cached_tokens)


def test_hints_and_session_ids_reach_the_server(stacks):
    stack = stacks["default"]
    turns_before = _session_turns(stack)
    res = _run(stack.url, MODES["hints"], "hints")
    _check_records(res, "hints")
    assert res.typing_hints == SESSIONS * TURNS  # one per turn, each while its user types
    hints = _hints(stack, "hints", res.typing_hints)
    assert len(hints) == res.typing_hints and {h.source for h in hints} == {"http"}
    assert all(h.expected_arrival_s is None for h in hints)  # the default: no arrival time (test below)
    created = _check_conversations(_server_requests(stack, "hints"), res, with_ids=True)
    _check_hint_order(hints, created)
    assert _wait_session_turns(stack, turns_before + len(res.records)) == turns_before + len(res.records)
    _check_kv_reused(res)


def test_a_hint_can_say_when_its_turn_will_arrive(stacks):
    """`--hint-arrival`: each hint carries its user's typing time (every prompt here is
    PROMPT_WORDS long, so TYPING_S), which the advisory adds to the placement's TTL; without
    the option hints name none (the test above)."""
    stack = stacks["default"]
    turns_before = _session_turns(stack)
    res = _run(stack.url, MODES["hints"], "arrive", hint_arrival=True)
    _check_records(res, "arrive")
    hints = _hints(stack, "arrive", SESSIONS * TURNS)
    assert len(hints) == SESSIONS * TURNS
    assert all(h.expected_arrival_s == pytest.approx(TYPING_S, rel=1e-3) for h in hints), hints
    # the next test counts its own turns on this stack: ours must all be counted first
    assert _wait_session_turns(stack, turns_before + len(res.records)) == turns_before + len(res.records)


def test_sticky_mode_sends_session_ids_and_no_hints(stacks):
    stack = stacks["default"]
    turns_before = _session_turns(stack)
    res = _run(stack.url, MODES["sticky"], "sticky")
    _check_records(res, "sticky")
    assert res.typing_hints == 0 and _hints(stack, "sticky", 0) == []
    _check_conversations(_server_requests(stack, "sticky"), res, with_ids=True)
    assert _wait_session_turns(stack, turns_before + len(res.records)) == turns_before + len(res.records)
    _check_kv_reused(res)


def test_recompute_mode_sends_neither_hints_nor_session_ids(stacks):
    stack = stacks["recompute"]
    res = _run(stack.url, MODES["recompute"], "recompute")
    _check_records(res, "recompute")
    assert res.typing_hints == 0
    assert asyncio.run(_read_topic(stack, Topics(stack.prefix).advisory.name, TypingHint.decode)) == []
    reqs = _server_requests(stack, "recompute")
    _check_conversations(reqs, res, with_ids=False)
    assert all(r.cached_tokens == 0 for r in res.records), [(r.request_id, r.cached_tokens) for r in res.records]
    # The worker's first heartbeat that reports the run's last turns finished (by the ids the
    # gateway gave them): any session turn of the run is counted in it.
    last = {r.request_id for r in reqs if _turn_of(r) == TURNS - 1}

    def reports_last(hb) -> bool:
        return last <= {key.rsplit(":", 1)[0] for key in hb.finished_ids}

    hb = asyncio.run(asyncio.wait_for(worker_heartbeat(stack, "w0", reports_last), 120))
    assert len(last) == SESSIONS and hb.session_stats.get("turns", 0) == 0, hb.session_stats
    assert _session_turns(stack) == 0
