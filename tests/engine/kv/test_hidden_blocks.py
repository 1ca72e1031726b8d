"""Hidden-state blocks (the hybrid cache's KV component): the memory ratio, the layout (every
stored chunk in its own unit of the pool, never one a KV request or another HIDDEN request
uses), allocation through the undo log, no prefix cache, no swapping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import ModelConfig
from engine.kv import BlockPool, KVCacheManager
from engine.kv.hidden import HiddenBlocks, HiddenLayout
from engine.sampling import SamplingParams
from engine.scheduling import CacheForm, Request

BS = 4


def _model(hidden: int, heads: int, kv_heads: int, head_dim: int | None = None, layers: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=100,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=2048,
    )


def _req(rid: str, form: CacheForm, n: int = 64) -> Request:
    r = Request(rid, list(range(1000, 1000 + n)), SamplingParams(max_tokens=4))
    r.cache_form = form
    return r


def _manager(layout: HiddenLayout, num_blocks: int, caching: bool = False) -> tuple[KVCacheManager, HiddenBlocks]:
    kv = KVCacheManager(BlockPool(num_blocks, enable_caching=caching), layout.block_size, host_blocks=4)
    return kv, kv.attach(HiddenBlocks.factory(layout))


def test_memory_ratio_is_derived_from_the_model():
    """T1: half of K+V for multi-head attention (OPT-13B: 409,600 vs 819,200 bytes per token in
    fp16); n_heads / (2 n_kv_heads) for GQA, which saves nothing (SmolLM2: 1.5)."""
    opt13b = _model(5120, 40, 40, layers=40)
    layout = HiddenLayout.of(opt13b, 16, 100)
    assert layout.ratio == 0.5 and layout.saves_memory
    kv_bytes = 2 * opt13b.num_layers * opt13b.num_kv_heads * opt13b.head_dim * 2
    assert (kv_bytes, layout.ratio * kv_bytes) == (819_200, 409_600)
    smollm2 = HiddenLayout.of(_model(576, 9, 3), 16, 100)
    assert smollm2.ratio == 1.5 and not smollm2.saves_memory
    assert HiddenLayout.of(_model(64, 4, 1), 16, 100).ratio == 2.0
    qwen3_like = HiddenLayout.of(_model(64, 4, 2, head_dim=32), 16, 100)  # q_size 128 != d 64
    assert qwen3_like.ratio == 0.5


def test_paper_figure_6_fits():
    """T3: 16 unit-blocks of 4 tokens (8 of our K+V blocks); an 11-token KV request takes 3
    blocks (6 units), a 14-token HIDDEN request 4 units, i.e. 2 blocks (MHA)."""
    layout = HiddenLayout.of(_model(64, 4, 4), BS, 9)  # 8 usable blocks + the null block
    kv, hidden = _manager(layout, 9)
    a, b = _req("A", CacheForm.KV, 11), _req("B", CacheForm.HIDDEN, 14)
    assert kv.allocate(a, 11) and kv.allocate(b, 14)
    assert kv.device_blocks(a) == 3 and kv.device_blocks(b) == 2
    assert kv.table(b).owner is hidden and kv.table(a).owner is None
    assert kv.pool.num_free == 8 - 5
    kv.check_invariants()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 4, 16), (4, 2, 16), (4, 1, 16), (4, 2, 32), (6, 2, 16)]
)
def test_rows_never_overlap_and_stay_inside_held_blocks(heads, kv_heads, head_dim):
    """Every (request, position, chunk) has its own row of the layer, inside a block that
    request holds; KV requests' slots are disjoint from all of them."""
    hidden_size = 64 if head_dim != 16 or heads != 6 else 96
    layout = HiddenLayout.of(_model(hidden_size, heads, kv_heads, head_dim), BS, 40)
    kv, _ = _manager(layout, 40)
    reqs = [_req(f"h{i}", CacheForm.HIDDEN, n) for i, n in enumerate((1, 7, 9, 13))]
    reqs += [_req("k0", CacheForm.KV, 10)]
    for r in reqs:
        assert kv.allocate(r, r.num_tokens)
    kv.check_invariants()
    seen: dict[int, tuple] = {}
    rows_per_block = 2 * kv_heads * BS  # rows of head_dim values in one block of one layer
    for r in reqs:
        table = kv.table(r)
        if r.cache_form is CacheForm.KV:
            for p in range(r.num_tokens):
                slot = table.slot(p, BS)
                for plane in range(2 * kv_heads):  # the K and V rows of every head of this slot
                    row = (plane * layout.num_blocks + slot // BS) * BS + slot % BS
                    assert seen.setdefault(row, (r.request_id, p)) == (r.request_id, p)
            continue
        held = torch.tensor([b.block_id for b in table.held])
        rows = layout.write_rows(held, torch.arange(r.num_tokens))
        assert rows.shape == (r.num_tokens, layout.chunks)
        for p, chunk_rows in enumerate(rows.tolist()):
            for j, row in enumerate(chunk_rows):
                assert seen.setdefault(row, (r.request_id, p, j)) == (r.request_id, p, j)
                block = (row // BS) % layout.num_blocks
                assert block in held.tolist()
    assert len(seen) <= 40 * rows_per_block


def test_hidden_requests_neither_take_nor_serve_prefix_hits():
    layout = HiddenLayout.of(_model(64, 4, 4), BS, 20)
    kv, _ = _manager(layout, 20, caching=True)
    first = _req("a", CacheForm.HIDDEN, 12)
    assert kv.allocate(first, 12)
    first.num_computed_tokens = 12
    kv.commit(first)
    assert kv.pool.lookup(kv.block_hashes(first, 1)[0]) is None  # nothing published
    kv_twin, hidden_twin = _req("b", CacheForm.KV, 12), _req("c", CacheForm.HIDDEN, 12)
    assert kv.match_prefix(kv_twin) == ([], 0)
    assert kv.allocate(kv_twin, 12)
    kv_twin.num_computed_tokens = 12
    kv.commit(kv_twin)
    assert kv.match_prefix(_req("d", CacheForm.KV, 12))[1] == 8  # K/V are served to KV requests...
    assert kv.match_prefix(hidden_twin) == ([], 0)  # ...never to HIDDEN ones
    kv.check_invariants()


def test_hidden_requests_are_never_swapped():
    layout = HiddenLayout.of(_model(64, 4, 4), BS, 20)
    kv, _ = _manager(layout, 20)
    r = _req("a", CacheForm.HIDDEN, 12)
    assert kv.allocate(r, 12)
    with pytest.raises(RuntimeError, match="never swapped"):
        kv.swap_out(r)
    kv.check_invariants()


_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "alloc", "free"]), st.integers(0, 4), st.integers(1, 11)),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    before=_ops,
    tentative=_ops,
    num_blocks=st.integers(3, 16),
    shape=st.sampled_from([(4, 4, 16), (4, 2, 16), (4, 1, 16), (4, 2, 32)]),
)
def test_mixed_allocations_roll_back_exactly(kv_fingerprint, before, tentative, num_blocks, shape):
    """HIDDEN and KV requests grow and free in one pool, all or nothing, with the invariants
    after every operation; everything after a mark rolls back exactly (held blocks included)."""
    heads, kv_heads, head_dim = shape
    layout = HiddenLayout.of(_model(64, heads, kv_heads, head_dim), BS, num_blocks)
    kv, _ = _manager(layout, num_blocks)
    forms = [CacheForm.HIDDEN, CacheForm.KV, CacheForm.HIDDEN, CacheForm.KV, CacheForm.HIDDEN]
    requests = [_req(f"r{i}", f) for i, f in enumerate(forms)]

    def apply(ops):
        for kind, i, n in ops:
            r = requests[i]
            if kind == "alloc" and r.num_computed_tokens + n <= r.num_tokens:
                free_before = kv.pool.num_free
                if kv.allocate(r, n):
                    r.num_computed_tokens += n
                else:
                    assert kv.pool.num_free == free_before  # all or nothing
            elif kind == "free":
                kv.free(r)
                r.num_computed_tokens = 0
            kv.check_invariants()

    apply(before)
    snapshot, progress = kv_fingerprint(kv), [r.num_computed_tokens for r in requests]
    mark = kv.undo.mark()
    apply(tentative)
    kv.undo.rollback(mark)
    kv.undo.settle()
    for r, n in zip(requests, progress):
        r.num_computed_tokens = n
    assert kv_fingerprint(kv) == snapshot
    kv.check_invariants()
