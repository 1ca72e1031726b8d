"""Greedy outputs of our engine vs Hugging Face transformers on SmolLM2-135M (float32)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain in one sentence what a hash table is.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly and clearly, in a way a child would understand.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def hf_model(hf_default_model):
    return hf_default_model  # loaded once per session (tests/conftest.py)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    from engine import apply_chat_template

    return [apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(hf_model, prompt_ids):
    """Reference: plain greedy loop with HF's own KV cache, no EOS stopping."""
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            res = hf_model(x, use_cache=True)
            past, gen = res.past_key_values, []
            for _ in range(MAX_NEW):
                tok = int(res.logits[0, -1].argmax())
                gen.append(tok)
                res = hf_model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = res.past_key_values
            outs.append(gen)
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _llm(**kw) -> LLM:
    return LLM(EngineConfig(model="default", dtype="float32", **kw))


@pytest.fixture(scope="module")
def llm():
    return _llm(kv_cache_gib=0.25)


def test_capital_of_france(llm):
    out = llm.generate("What is the capital of France?", SamplingParams(temperature=0, max_tokens=30), chat=True)[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_one_at_a_time(llm, prompt_ids, hf_outputs):
    for ids, ref in zip(prompt_ids, hf_outputs):
        assert llm.generate([ids], GREEDY)[0].token_ids == ref


def test_all_at_once(llm, prompt_ids, hf_outputs):
    outs = llm.generate(prompt_ids, GREEDY)
    assert [o.token_ids for o in outs] == hf_outputs


def test_chunked_prefill(prompt_ids, hf_outputs):
    llm = _llm(kv_cache_gib=0.25, max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = llm.generate(prompt_ids, GREEDY)
    assert [o.token_ids for o in outs] == hf_outputs
    assert llm.engine.stats.steps > sum(map(len, prompt_ids)) // 16  # prompts really were split


def test_preemption_under_tiny_kv_pool(prompt_ids, hf_outputs):
    # 8 usable blocks of 16 tokens: enough for any single request, far too few for all six.
    llm = _llm(num_blocks=9, enable_prefix_caching=False)
    outs = llm.generate(prompt_ids, GREEDY)
    assert llm.engine.stats.preemptions > 0
    assert [o.token_ids for o in outs] == hf_outputs


def test_preemption_with_prefix_caching(prompt_ids, hf_outputs):
    llm = _llm(num_blocks=9, max_num_batched_tokens=32)
    outs = llm.generate(prompt_ids, GREEDY)
    assert llm.engine.stats.preemptions > 0
    assert [o.token_ids for o in outs] == hf_outputs
