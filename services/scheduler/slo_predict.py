"""Predict the TTFT and TPOT one RT request would get on one worker (issue 21, "Place by SLO").

Pure arithmetic over what the scheduler knows: the worker's load (running and waiting
requests, KV use, its batching limits) and its own step-time profile (`engine/cost_model.py`,
published in its telemetry), the request's estimated size, and where the session's KV is.

The model, per worker (each step is one `CostModel.exec_seconds` call):

- **KV route** (session turns): the worker holds the newest copy (`local`: only the new
  turn's tokens are prefilled); a peer holds more (`transfer`: the missing tokens cross at
  `kv_transfer_bytes_per_s` before prefill, or `recompute`: they are prefilled here, whichever
  the profile says is faster, the same choice the worker makes on arrival, docs/sessions.md);
  `new` for a request without a session.
- **TTFT** = slot wait + transfer + chunked prefill of the tokens queued ahead of it plus its
  own uncached tokens. Queued work is every waiting request (RT and BE: the worker's engine
  policy may run FCFS, so counting BE is the conservative choice), each assumed as long as
  this one when the worker does not say (`queued_prefill_tokens`). Each chunk shares its step
  with one decode row per running request (the step's token budget minus those rows).
- **Slot wait**: when running + waiting + 1 exceeds `max_num_seqs`, the request waits for the
  excess to finish; a batch turns over about every `output_tokens` decode steps, so each
  excess request costs `output_tokens / max_num_seqs` decode steps.
- **TPOT** = one decode step with every running and waiting request plus this one (capped at
  `max_num_seqs`) at the worker's mean context. Future arrivals are not guessed.
- **KV room**: the request needs its uncached prompt plus its output in free blocks; a worker
  without that room would preempt or queue it (`kv_short`), which placement treats as a miss.

A worker that publishes no profile gets no prediction (`None`): the policy ranks it by load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.cost_model import CostModel
from services.scheduler.placement import PlacementRequest, WorkerLoad

KV_ROUTES = ("new", "local", "transfer", "recompute")


@dataclass(frozen=True)
class SessionKV:
    """Where a session's KV lives, as the scheduler's directory says."""

    history_tokens: int  # tokens of the newest copy (any live worker)
    bytes_per_token: float = 0.0  # of that copy (0: unknown, no transfer priced)
    holder: str | None = None  # the worker holding the newest copy
    local_tokens: Mapping[str, int] = field(default_factory=dict)  # worker id -> tokens of its own copy


@dataclass(frozen=True)
class SLOTarget:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Prediction:
    worker_id: str
    ttft_s: float
    tpot_s: float
    kv_route: str  # one of KV_ROUTES
    kv_short: bool  # not enough free KV for the request now

    def ratio(self, slo: SLOTarget) -> float:
        """The worse of predicted/target for TTFT and TPOT: <= 1 meets the SLO."""
        return max(self.ttft_s / slo.ttft_s, self.tpot_s / slo.tpot_s)

    def meets(self, slo: SLOTarget) -> bool:
        return not self.kv_short and self.ratio(slo) <= 1.0


@dataclass(frozen=True)
class PredictorSettings:
    assumed_output_tokens: int = 256  # when the request sets no max_tokens
    default_prompt_tokens: int = 256  # when the scheduler cannot estimate the prompt
    kv_transfer_bytes_per_s: float | None = None  # None: a moved session recomputes its history
    default_batch_tokens: int = 2048  # a worker that does not publish its step budget


class SLOPredictor:
    def __init__(self, settings: PredictorSettings | None = None) -> None:
        self.settings = settings or PredictorSettings()

    def predict(self, request: PlacementRequest, w: WorkerLoad, session: SessionKV | None) -> Prediction | None:
        """TTFT/TPOT of `request` on `w`, or None when `w` publishes no profile."""
        cost = w.cost
        if cost is None:
            return None
        prompt = request.num_prompt_tokens or self.settings.default_prompt_tokens
        output = request.max_tokens or self.settings.assumed_output_tokens
        route, uncached, transfer_s = self._kv_route(cost, w.worker_id, prompt, session)
        decode_rows = w.running_rt + w.running_be
        context = w.mean_context_tokens or (prompt + output / 2)
        queued_rows = w.waiting_rt + w.waiting_be
        batch = min(w.max_num_seqs, decode_rows + queued_rows + 1)
        tpot = cost.exec_seconds(0, 0, batch, batch * context)
        ahead = w.queued_prefill_tokens if w.queued_prefill_tokens is not None else queued_rows * prompt
        prefill_s = self._chunked_prefill(cost, w, ahead + uncached, decode_rows, prompt, context)
        excess = decode_rows + queued_rows + 1 - w.max_num_seqs
        slot_wait = max(0, excess) * output / max(1, w.max_num_seqs) * tpot
        free_tokens = (1.0 - w.kv_usage) * w.kv_blocks * w.block_size if w.kv_blocks else math.inf
        return Prediction(
            worker_id=w.worker_id,
            ttft_s=slot_wait + transfer_s + prefill_s,
            tpot_s=tpot,
            kv_route=route,
            kv_short=uncached + output > free_tokens,
        )

    def _kv_route(
        self, cost: CostModel, worker_id: str, prompt: int, session: SessionKV | None
    ) -> tuple[str, int, float]:
        """(route, tokens to prefill here, seconds of transfer before the prefill)."""
        if session is None or session.history_tokens <= 0:
            return "new", prompt, 0.0
        newest = min(session.history_tokens, prompt)
        local = min(session.local_tokens.get(worker_id, 0), newest)
        if local >= newest:
            return "local", prompt - local, 0.0
        missing = newest - local
        recompute_s = cost.prefill.predict(missing, local + missing / 2)
        bw = self.settings.kv_transfer_bytes_per_s
        if bw and session.bytes_per_token > 0 and session.holder not in (None, worker_id):
            transfer_s = missing * session.bytes_per_token / bw
            if transfer_s < recompute_s:
                return "transfer", prompt - newest, transfer_s
        return "recompute", prompt - local, 0.0

    def _chunked_prefill(
        self, cost: CostModel, w: WorkerLoad, tokens: int, decode_rows: int, prompt: int, context: float
    ) -> float:
        """Seconds to prefill `tokens` in chunks beside `decode_rows` decodes, one chunk per step."""
        if tokens <= 0:
            return 0.0
        budget = w.max_num_batched_tokens or self.settings.default_batch_tokens
        chunk = max(1, budget - decode_rows)
        steps = math.ceil(tokens / chunk)
        per_chunk = min(chunk, tokens)
        # a prefill token attends to, on average, half the prompt it belongs to
        step = cost.exec_seconds(per_chunk, per_chunk * prompt / 2, decode_rows, decode_rows * context)
        return steps * step
