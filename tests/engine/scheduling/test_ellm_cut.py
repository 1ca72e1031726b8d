"""The twelfth session's cuts of the `ellm` decision's set-up decide the same (docs/ellm.md,
"Twelfth session"): the candidate list cut at the count the largest ratio admits
(`admissible`), checked against the count every ratio admits and against `choose` without the
cut on long queues, where it binds."""

from __future__ import annotations

import numpy as np
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
    top = admissible(s, bs, capacity)
    assert top == batch.max() == batch[-1]
    cut = s[: max(1, top)]
    need_cut = (-(-cut // bs) * bs)[None, :] - prefix_tokens(cut, bs)
    assert ((np.cumsum(need_cut, axis=1) <= capacity).sum(axis=1) == batch).all()


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
    bound = [admissible(np.array(a[0][: a[5]], dtype=np.int64), a[2], a[1]) for a, _ in calls]
    monkeypatch.setattr(ellm, "admissible", lambda s, bs, capacity: s.size)
    whole = [as_row(choose(*args, **kwargs)) for args, kwargs in calls]
    assert cut == whole
    dropped = sum(b < min(len(a[0]), a[5]) for b, (a, _) in zip(bound, calls))
    assert dropped > len(calls) / 2  # the cut does bind
    assert sum(c[1] > 0 for c in cut) > 10  # and the trace reaches r > 0
