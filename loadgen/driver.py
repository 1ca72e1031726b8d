"""Runs one workload against a step-driven target and records every request's token timeline.

The loop: submit what is due, let the target advance to the next due submission (or until
something finishes), record the tokens it produced, and feed completions back to the
closed-loop sources. Arrivals happen at their scheduled times even when the target was busy
in a step: the request's arrival time is the scheduled one, so queueing shows up in its TTFT.

End of a run: no new requests after `duration_s`; RT requests in flight are drained (at most
`drain_timeout_s`); BE requests still running then are aborted and count as not completed.
`stop_when(records, now)` (optional) ends the run early the same way once it returns True: an
effective-throughput probe whose answer is already decided (`loadgen.effective.MissBound`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loadgen.metrics import RequestRecord
from loadgen.prompts import PromptBuilder
from loadgen.targets.base import LoadSample, PreparedRequest, StepTarget, TokenEvent
from loadgen.workloads.build import Workload
from loadgen.workloads.sources import Source
from loadgen.workloads.spec import RequestSpec, Submission


@dataclass
class RunResult:
    records: list[RequestRecord]
    elapsed_s: float
    load: list[LoadSample] = field(default_factory=list)
    typing_hints: int = 0
    target: dict = field(default_factory=dict)
    stopped_early: bool = False  # `stop_when` ended it: open requests were aborted
    attainment_at_most: float | None = None  # when stopped early: the bound that stopped it


class Driver:
    def __init__(
        self,
        target: StepTarget,
        workload: Workload,
        prompts: PromptBuilder,
        *,
        drain_timeout_s: float | None = None,
        progress: bool = False,
        load_samples: int = 2000,
        stop_when: Callable[[Iterable[RequestRecord], float], bool] | None = None,
    ) -> None:
        self.target, self.workload, self.prompts = target, workload, prompts
        self.duration_s = workload.config.duration_s
        self.drain_timeout_s = max(30.0, self.duration_s) if drain_timeout_s is None else drain_timeout_s
        self.progress = progress
        self.stop_when, self.stopped_early = stop_when, False
        self.sample_every_s = self.duration_s / max(1, load_samples)
        self._due: list[tuple[float, int, Submission, Source | None]] = []
        self._hints: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._records: dict[str, RequestRecord] = {}
        self._owner: dict[str, tuple[Source, RequestSpec]] = {}
        self._open: set[str] = set()  # submitted, not finished
        self._history: dict[str, list[int]] = {}  # session id -> prompt + output ids so far
        self._prompt_ids: dict[str, list[int]] = {}
        self._output_ids: dict[str, list[int]] = {}
        self._load: list[LoadSample] = []
        self._hint_count = 0
        self._closing = False  # aborting at the end: sources must not refill
        self._open_rt = 0  # counters, not scans: the loop runs once per step
        self._done = 0

    def run(self) -> RunResult:
        for sub in self.workload.open_loop:
            self._push(sub, None)
        for src in self.workload.sources:
            for sub in src.start():
                self._push(sub, src)
        bar = _progress_bar(self.duration_s, self.progress)
        self.target.begin()
        try:
            self._loop(bar)
        finally:
            bar.close()
        elapsed = self.target.now()
        return RunResult(
            list(self._records.values()),
            elapsed,
            self._load,
            self._hint_count,
            self.target.describe(),
            self.stopped_early,
        )

    # -- the loop ------------------------------------------------------------------------

    def _loop(self, bar) -> None:
        hard_stop = self.duration_s + self.drain_timeout_s
        while True:
            now = self.target.now()
            self._submit_due(now)
            if self._finished(now, hard_stop):
                return
            events = self.target.advance(min(self._next_due(), hard_stop))
            for ev in events:
                self._on_event(ev)
            self._sample_load()
            if not bar.disable:
                bar.update(min(self.target.now(), self.duration_s) - bar.n)
                bar.set_postfix_str(f"done {self._done} open {len(self._open)}", refresh=False)

    def _finished(self, now: float, hard_stop: float) -> bool:
        """Due submissions at or past `duration_s` are never sent, so the run ends when the
        window is over and no RT request is in flight (or the drain timeout passed)."""
        if self.stop_when is not None and self.stop_when(self._records.values(), now):
            self.stopped_early, hard_stop = True, now
        if now >= hard_stop or (now >= self.duration_s and not self._rt_open()):
            self._closing = True
            for rid in list(self._open):  # BE past the window, or anything past the drain timeout
                self.target.abort(rid)
                self._close(rid, now, "abort")
            return True
        return not self._open and not self._due

    def _rt_open(self) -> bool:
        return self._open_rt > 0

    def _next_due(self) -> float:
        t = self._due[0][0] if self._due else math.inf
        return min(t, self._hints[0][0]) if self._hints else t

    def _submit_due(self, now: float) -> None:
        while self._hints and self._hints[0][0] <= now:
            _, _, session = heapq.heappop(self._hints)
            self.target.typing_hint(session)
            self._hint_count += 1
        while self._due and self._due[0][0] <= now:
            _, _, sub, src = heapq.heappop(self._due)
            if sub.at_s < self.duration_s:
                self._submit(sub, src)

    def _submit(self, sub: Submission, src: Source | None) -> None:
        spec = sub.spec
        history = self._history.get(spec.session_id) if spec.session_id else None
        ids = self.prompts.prompt(spec, history)
        self._records[spec.request_id] = RequestRecord(
            spec.request_id,
            spec.req_class,
            sub.at_s,
            len(ids),
            spec.max_tokens,
            spec.slo.ttft_s,
            spec.slo.tpot_s,
            spec.session_id,
            turn=spec.turn,
        )
        if src is not None:
            self._owner[spec.request_id] = (src, spec)
        if spec.session_id:
            self._prompt_ids[spec.request_id] = ids
            self._output_ids[spec.request_id] = []
        self._open.add(spec.request_id)
        self._open_rt += spec.req_class == "rt"
        try:
            self.target.submit(
                PreparedRequest(
                    spec.request_id,
                    spec.req_class,
                    ids,
                    spec.max_tokens,
                    sub.at_s,
                    spec.slo.ttft_s,
                    spec.slo.tpot_s,
                    spec.session_id,
                )
            )
        except ValueError as exc:  # the target can never serve it (too long for its KV, ...)
            self._records[spec.request_id].error = str(exc)
            self._close(spec.request_id, sub.at_s, "error")

    def _push(self, sub: Submission, src: Source | None) -> None:
        heapq.heappush(self._due, (sub.at_s, next(self._seq), sub, src))
        if sub.typing_at_s is not None and sub.spec.session_id:
            heapq.heappush(self._hints, (sub.typing_at_s, next(self._seq), sub.spec.session_id))

    # -- events --------------------------------------------------------------------------

    def _on_event(self, ev: TokenEvent) -> None:
        rec = self._records.get(ev.request_id)
        if rec is None or ev.request_id not in self._open:
            return
        rec.token_times_s.extend([ev.time_s] * len(ev.token_ids))
        rec.worker = ev.worker or rec.worker
        if ev.request_id in self._output_ids:
            self._output_ids[ev.request_id].extend(ev.token_ids)
        if ev.finished:
            self._close(ev.request_id, ev.time_s, ev.finish_reason or "length")

    def _close(self, rid: str, now: float, reason: str) -> None:
        rec = self._records[rid]
        if rid in self._open:
            self._open.discard(rid)
            self._open_rt -= rec.req_class == "rt"
        self._done += 1
        rec.finish_s, rec.finish_reason = now, reason
        if rec.session_id and reason not in ("abort", "error"):
            self._history[rec.session_id] = self._prompt_ids.pop(rid) + self._output_ids.pop(rid)
        owner = self._owner.pop(rid, None)
        if owner is None or self._closing:
            return
        src, spec = owner
        for sub in src.on_finish(spec, now, rec.output_tokens):
            self._push(sub, src)

    def _sample_load(self) -> None:
        if self._load and self.target.now() - self._load[-1].time_s < self.sample_every_s:
            return
        self._load.append(self.target.load())


def _progress_bar(total_s: float, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=round(total_s, 3),
        unit="s",
        desc="run",
        disable=not enabled,
        leave=False,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}] {postfix}",
    )
