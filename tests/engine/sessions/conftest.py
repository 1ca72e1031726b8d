"""Helpers for session tests: a tiny float32 Llama engine and a turn runner."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
BS = 16


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture
def make_engine(tiny_llama, tmp_path):
    """Factory: engine with a small pool (23 usable blocks of 16 tokens) and a disk tier in tmp_path."""
    engines = []

    def make(session_dir="default", **overrides) -> LLMEngine:
        if session_dir == "default":
            session_dir = str(tmp_path / "sessions")
        cfg = dict(
            model=tiny_llama,
            dtype="float32",
            num_blocks=24,
            block_size=BS,
            max_num_batched_tokens=512,
            session_dir=session_dir,
        )
        engine = LLMEngine(EngineConfig(**{**cfg, **overrides}))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.sessions.close()


def run(engine: LLMEngine, rid: str, prompt: list[int], session_id: str | None = None, params=GREEDY):
    """Run one request to completion; returns the finished Request."""
    request = engine.add_request(rid, prompt, params, session_id=session_id)
    while engine.has_unfinished():
        engine.step()
    return request


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def evict_device(engine: LLMEngine, session_id: str) -> None:
    """Run an unrelated request that takes every block of the pool: the session leaves the device."""
    run(engine, f"filler-{session_id}", tokens(360, seed=999), params=SamplingParams(temperature=0, max_tokens=2))
    info = engine.sessions.info(session_id)
    assert info is not None and "gpu" not in info.tiers, info


def assert_no_leaked_pins(engine: LLMEngine) -> None:
    engine.step()  # lets the store release pins whose requests were admitted
    engine.sessions.wait_loads()
    engine.step()
    assert engine.kv.pool.num_free == engine.kv.pool.capacity


PROMPT1 = tokens(40, seed=1)
NEW_MESSAGE = tokens(20, seed=2)
KEPT = (40 + GREEDY.max_tokens - 1) // BS * BS  # full blocks of turn 1 with KV: 48 tokens


def turn2_prompt(turn1) -> list[int]:
    return PROMPT1 + turn1.output_token_ids + NEW_MESSAGE


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Turn 1 and turn 2 recomputed from scratch (no session, no prefix cache)."""
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", num_blocks=24, enable_prefix_caching=False)
    )
    t1 = run(engine, "r1", PROMPT1)
    t2 = run(engine, "r2", turn2_prompt(t1))
    assert t2.num_cached_tokens == 0
    return t1.output_token_ids, t2.output_token_ids
