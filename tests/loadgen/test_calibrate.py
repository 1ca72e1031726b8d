"""`--slo-scale auto` measures a 16-row decode step; an engine that cannot hold one says which
limit is in the way (it used to blame `max_num_seqs` even when the KV pool was the cause)."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine
from loadgen.calibrate import REF_BATCH, measure_engine_step_s


def _engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", max_num_batched_tokens=256, max_model_len=512)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


@pytest.mark.timeout(300)
def test_auto_scale_names_the_small_pool(tiny_model_dir):
    engine = _engine(tiny_model_dir("llama"), num_blocks=40, max_num_seqs=32)  # 640 tokens < 16 x 136
    with pytest.raises(ValueError, match=r"KV pool holding 16 x \d+ tokens at once \(it holds 6\d\d\)"):
        measure_engine_step_s(engine, rounds=1)


@pytest.mark.timeout(300)
def test_auto_scale_names_max_num_seqs_and_measures_when_both_fit(tiny_model_dir):
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match=r"max_num_seqs >= 16 \(it is 8\)"):
        measure_engine_step_s(_engine(path, num_blocks=256, max_num_seqs=8), rounds=1)
    assert measure_engine_step_s(_engine(path, num_blocks=256, max_num_seqs=REF_BATCH), rounds=1) > 0
