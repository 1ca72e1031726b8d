"""Rebuilt prefix rows priced honestly (eLLM, docs/ellm.md "Seventh session"): the profiler
measures what a step that rebuilds prefixes adds over the same batch fully resident
(`engine/prefix_profiling.py`, `CostModel.rebuild_step`), and the price the optimiser and the
simulator use for such a step (`CostModel.with_rebuilt_prefixes`) matches a step the profiler
times, within the fit's stated error. Judged on timings the test controls: the profiler's
clock is a counter that each real step (run on the tiny model, with the rebuilt rows the runner
really appends) advances by a known step-time law, so the result does not depend on the load."""

from __future__ import annotations

from dataclasses import replace

from engine import EngineConfig, LLMEngine, profiling
from engine.cost_model import CostModel, PhaseFit
from engine.prefix_profiling import _PrefixBench, measure_rebuild_step, rebuild_grid
from engine.rebuilt_prefix import rebuilt_rows

# the law: a resident decode step, and what rebuilt rows add (off the compiled path: a fixed
# part and a part per row, besides their prefill work per token and per query-key pair)
BASE_S, PER_DECODE_S, PER_CONTEXT_S = 0.02, 1e-4, 1e-7
OFF_GRAPH_S, PER_ROW_S, PER_TOKEN_S, PER_PAIR_S = 0.015, 0.004, 2e-4, 3e-7
NOISE_S = 0.0005  # what "the machine" adds now and then (a timing only ever grows)


class LawClock:
    """A clock that the wrapped `execute` advances by the law (plus a deterministic bump on
    some calls); reads in between do not move it."""

    def __init__(self, kv) -> None:
        self.kv, self.now, self.calls = kv, 0.0, 0

    def __call__(self) -> float:
        return self.now

    def step(self, items) -> None:
        rebuilt = rebuilt_rows(items, self.kv)
        contexts = sum(it.request.num_computed_tokens + it.num_new_tokens for it in items)
        t = BASE_S + PER_DECODE_S * len(items) + PER_CONTEXT_S * contexts
        if rebuilt:
            u = [n for n, _ in rebuilt]
            t += OFF_GRAPH_S + PER_ROW_S * len(u) + PER_TOKEN_S * sum(u) + PER_PAIR_S * sum(x * x for x in u)
        self.calls += 1
        self.now += t + (NOISE_S if self.calls % 3 == 0 else 0.0)


def test_rebuilt_row_step_is_priced_within_the_fits_error(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            dtype="float32",
            num_blocks=96,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            max_model_len=512,
            num_threads=1,
        )
    )
    real = engine.profile_target()
    clock = LawClock(real.kv)

    def execute(items):
        out = real.execute(items)  # the real step: the rebuilt rows run through the tiny model
        clock.step(items)
        return out

    target = profiling.ProfileTarget(**{**real.__dict__, "execute": execute})
    assert len(rebuild_grid(target)) >= 5
    fit, points = measure_rebuild_step(target, clock=clock)
    assert all(p.extra_s > OFF_GRAPH_S for p in points)  # every point really rebuilt its prefixes
    assert fit.error_s < NOISE_S  # the fit's stated error: its largest residual

    # a step off the grid, timed by the same profiler: 3 rows of 256 tokens rebuilding 64 each
    bench = _PrefixBench(target, clock)
    b, c, u = 3, 256, 64
    measured = min(bench.time_once(b, c, u, host=False) for _ in range(3)) - min(
        bench.time_once(b, c, 0, host=False) for _ in range(3)
    )
    # the price the optimiser and the simulator give it, from a model with that fit
    prefill = PhaseFit(PER_TOKEN_S, PER_PAIR_S, 0.0)  # the rebuilt rows' own prefill work, as prefill rows
    decode = PhaseFit(PER_DECODE_S, 0.0, BASE_S)
    model = CostModel(prefill, decode, 1e9, rebuild_step=fit)
    d_work = b * (c + 1)
    priced = model.with_rebuilt_prefixes(0, 0, b, d_work, b, b * u, b * u * u) - model.exec_seconds(0, 0, b, d_work)
    assert abs(priced - measured) <= fit.error_s + 1e-9, (priced, measured, fit)
    # without the fit the rows are priced as prefill rows, which misses the off-graph part
    as_prefill = replace(model, rebuild_step=None)
    old = as_prefill.with_rebuilt_prefixes(0, 0, b, d_work, b, b * u, b * u * u) - as_prefill.exec_seconds(
        0, 0, b, d_work
    )
    assert measured - old > OFF_GRAPH_S
