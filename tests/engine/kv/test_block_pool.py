"""BlockPool and KVCacheManager: allocation, reference counts, LRU reuse, prefix matching."""

from __future__ import annotations

import pytest

from engine.kv import BlockPool, KVCacheManager
from engine.kv.block_pool import NoFreeBlocksError
from engine.sampling import SamplingParams
from engine.scheduling import Request


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    assert BlockPool.NULL_BLOCK_ID not in {b.block_id for b in blocks}
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_release_returns_blocks_and_lru_order():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.release([c, b, a])  # tail first: c is evicted first
    assert pool.num_free == 3
    assert [x.block_id for x in pool.allocate(3)] == [c.block_id, b.block_id, a.block_id]


def test_cached_block_revived_then_evicted_on_reuse():
    pool = BlockPool(3)
    (blk,) = pool.allocate(1)
    pool.register(blk, b"h1")
    pool.release([blk])
    assert pool.lookup(b"h1") is blk and pool.num_free == 2
    pool.acquire([blk])  # a prefix hit revives it
    assert blk.ref_count == 1 and pool.num_free == 1
    pool.release([blk])
    pool.allocate(2)  # needs every free block: the cached one is evicted
    assert pool.lookup(b"h1") is None and blk.block_hash is None


def test_manager_allocate_is_all_or_nothing():
    kv = KVCacheManager(BlockPool(4), block_size=4)
    r = _req("a", list(range(10)))
    assert not kv.allocate(r, 16)  # 4 blocks needed, 3 usable
    assert not kv.holds(r) and kv.pool.num_free == 3
    assert kv.allocate(r, 10)
    assert len(kv.table(r)) == 3 and kv.pool.num_free == 0


def test_prefix_match_and_sharing():
    kv = KVCacheManager(BlockPool(16), block_size=4)
    first = _req("a", list(range(13)))
    assert kv.allocate(first, 13)
    first.num_computed_tokens = 13
    kv.commit(first)  # 3 full blocks published
    second = _req("b", list(range(12)) + [99, 98])
    prefix, cached = kv.match_prefix(second)
    assert cached == 12 and [b.block_id for b in prefix] == kv.table(first).ids[:3]
    assert kv.allocate(second, 2, prefix)
    assert all(b.ref_count == 2 for b in prefix)
    kv.free(first)
    assert all(b.ref_count == 1 for b in prefix)


def test_prefix_match_leaves_one_token_to_compute():
    kv = KVCacheManager(BlockPool(8), block_size=4)
    r = _req("a", list(range(8)))
    kv.allocate(r, 8)
    r.num_computed_tokens = 8
    kv.commit(r)
    again = _req("b", list(range(8)))
    _, cached = kv.match_prefix(again)
    assert cached == 4  # not 8: the last token must run to produce logits


def test_disabled_caching_matches_nothing():
    kv = KVCacheManager(BlockPool(8, enable_caching=False), block_size=4)
    r = _req("a", list(range(8)))
    kv.allocate(r, 8)
    r.num_computed_tokens = 8
    kv.commit(r)
    assert kv.match_prefix(_req("b", list(range(9)))) == ([], 0)


def test_rolled_back_revivals_return_to_their_lru_places():
    """Prefix hits that revive free blocks, then a rollback (a failed grow, a BROS candidate):
    the free list is back in its old LRU order, not with the revived blocks at the MRU end,
    also when a revived block was released again before the rollback."""
    from engine.kv.host_pool import HostPool
    from engine.kv.ledger import KVLedger

    pool = BlockPool(6)
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks):
        pool.register(block, bytes([i]))
    pool.release(blocks)  # LRU order: blocks[0] first
    order = [b.block_id for b in pool._free.values()]
    ledger = KVLedger(pool, 4, 0, HostPool(0))
    mark = ledger.undo.mark()
    ledger.acquire([blocks[3]])
    ledger.acquire([blocks[1]])
    ledger.release(blocks[3])
    ledger.acquire([blocks[3]])
    ledger.undo.rollback(mark)
    ledger.undo.settle()
    assert [b.block_id for b in pool._free.values()] == order
    assert [b.block_id for b in pool.allocate(5)] == order
