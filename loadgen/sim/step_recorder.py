"""What a simulated worker did, step by step, summed up: batch sizes, HIDDEN rows, the K/V
rebuild (recompute) each step paid, time at the memory limit, preemptions and who took them.

Shared by `policy_trace` (one worker built by hand) and `probe_trace` (one probe of an
effective-throughput cell, built exactly as `tandem sim` builds it): both need the same "why"
behind an attainment, and only how the worker is built differs. It wraps the worker's
`start_step` and `add` (instance attributes: the simulator calls them through the worker), so it
changes no decision (tests/loadgen/test_probe_trace.py).
"""

from __future__ import annotations

import statistics


class StepRecorder:
    def __init__(self, worker) -> None:
        from engine.kv.hidden import CacheForm
        from loadgen.sim.step_time import hidden_context_tokens

        self.worker = worker
        self.steps: list[tuple] = []
        self.idle = 0  # schedules that ran nothing although the worker had work
        self.admitted: list = []  # every Request the worker made, for per-request preemption counts
        start_step, add, cost = worker.start_step, worker.add, worker.cost

        def logged(now: float):
            duration_s = start_step(now)
            if duration_s is None:
                self.idle += 1
                return None
            items = worker.batch.items
            waiting = worker.scheduler.waiting
            # the paper's "batch at its memory-bound limit" (§3): a request waits whose blocks are not free
            blocked = bool(waiting) and (
                worker.kv.blocks_needed(waiting[0], waiting[0].num_tokens) > worker.kv.pool.num_free
            )
            # the truth's price of this step's rebuild of HIDDEN rows' K/V (0 without HIDDEN rows)
            rebuild = cost.hidden_seconds(hidden_context_tokens(items), sum(it.num_new_tokens for it in items))
            self.steps.append(
                (
                    len(items),
                    all(it.num_new_tokens == 1 for it in items),
                    sum(1 for it in items if it.request.cache_form is CacheForm.HIDDEN),
                    duration_s,
                    worker.kv.pool.usage(),
                    rebuild,
                    blocked,
                )
            )
            return duration_s

        def recorded(req, arrival_time: float):
            self.admitted.append(add(req, arrival_time))
            return self.admitted[-1]

        worker.start_step, worker.add = logged, recorded

    def summary(self) -> dict:
        """The run's step statistics (the keys `policy_trace` has always written)."""
        steps = self.steps
        if not steps:
            return {"steps": 0}
        decode = [s for s in steps if s[1]]
        rows = sum(s[0] for s in steps)
        hidden_rows = sum(s[2] for s in steps)
        busy = sum(s[3] for s in steps)
        rebuild = [s[5] for s in steps]
        p = self.worker.scheduler.policy
        return {
            "num_blocks": self.worker.spec.num_blocks,
            "max_num_seqs": self.worker.spec.max_num_seqs,
            "steps": len(steps),
            "prefill_steps": len(steps) - len(decode),
            "mean_batch": statistics.mean(s[0] for s in steps),
            "mean_decode_batch": statistics.mean(s[0] for s in decode) if decode else 0,
            "max_batch": max(s[0] for s in steps),
            "mean_step_s": statistics.mean(s[3] for s in steps),
            "mean_kv_usage": statistics.mean(s[4] for s in steps),
            "time_share_at_memory_limit": sum(s[3] for s in steps if s[6]) / busy if busy else 0.0,
            "hidden_rows": hidden_rows,
            "hidden_row_share": hidden_rows / rows if rows else 0.0,
            "steps_with_hidden": sum(1 for s in steps if s[2]),
            "preemptions": self.worker.stats.preemptions,  # conversions (free and re-prefill) included
            "conversions": getattr(p, "conversions", 0),
            "mean_rebuild_s_per_step": statistics.mean(rebuild),
            "mean_rebuild_s_per_rebuilding_step": _mean([r for r in rebuild if r > 0]),
            "rebuild_share_of_busy_time": sum(rebuild) / busy if busy else 0.0,
            "idle_schedules": self.idle,
            "rho_s_per_block": getattr(p, "rho", None),
        }


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None
