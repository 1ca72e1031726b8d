"""The twelfth session's cuts of the `ellm` decision's set-up decide the same (docs/ellm.md,
"Twelfth session"): the candidate list cut at the count the largest ratio admits
(`admissible`), checked against the count every ratio admits and against `choose` without the
cut on long queues, where it binds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.scheduling import ellm
from engine.scheduling.ellm import choose
from engine.scheduling.ellm_admission import admissible, prefix_tokens
from tests.engine.scheduling.test_ellm_trace import PROFILE, as_row, trace_inputs


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 5000), min_size=1, max_size=60),
    st.sampled_from([1, 4, 16]),
    st.integers(0, 60_000),
)
def test_no_ratio_admits_more_than_the_largest(contexts, bs, capacity):
    """`admissible` is the largest count any ratio of the grid admits (the count `choose`
    takes per ratio: the resident blocks' cumulative need within the capacity), so cutting
    the candidates there changes no ratio's count."""
    s = np.array(contexts, dtype=np.int64)
    u = prefix_tokens(s, bs)
    need = (-(-s // bs) * bs)[None, :] - u
    batch = (np.cumsum(need, axis=1) <= capacity).sum(axis=1)
    top = admissible(need[-1], capacity)
    assert top == batch.max() == batch[-1]
    cut = s[: max(1, top)]
    need_cut = (-(-cut // bs) * bs)[None, :] - prefix_tokens(cut, bs)
    assert ((np.cumsum(need_cut, axis=1) <= capacity).sum(axis=1) == batch).all()


def _need_at_largest(contexts: list[int], bs: int) -> np.ndarray:
    s = np.array(contexts, dtype=np.int64)
    return -(-s // bs) * bs - prefix_tokens(s, bs)[-1]


def long_queues(n_calls: int = 150, seed: int = 12):
    """`trace_inputs`' calls with up to 256 candidates and pools holding a small share of
    them (the 16 req/s cell's queue), so that most candidates fit at no ratio."""
    rng = np.random.default_rng(seed)
    for args, kwargs in trace_inputs(n_calls, seed=seed):
        contexts, _, bs, cost, tpot, max_batch, sources = args
        extra = int(rng.integers(0, 256 - len(contexts) + 1))
        contexts = contexts + [int(c) for c in rng.integers(1, 600, extra)]  # prompts waiting
        finals = kwargs["final_contexts"] + [c + int(rng.integers(1, 2000)) for c in contexts[-extra:]][:extra]
        pending = kwargs["pending"] + contexts[len(kwargs["pending"]) :]
        capacity = int(sum(contexts) * rng.uniform(0.005, 0.1)) // 16 * 16
        yield (contexts, capacity, bs, cost, tpot, max_batch, sources), dict(
            kwargs, final_contexts=finals, pending=pending
        )


def test_the_cut_list_chooses_what_the_whole_list_chooses(monkeypatch):
    """`choose` with the candidate list cut at `admissible` makes the choice it makes over the
    whole list, to the bit, on long queues where the cut drops candidates on most calls."""
    if not PROFILE.is_file():
        return
    calls = list(long_queues())
    cut = [as_row(choose(*args, **kwargs)) for args, kwargs in calls]
    bound = [admissible(_need_at_largest(a[0][: a[5]], a[2]), a[1]) for a, _ in calls]
    monkeypatch.setattr(ellm, "admissible", lambda need, capacity: need.size)
    whole = [as_row(choose(*args, **kwargs)) for args, kwargs in calls]
    assert cut == whole
    dropped = sum(b < min(len(a[0]), a[5]) for b, (a, _) in zip(bound, calls))
    assert dropped > len(calls) / 2  # the cut does bind
    assert sum(c[1] > 0 for c in cut) > 10  # and the trace reaches r > 0


@pytest.mark.parametrize("capacity_blocks", [6, 20, 60])
def test_the_policy_reads_only_the_candidates_choose_keeps(capacity_blocks, monkeypatch):
    """`ELLMPolicy.schedule` stops reading candidates one past where the largest ratio's
    resident need passes the pool (`admissible`'s count, in Python integers): its choice and
    its batch are those of reading every candidate, with a queue long enough that it stops."""
    from collections import deque
    from dataclasses import replace

    from engine.cost_model import CostModel, PhaseFit
    from engine.kv import BlockPool, KVCacheManager
    from engine.sampling import SamplingParams
    from engine.scheduling import Request
    from engine.scheduling.ellm import ELLMPolicy
    from engine.scheduling.policy import BatchLimits, SchedulerState
    from engine.scheduling.request import SLO

    cost = CostModel(PhaseFit(2e-5, 1e-9, 0.01), PhaseFit(2e-4, 1e-8, 0.02), 1e9, {"model": "test"})

    def run(cut: bool) -> list:
        rng = np.random.default_rng(capacity_blocks)
        monkeypatch.setattr(ELLMPolicy, "cut_candidates", cut)
        policy = ELLMPolicy(cost, SLO(10.0, 1.0))
        kv = KVCacheManager(BlockPool(capacity_blocks + 1), 16)
        for component in policy.kv_components():
            kv.attach(component)
        lengths = rng.integers(5, 90, 120)
        requests = [
            Request(f"r{i}", list(range(int(n))), SamplingParams(max_tokens=int(rng.integers(1, 400))))
            for i, n in enumerate(lengths)
        ]
        state = SchedulerState(deque(requests), [], kv, BatchLimits(256, 512), 0.0)
        out = []
        for _ in range(6):  # admit, then decode with a growing running set
            batch = policy.schedule(state)
            for item in batch.items:
                item.request.num_computed_tokens += item.num_new_tokens
                if item.request.num_computed_tokens == item.request.num_tokens:
                    item.request.token_ids.append(7)
            items = [(i.request.request_id, i.num_new_tokens) for i in batch.items]
            out.append((replace(policy.last, decision_s=0, decision_cpu_s=0), items))
        return out

    cut = run(True)
    assert cut == run(False)
    assert sum(len(items) for _, items in cut) > 6  # it does admit and decode
