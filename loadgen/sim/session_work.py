"""What a session workload asks of a worker, and the most a KV-reusing mode can gain from it.

Issue 20 asks why the simulator's hints mode carries ~2x recompute's users where Symphony
reports 8x. The answer is arithmetic on the workload and the profile, so this module computes it
from a run's own records (`results.json`'s `requests`) and the cost model that set its steps:

- `first_turn_share`: turns with no history (nothing to reuse). A closed loop starts every user
  on a fresh session, so short runs are dominated by first turns.
- `redundant_prefill_share`: the share of recompute's prefill tokens that are history (the
  paper: ">99%" on its trace; Fig. 6: ">50% once turns exceed 3").
- `prefill_ratio`: recompute's prefill tokens over a reusing mode's (history + new prompt over
  new prompt). With prefill-first scheduling (the paper's vLLM) decodes stall behind every
  prefill, so at equal TPOT the users carried scale by about this ratio.
- `work_ratio`: a turn's worker time with recompute over with reuse, at a saturated decode batch
  (`batch` sequences sharing each decode step): the bound on the users carried at saturation,
  where both modes are limited by total work. Each turn costs its prefill (`prefill` fit, one
  pass per turn) and its output tokens' share of decode steps (`decode` fit at the turn's mean
  context). Attention over the history costs the same whichever way the KV got there, so only
  the prefill differs.
- `marginal_ratio`: the same with the decode step's fixed cost left out, i.e. what one more
  user adds to the workers' time (a turn's prefill pass plus its output tokens' per-sequence
  decode cost, `alpha0 + alpha1 * context`). Near an idle worker every user stretches the
  decode stream by that amount, so this is the ratio of users the two modes carry at one TPOT
  bound a little over the unloaded step (the paper's "similar latency", +14%): the ceiling of
  the same-bound reading. Its limit for long histories is set by the GPU's balance of compute
  (the history's prefill) to bandwidth (the history's K/V read by every decode step of the
  answer): docs/sessions.md, "What stops hints at ~2x".

The ratios are upper bounds for the mode's gain: placement, copies and queueing only take from
them. The history of turn k is turn k-1's prompt plus its output (the driver resends the whole
conversation), so nothing here depends on the mode that produced the records.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

from engine.cost_model import CostModel


@dataclass
class SessionTally:
    """Running sums over completed session turns (the simulator keeps one; `tally_records`
    rebuilds one from a results file's records)."""

    turns: int = 0
    first_turns: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0  # prompt tokens beyond the history (what a reusing mode prefills)
    output_tokens: int = 0
    later_turns: int = 0
    later_history_tokens: int = 0

    def add(self, turn: int, prompt_tokens: int, output_tokens: int, history_tokens: int) -> None:
        history = max(0, min(history_tokens, prompt_tokens - 1))  # >= 1 prompt token is computed
        self.turns += 1
        self.first_turns += turn == 0
        self.prompt_tokens += prompt_tokens
        self.new_tokens += prompt_tokens - history
        self.output_tokens += output_tokens
        if turn > 0:
            self.later_turns += 1
            self.later_history_tokens += history


@dataclass(frozen=True)
class SessionWork:
    turns: int
    first_turn_share: float
    mean_prompt_tokens: float  # what recompute prefills per turn
    mean_new_tokens: float  # what a reusing mode prefills per turn (new prompt + last sampled token)
    mean_output_tokens: float
    mean_history_later_turns: float  # history per turn that has one (turn >= 1)
    redundant_prefill_share: float
    prefill_ratio: float
    work_ratio: float  # at `batch` sequences per decode step
    batch: int
    marginal_ratio: float  # per-user worker time, the decode step's fixed cost left out

    def to_dict(self) -> dict:
        return asdict(self)


def tally_records(records: list[dict]) -> SessionTally:
    """A tally from `results.json` records: turn k's history is turn k-1's prompt + output."""
    by_session: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in records:  # incomplete turns still carry the prompt the next turn extends
        if r.get("session_id"):
            by_session[r["session_id"]][r["turn"]] = r
    tally = SessionTally()
    for r in records:
        if not (r.get("session_id") and r.get("completed")):
            continue
        prev = by_session[r["session_id"]].get(r["turn"] - 1)
        history = prev["prompt_tokens"] + prev["output_tokens"] if prev is not None and r["turn"] > 0 else 0
        tally.add(r["turn"], r["prompt_tokens"], r["output_tokens"], history)
    return tally


def session_work(tally: SessionTally, cost: CostModel, batch: int = 128) -> SessionWork:
    """The workload's shape and the two bounds (module docstring) from a tally."""
    if tally.turns == 0:
        raise ValueError("no completed session turns to describe")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    n = tally.turns
    mean_prompt, mean_new = tally.prompt_tokens / n, tally.new_tokens / n
    mean_out = tally.output_tokens / n
    context = mean_prompt + mean_out / 2  # a decode step's mean context over the answer
    decode_s = mean_out * cost.decode.predict(batch, context) / batch
    # one more sequence in a decode step: its token and its K/V read, not the step's fixed cost
    marginal_decode_s = mean_out * (cost.decode.alpha0 + cost.decode.alpha1 * context)

    def turn_s(prefill_tokens: float, decode: float = decode_s) -> float:  # attention over the whole prompt
        return cost.prefill.predict(prefill_tokens, mean_prompt) + decode

    return SessionWork(
        turns=n,
        first_turn_share=tally.first_turns / n,
        mean_prompt_tokens=mean_prompt,
        mean_new_tokens=mean_new,
        mean_output_tokens=mean_out,
        mean_history_later_turns=tally.later_history_tokens / tally.later_turns if tally.later_turns else 0.0,
        redundant_prefill_share=1 - tally.new_tokens / tally.prompt_tokens,
        prefill_ratio=tally.prompt_tokens / tally.new_tokens,
        work_ratio=turn_s(mean_prompt) / turn_s(mean_new),
        batch=batch,
        marginal_ratio=turn_s(mean_prompt, marginal_decode_s) / turn_s(mean_new, marginal_decode_s),
    )
