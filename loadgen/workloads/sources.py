"""Closed-loop request sources: the next request depends on when the previous one finished.

Open-loop arrivals are a fixed list of submissions; these sources instead react to
completions. Each owns a generator seeded from (run seed, source index), and draws its
lengths in a fixed order, so the *sequence* of requests is the same for every policy or
target even though their submission times depend on how fast requests finish.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from loadgen.workloads.datasets import LengthProfile
from loadgen.workloads.spec import RequestSpec, Submission

WORDS_PER_TOKEN = 0.75  # English text: about 3/4 of a word per BPE token

# Symphony's chatbot regime: the hint (typing starts) comes 11.3 s before the request on
# average (paper §3.1, ShareGPT). At 40 wpm, ShareGPT's mean prompt (223 tokens, 167 words)
# takes 250 s to type, so a closed loop of 512 users sent a turn every ~290 s each (~1.45 req/s
# on 16 workers: the run issue 20 found idle). Most long ShareGPT prompts are pasted, not typed;
# this speed makes the mean lead 11.3 s on the `sharegpt` profile (223 * 0.75 / 11.3 * 60).
SYMPHONY_TYPING_WPM = 887.0


class Source(ABC):
    @abstractmethod
    def start(self) -> list[Submission]:
        """Submissions due at the start (times are absolute, seconds from the run's start)."""

    @abstractmethod
    def on_finish(self, spec: RequestSpec, finish_s: float, output_tokens: int) -> list[Submission]:
        """React to one of this source's requests finishing (or failing)."""


@dataclass(frozen=True)
class HumanSpeeds:
    reading_wpm: float = 250.0  # silent reading of screen text
    typing_wpm: float = 40.0  # average typist

    def reading_s(self, tokens: int) -> float:
        return tokens * WORDS_PER_TOKEN / self.reading_wpm * 60.0

    def typing_s(self, tokens: int) -> float:
        return tokens * WORDS_PER_TOKEN / self.typing_wpm * 60.0


class Session(Source):
    """A multi-turn chat: after each answer the user reads it, then types the next prompt.

    The typing hint goes out when typing starts; the request arrives when typing ends. The
    first turn's typing happens before the session's arrival time. Later turns resend the
    whole conversation (the target prepends the session's history), so the prompt grows.
    """

    def __init__(
        self,
        session_id: str,
        start_s: float,
        turns: int,
        profile: LengthProfile,
        speeds: HumanSpeeds,
        rng: np.random.Generator,
        stop_s: float,
        max_len: int | None,
    ) -> None:
        self.session_id, self.start_s, self.turns = session_id, start_s, turns
        self.profile, self.speeds, self.rng, self.stop_s, self.max_len = profile, speeds, rng, stop_s, max_len
        self.context = 0  # tokens of history so far (for the context limit)

    def start(self) -> list[Submission]:
        spec = self._turn(0)
        return [Submission(self.start_s, spec, max(0.0, self.start_s - self.speeds.typing_s(spec.prompt_len)))]

    def on_finish(self, spec: RequestSpec, finish_s: float, output_tokens: int) -> list[Submission]:
        self.context += spec.prompt_len + output_tokens
        if spec.turn + 1 >= self.turns:
            return []
        typing_at = finish_s + self.speeds.reading_s(output_tokens)
        nxt = self._turn(spec.turn + 1)
        at = typing_at + self.speeds.typing_s(nxt.prompt_len)
        if at >= self.stop_s or (self.max_len and self.context + nxt.prompt_len + nxt.max_tokens > self.max_len):
            return []
        return [Submission(at, nxt, typing_at)]

    def _turn(self, turn: int) -> RequestSpec:
        p, o = self.profile.sample_pair(self.rng, self.max_len)
        return RequestSpec(f"{self.session_id}-t{turn}", "rt", p, o, self.profile.slo, self.session_id, turn)


class SessionUser(Source):
    """One of a fixed number of concurrent chat users, holding one session at a time.

    When a session's last turn is answered the user reads it and starts a new session, so the
    number of live sessions stays at the user count (the closed-loop reading of Symphony's
    trace generator). Session k of user i is `u{i}-s{k}`. The user starts typing its first
    prompt at `start_s` (a ramp spreads users' starts so the first turns do not all arrive at once).
    """

    def __init__(
        self,
        user_id: str,
        turns_mean: float,
        profile: LengthProfile,
        speeds: HumanSpeeds,
        rng: np.random.Generator,
        stop_s: float,
        max_len: int | None,
        start_s: float = 0.0,
    ) -> None:
        self.user_id, self.turns_mean, self.profile, self.speeds = user_id, turns_mean, profile, speeds
        self.start_s = start_s
        self.rng, self.stop_s, self.max_len = rng, stop_s, max_len
        self.count = 0
        self.session: Session | None = None

    def start(self) -> list[Submission]:
        return self._new_session(self.start_s)

    def on_finish(self, spec: RequestSpec, finish_s: float, output_tokens: int) -> list[Submission]:
        out = self.session.on_finish(spec, finish_s, output_tokens)
        if out or finish_s >= self.stop_s:
            return out
        return self._new_session(finish_s + self.speeds.reading_s(output_tokens))

    def _new_session(self, at: float) -> list[Submission]:
        turns = int(self.rng.geometric(1.0 / self.turns_mean))
        sid = f"{self.user_id}-s{self.count}"
        self.count += 1
        self.session = Session(sid, at, turns, self.profile, self.speeds, self.rng, self.stop_s, self.max_len)
        spec = self.session.start()[0].spec
        sent = at + self.speeds.typing_s(spec.prompt_len)  # typing starts at `at`; the request follows it
        return [Submission(sent, spec, at)] if sent < self.stop_s else []


class ClosedUser(Source):
    """One of a fixed number of concurrent users: the next request goes out when the last returns."""

    def __init__(
        self,
        user_id: str,
        profile: LengthProfile,
        rng: np.random.Generator,
        stop_s: float,
        max_len: int | None,
        think_s: float = 0.0,
    ) -> None:
        self.user_id, self.profile, self.rng, self.stop_s = user_id, profile, rng, stop_s
        self.max_len, self.think_s, self.count = max_len, think_s, 0

    def start(self) -> list[Submission]:
        return [self._next(0.0)]

    def on_finish(self, spec: RequestSpec, finish_s: float, output_tokens: int) -> list[Submission]:
        at = finish_s + self.think_s
        return [self._next(at)] if at < self.stop_s else []

    def _next(self, at: float) -> Submission:
        p, o = self.profile.sample_pair(self.rng, self.max_len)
        spec = RequestSpec(f"{self.user_id}-{self.count}", self.profile.req_class, p, o, self.profile.slo)
        self.count += 1
        return Submission(at, spec)


class BEBacklog(Source):
    """A standing best-effort backlog, submitted in batches (BROS's setup, after FlexGen).

    ``refill="batch"``: a new batch of `batch_size` requests when the whole previous batch has
    finished (the paper's reading); ``refill="each"``: one new request per finished one, so
    exactly `batch_size` are always outstanding.
    """

    def __init__(
        self,
        profile: LengthProfile,
        batch_size: int,
        refill: str,
        rng: np.random.Generator,
        stop_s: float,
        max_len: int | None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"BE batch size must be >= 1, got {batch_size}")
        if refill not in ("batch", "each"):
            raise ValueError(f"BE refill must be 'batch' or 'each', got {refill!r}")
        self.profile, self.batch_size, self.refill, self.rng = profile, batch_size, refill, rng
        self.stop_s, self.max_len = stop_s, max_len
        self.outstanding = 0
        self.count = 0

    def start(self) -> list[Submission]:
        return self._batch(0.0, self.batch_size)

    def on_finish(self, spec: RequestSpec, finish_s: float, output_tokens: int) -> list[Submission]:
        self.outstanding -= 1
        if finish_s >= self.stop_s:
            return []
        if self.refill == "each":
            return self._batch(finish_s, 1)
        return self._batch(finish_s, self.batch_size) if self.outstanding == 0 else []

    def _batch(self, at: float, n: int) -> list[Submission]:
        out = []
        for _ in range(n):
            p, o = self.profile.sample_pair(self.rng, self.max_len)
            out.append(Submission(at, RequestSpec(f"be-{self.count}", "be", p, o, self.profile.slo)))
            self.count += 1
        self.outstanding += n
        return out
