"""Prefix-cache isolation by cache salt (engine/kv/prefix_hash.py): requests share cached blocks
only with requests of the same salt; no salt is the shared cache, as before salts existed."""

from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv import BlockPool, KVCacheManager
from engine.kv.prefix_hash import hash_block, salt_root
from engine.scheduling import Request

BS = 16
PROMPT = [random.Random(7).randrange(100, 49000) for _ in range(70)]  # 4 full blocks + 6 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _committed(manager: KVCacheManager, rid: str, tokens: list[int], salt: str | None) -> Request:
    """A request whose whole prompt has been computed and published to the prefix cache."""
    req = Request(rid, tokens, SamplingParams(max_tokens=1), cache_salt=salt)
    assert manager.allocate(req, len(tokens))
    req.num_computed_tokens = len(tokens)
    manager.commit(req)
    return req


@pytest.mark.parametrize("first,second,hit", [(None, None, 64), ("a", "a", 64), ("a", "b", 0), ("a", None, 0)])
def test_match_prefix_only_within_a_salt(first, second, hit):
    manager = KVCacheManager(BlockPool(32), BS)
    _committed(manager, "r1", PROMPT, first)
    probe = Request("r2", PROMPT, SamplingParams(max_tokens=1), cache_salt=second)
    assert manager.match_prefix(probe)[1] == hit


def test_unsalted_hashes_are_unchanged_and_salted_chains_differ_from_the_first_block():
    assert salt_root(None) is None and salt_root("") is None
    manager = KVCacheManager(BlockPool(32), BS)
    plain = Request("p", PROMPT, SamplingParams(max_tokens=1))
    salted = Request("s", PROMPT, SamplingParams(max_tokens=1), cache_salt="tenant")
    expected_first = hash_block(None, PROMPT[:BS])  # what every hash was before salts existed
    assert manager.block_hashes(plain, 1) == [expected_first]
    salted_hashes = manager.block_hashes(salted, 4)
    assert salted_hashes[0] == hash_block(salt_root("tenant"), PROMPT[:BS]) != expected_first
    assert not set(salted_hashes) & set(manager.block_hashes(plain, 4))


@pytest.fixture
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", num_blocks=48, block_size=BS))


def _run(engine: LLMEngine, rid: str, salt: str | None):
    request = engine.add_request(rid, PROMPT, GREEDY, cache_salt=salt)
    while engine.has_unfinished():
        engine.step()
    return request


def test_engine_serves_cached_tokens_to_the_same_salt_only(engine):
    first = _run(engine, "a1", "tenant-a")
    assert first.num_cached_tokens == 0
    other = _run(engine, "b1", "tenant-b")
    assert other.num_cached_tokens == 0  # the same prompt, another tenant: computed afresh
    again = _run(engine, "a2", "tenant-a")
    assert again.num_cached_tokens == 64  # its own earlier prompt: every full block reused
    assert again.output_token_ids == first.output_token_ids == other.output_token_ids
    unsalted = [_run(engine, f"n{i}", None) for i in range(2)]
    assert [r.num_cached_tokens for r in unsalted] == [0, 64]  # no salt: one shared cache, as before
