"""The simulator as a load-generator target: one or many `SimWorker`s on a virtual clock.

Placement sees what the scheduler service sees from telemetry (load, KV, each worker's own cost
model) plus what only the simulator knows exactly (prefill tokens queued, running context), and
for a session turn where its history is cached (the worker that served its last turn, and any
worker's prefix cache); `decisions` counts the policy's outcomes (`meets_slo`, ...). An RT
request no worker is predicted to serve in time is admitted on the best one (the scheduler's
`slo_overload=admit`).

Events are worker step completions and delayed arrivals (a session's KV travelling from the
worker that served its last turn). Requests are placed by the scheduler service's own
placement policy (`services.scheduler.placement`); a request the policy holds (no worker with
room, BE without RT headroom) is offered again whenever a step ends. When placement moves a
session to another worker and a KV bandwidth is configured, the request arrives there after
`history bytes / bandwidth` seconds with its history in the new worker's prefix cache;
without a bandwidth the history is simply recomputed there.

With a `session_mode` (docs/sessions.md, "Symphony at its own scale") sessions' KV lives in
tiers between turns (each worker's device prefix cache and a host tier) and a `SessionRouter`
decides where a turn runs and what its KV costs to get there; typing hints then become
prefetch events (`hints` mode), and `kv_transfer_bytes_per_s` is the network's bandwidth.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass

from engine.cost_model import CostModel
from loadgen.sim.session_routing import SessionRouter
from loadgen.sim.session_tiers import GIB, CopyCosts
from loadgen.sim.session_work import SessionTally, session_work
from loadgen.sim.worker import SimWorker
from loadgen.targets.base import LoadSample, PreparedRequest, StepTarget, TokenEvent
from services.scheduler.placement import PlacementPolicy, PlacementRequest, WorkerLoad, make_placement
from services.scheduler.slo_predict import PredictorSettings, SessionKV


@dataclass(frozen=True)
class ClusterSpec:
    # None: one worker takes every request directly (like the in-process engine, no scheduler
    # service in front); several workers use the scheduler's default, least-loaded
    placement: str | None = None
    kv_transfer_bytes_per_s: float | None = None  # None: a moved session recomputes its history
    # None: the plain path above; else one of `session_routing.SESSION_MODES`
    session_mode: str | None = None
    session_host_gib: float = 64.0  # host tier per worker (Symphony: 256 GB DRAM per 4 GPUs)
    pcie_bytes_per_s: float = 25e9
    disk_bytes_per_s: float = 0.0  # > 0: an inclusive disk tier per worker (Symphony's SSD)
    tally_from_s: float = 0.0  # `session_work` counts turns arriving from here on (the run's warm-up)


class SimTarget(StepTarget):
    name = "sim"

    def __init__(
        self, workers: list[SimWorker], spec: ClusterSpec = ClusterSpec(), planning_cost: CostModel | None = None
    ) -> None:
        """`planning_cost`: the cost model the workers' policies plan with (`sim/planning.py`);
        each worker's own `cost` is the truth that sets its step times."""
        if not workers:
            raise ValueError("the simulator needs at least one worker")
        self.workers = {w.worker_id: w for w in workers}
        self.spec = spec
        self.planning_cost = planning_cost
        name = spec.placement or ("least-loaded" if len(workers) > 1 else None)
        self.placement = _placement(name, spec) if name else None
        self.decisions: Counter[str] = Counter()
        self.clock = 0.0
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._held: list[PreparedRequest] = []
        self._where: dict[str, str] = {}  # request id -> worker id
        self._session_worker: dict[str, str] = {}
        self.transfers = 0
        self.transferred_tokens = 0
        self.sessions = _session_router(spec, self.workers)
        self._turn_tokens: dict[str, tuple[str, list[int]]] = {}  # request id -> (session, prompt + output)
        # what the session workload asks (`session_work.py`): per turn, prompt and history sizes
        self._turn_prompt: dict[str, tuple[int, float]] = {}  # request id -> (prompt tokens, arrival)
        self._session_len: dict[str, int] = {}  # session -> prompt + output of its last finished turn
        self.session_tally = SessionTally()
        self.hints = 0

    # -- StepTarget ----------------------------------------------------------------------

    def begin(self) -> None:
        self.clock = 0.0

    def now(self) -> float:
        return self.clock

    def submit(self, request: PreparedRequest) -> None:
        self._check(request)
        if not self._place(request):
            self._held.append(request)

    def advance(self, until_s: float) -> list[TokenEvent]:
        """Start a step on every idle worker with work, then run events until one step ends
        (returning its tokens, as `LLMEngine.step` would) or the clock reaches `until_s`.

        Returning at every step end lets the driver submit what arrived during the step
        before the worker schedules its next one, exactly the engine's order.
        """
        for worker in self.workers.values():
            self._kick(worker)
        while self._events and self._events[0][0] <= until_s:
            t, _, kind, payload = heapq.heappop(self._events)
            self.clock = max(self.clock, t)
            if kind == "step":
                return self._step_done(payload)
            if kind == "prefetch":  # a hinted session's KV landed on its target
                self.sessions.prefetched(*payload, self.clock)
                continue
            self._arrive(*payload)  # a session's KV arrived from another worker
            self._kick(self.workers[payload[0]])
        if not math.isinf(until_s):
            self.clock = max(self.clock, until_s)
        return []

    def has_work(self) -> bool:
        return bool(self._events or self._held) or any(w.has_work() for w in self.workers.values())

    def typing_hint(self, session_id: str) -> None:
        """A user started typing: in `hints` mode the advisor picks the turn's worker now and the
        session's KV starts moving there."""
        self.hints += 1
        if self.sessions is None:
            return
        decision = self.sessions.on_hint(session_id, self.clock)
        if decision is not None:
            target, ready_s, history = decision
            self._push(ready_s, "prefetch", (target, session_id, history))

    def abort(self, request_id: str) -> None:
        self._turn_tokens.pop(request_id, None)
        self._turn_prompt.pop(request_id, None)
        self._held = [r for r in self._held if r.request_id != request_id]
        wid = self._where.pop(request_id, None)
        if wid is not None:
            self.workers[wid].abort(request_id, self.clock)

    def load(self) -> LoadSample:
        ws = list(self.workers.values())
        counts = [w.counts() for w in ws]
        return LoadSample(
            self.clock,
            sum(w.kv_usage() for w in ws) / len(ws),
            sum(c["running_rt"] + c["running_be"] for c in counts),
            sum(c["waiting_rt"] + c["waiting_be"] for c in counts) + len(self._held),
        )

    def describe(self) -> dict:
        ws = list(self.workers.values())
        return {
            "target": "sim",
            "workers": len(ws),
            "placement": self.placement.name if self.placement else "direct",
            "kv_transfer_bytes_per_s": self.spec.kv_transfer_bytes_per_s,
            "steps": sum(w.steps for w in ws),
            "busy_s": sum(w.busy_s for w in ws),
            "prompt_tokens_cached": sum(w.prompt_tokens_cached for w in ws),
            "recompute_tokens_cached": sum(w.recompute_tokens_cached for w in ws),
            "kv_transfers": self.transfers,
            "kv_transferred_tokens": self.transferred_tokens,
            "placement_decisions": dict(self.decisions),
            "cost_model": dict(ws[0].cost.meta),
            "planning_cost_model": None if self.planning_cost is None else self.planning_cost.to_dict(),
            "step_noise": ws[0].noise.describe() if ws[0].noise is not None else None,
            "host_blocks": ws[0].kv.host.num_blocks,
            "session_mode": self.spec.session_mode,
            "typing_hints": self.hints,
            "session_events": None if self.sessions is None else dict(self.sessions.counts),
            "session_work": self._session_work(),
            "session_host_evictions": None
            if self.sessions is None
            else sum(t.evictions for t in self.sessions.host.values()),
        }

    # -- internals -----------------------------------------------------------------------

    def _check(self, request: PreparedRequest) -> None:
        # every worker is alike: one that can never serve it fails the request up front
        next(iter(self.workers.values()))._validate(request)

    def _place(self, request: PreparedRequest) -> bool:
        preq = PlacementRequest(
            request.request_id,
            request.req_class,
            len(request.prompt_ids),
            request.session_id,
            # session modes route by load alone (Symphony's request-level balancing); the
            # plain path keeps the scheduler's holder preference
            None if self.sessions is not None else self._session_worker.get(request.session_id or ""),
            slo_ttft_s=request.slo_ttft_s,
            slo_tpot_s=request.slo_tpot_s,
            max_tokens=request.max_tokens,
            session_kv=self._session_kv(request),
        )
        if self.placement is None:
            wid = next(iter(self.workers))
        else:
            decision = self.placement.decide(preq, [self._load_of(w) for w in self.workers.values()])
            wid = decision.worker_id
            if wid is not None:
                outcome = {True: "meets_slo", False: "over_slo_admitted", None: "unpredicted"}[decision.meets_slo]
                self.decisions[f"{request.req_class}:{outcome}"] += 1
        if wid is None:
            return False
        if request.session_id:
            self._turn_tokens[request.request_id] = (request.session_id, list(request.prompt_ids))
            self._turn_prompt[request.request_id] = (len(request.prompt_ids), request.arrival_s)
        kv_tokens = None
        if self.sessions is not None:
            route = self.sessions.route(request.session_id, wid, self.clock)
            wid, delay, kv_tokens = route.worker_id, route.delay_s, route.kv_tokens
        else:
            delay = self._transfer_delay(request, wid)
        if delay > 0:
            self._push(self.clock + delay, "arrive", (wid, request, kv_tokens))
        else:
            self._arrive(wid, request, kv_tokens)
        return True

    def _transfer_delay(self, request: PreparedRequest, wid: str) -> float:
        prev = self._session_worker.get(request.session_id or "")
        bw = self.spec.kv_transfer_bytes_per_s
        if prev is None or prev == wid or not bw:
            return 0.0
        worker = self.workers[wid]
        history = request.prompt_ids[: len(request.prompt_ids) - 1]
        cached = worker.import_prefix(history)
        self.transfers += 1
        self.transferred_tokens += cached
        return cached * worker.spec.kv_bytes_per_token / bw

    def _arrive(self, wid: str, request: PreparedRequest, kv_tokens: list[int] | None = None) -> None:
        worker = self.workers[wid]
        if kv_tokens:  # the session's KV copied in (host tier or a peer) just now
            self.transfers += 1
            self.transferred_tokens += worker.import_prefix(kv_tokens)
        worker.add(request, request.arrival_s)
        self._where[request.request_id] = wid
        if request.session_id:
            self._session_worker[request.session_id] = wid

    def _kick(self, worker: SimWorker) -> None:
        if worker.busy or not worker.has_work():
            return
        duration = worker.start_step(self.clock)
        if duration is not None:
            self._push(self.clock + duration, "step", worker.worker_id)

    def _step_done(self, worker_id: str) -> list[TokenEvent]:
        events = self.workers[worker_id].finish_step()
        for ev in events:
            turn = self._turn_tokens.get(ev.request_id)
            if turn is not None:
                turn[1].extend(ev.token_ids)
            if ev.finished:
                self._where.pop(ev.request_id, None)
                self._turn_tokens.pop(ev.request_id, None)
                if turn is not None and ev.finish_reason != "abort":
                    self._tally_turn(ev.request_id, turn[0], len(turn[1]))
                if turn is not None and self.sessions is not None and ev.finish_reason != "abort":
                    self.sessions.on_finish(worker_id, turn[0], turn[1], self.clock)
        self._retry_held()
        return events

    def _retry_held(self) -> None:
        held, self._held = self._held, []
        for request in held:
            if not self._place(request):
                self._held.append(request)

    def _tally_turn(self, request_id: str, session_id: str, total_tokens: int) -> None:
        shape = self._turn_prompt.pop(request_id, None)
        if shape is None:
            return
        prompt, arrival_s = shape
        history = self._session_len.get(session_id)  # None: the session's first turn
        if arrival_s >= self.spec.tally_from_s:
            self.session_tally.add(0 if history is None else 1, prompt, total_tokens - prompt, history or 0)
        self._session_len[session_id] = total_tokens

    def _session_work(self) -> dict | None:
        if self.session_tally.turns == 0:
            return None
        cost = next(iter(self.workers.values())).cost
        return {f"batch_{b}": session_work(self.session_tally, cost, b).to_dict() for b in (8, 128)}

    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def _session_kv(self, request: PreparedRequest) -> SessionKV | None:
        """A session turn's history: where it was served last, and what each worker has cached
        (only computed for a policy that predicts: a prefix walk per worker per turn)."""
        prev = self._session_worker.get(request.session_id or "")
        if prev is None or self.placement is None or self.placement.name != "slo":
            return None
        history = request.prompt_ids[: len(request.prompt_ids) - 1]
        local = {wid: n for wid, w in self.workers.items() if (n := w.cached_prefix_tokens(history))}
        spec = self.workers[prev].spec
        return SessionKV(len(history), float(spec.kv_bytes_per_token), prev, local)

    def _load_of(self, w: SimWorker) -> WorkerLoad:
        return WorkerLoad(
            w.worker_id,
            kv_usage=w.kv_usage(),
            max_num_seqs=w.spec.max_num_seqs,
            cost=w.cost,
            kv_blocks=w.spec.num_blocks,
            block_size=w.spec.block_size,
            max_num_batched_tokens=w.spec.max_num_batched_tokens,
            mean_context_tokens=w.mean_context_tokens(),
            queued_prefill_tokens=w.queued_prefill_tokens(),
            **w.counts(),
        )


def _session_router(spec: ClusterSpec, workers: dict[str, SimWorker]) -> SessionRouter | None:
    if spec.session_mode is None:
        return None
    per_token = next(iter(workers.values())).spec.kv_bytes_per_token
    if per_token <= 0:
        raise ValueError("session modes need the profile's kv_bytes_per_token to price copies")
    net = spec.kv_transfer_bytes_per_s or CopyCosts(per_token).network_bytes_per_s
    costs = CopyCosts(per_token, spec.pcie_bytes_per_s, net, spec.disk_bytes_per_s)
    return SessionRouter(spec.session_mode, workers, costs, int(spec.session_host_gib * GIB))


def _placement(name: str, spec: ClusterSpec) -> PlacementPolicy:
    if name != "slo":
        return make_placement(name)
    return make_placement("slo", predictor=PredictorSettings(kv_transfer_bytes_per_s=spec.kv_transfer_bytes_per_s))
