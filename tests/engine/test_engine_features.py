"""Engine behaviour on the default model: prefix caching, sampling options, stops, errors,
and the asyncio API (streaming, abort)."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncLLM, EngineConfig, SamplingParams
from engine.loader import ModelLoadError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(EngineConfig(model="default", dtype="float32", kv_cache_gib=0.1))


def test_prefix_cache_computes_only_new_tokens(llm):
    system = "You are a meticulous assistant. " * 12
    first = llm.encode(system + "Name a fruit.")
    second = llm.encode(system + "Name a vegetable, please.")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 64
    llm.generate([first], GREEDY)
    before = llm.engine.stats.tokens_computed
    out = llm.generate([second], GREEDY)[0]
    computed = llm.engine.stats.tokens_computed - before
    cached = out.metrics.num_cached_tokens
    assert cached == shared // 16 * 16
    assert computed == len(second) - cached + GREEDY.max_tokens - 1  # prompt rest + decodes
    uncached = LLM(EngineConfig(model="default", dtype="float32", kv_cache_gib=0.1, enable_prefix_caching=False))
    assert uncached.generate([second], GREEDY)[0].token_ids == out.token_ids


def test_repeated_prompt_hits_cache(llm):
    ids = llm.encode("Tell me a story about a lighthouse keeper and a storm at sea.")
    a = llm.generate([ids], GREEDY)[0]
    b = llm.generate([ids], GREEDY)[0]
    assert b.metrics.num_cached_tokens == (len(ids) - 1) // 16 * 16 and a.token_ids == b.token_ids


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16)
    alone = llm.generate(["Once upon a time"], sp)[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = llm.generate(["Hello there", "Once upon a time", "Count to ten"], [noise, sp, noise])
    assert mixed[1].token_ids == alone


def test_stop_string_cuts_text(llm):
    out = llm.generate(
        "What is the capital of France?", SamplingParams(temperature=0, max_tokens=30, stop=["Paris"]), chat=True
    )[0]
    assert out.text == "The capital of France is " and out.finish_reason == "stop"


def test_stop_token_and_max_tokens(llm):
    ref = llm.generate("Count: one, two,", GREEDY)[0]
    stop_id = ref.token_ids[3]
    out = llm.generate("Count: one, two,", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == ref.token_ids[: ref.token_ids.index(stop_id) + 1] and out.finish_reason == "stop"
    assert ref.finish_reason == "length" and len(ref.token_ids) == 12


def test_logprobs(llm):
    out = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=5, logprobs=True))[0]
    assert len(out.logprobs) == 5 and all(lp <= 0 for lp in out.logprobs)


def test_min_tokens_suppresses_eos(llm):
    out = llm.generate(
        "What is the capital of France?", SamplingParams(temperature=0, max_tokens=20, min_tokens=15), chat=True
    )[0]
    assert len(out.token_ids) >= 15


def test_errors(llm):
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * 9000], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="KV"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=8000))
    with pytest.raises(ModelLoadError):
        LLM(EngineConfig(model="/no/such/model"))
    assert not llm.engine.has_unfinished()


def test_async_stream_matches_offline_and_abort_frees_kv(llm):
    prompt = llm.encode("Write two sentences about rivers.")
    sp = SamplingParams(temperature=0, max_tokens=24)
    expected = llm.generate([prompt], sp)[0].text

    async def main():
        engine = AsyncLLM(EngineConfig(model="default", dtype="float32", kv_cache_gib=0.1))
        await engine.start()
        try:
            text = "".join([d.text async for d in engine.generate("s1", prompt, sp)])
            pool = engine.engine.kv.pool
            agen = engine.generate("s2", prompt, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
            async for d in agen:
                if len(d.token_ids) and pool.num_free < pool.capacity:
                    break  # client goes away mid-stream
            await agen.aclose()
            held = pool.capacity - pool.num_free  # s2's blocks when the client left
            for _ in range(100):
                if not engine.engine.has_unfinished():
                    break
                await asyncio.sleep(0.05)
            freed = pool.num_free == pool.capacity  # every block back (cached ones count as free)
            with pytest.raises(ValueError):
                async for _ in engine.generate("bad", [], sp):
                    pass
            return text, engine.engine.has_unfinished(), held, freed
        finally:
            await engine.shutdown()

    text, unfinished, held, freed = asyncio.run(main())
    assert text == expected
    assert not unfinished
    assert held > 0 and freed
