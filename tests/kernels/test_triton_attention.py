"""The Triton kernels (kernels/triton) under Triton's interpreter on CPU tensors, against the
PyTorch reference (the oracle) and float64 dense attention over the logical keys.

Edge cases: partial blocks, one-token contexts and prompts, BROS reversed blocks, table
padding and holes that must not be read (every slot outside the sequences is NaN, so one
stray read poisons the output), GQA groups 1/3/8, head dims 64 and 128, float32 and
bfloat16, one split and several (the log-sum-exp merge), mixed decode + prefill steps,
and the Hopper tile sizes (run here by the interpreter, so their shapes are valid).

Tolerances: float32 within 2e-5 of the reference and of float64 (the kernels accumulate in
float32 in another order); bfloat16 within 2e-2 (inputs and output rounded to 8 bits, as in
the compiled kernel's tests).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels.attention import AttentionMetadata, DecodeBucket, PrefillSpan
from kernels.reference import attention as reference

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class Kernels:
    """The Triton kernels on the session's kernel device (CPU under the interpreter, or CUDA):
    inputs made on the CPU are moved there and results come back to the CPU."""

    def __init__(self, module, device: str) -> None:
        self.module, self.device = module, device

    def attention(self, q, k, v, cache, meta, tiles):
        on = self._to_device
        meta = dataclasses.replace(
            meta,
            slot_mapping=on(meta.slot_mapping),
            decode_buckets=[
                DecodeBucket(on(b.rows), on(b.block_table), on(b.bias), on(b.reversed)) for b in meta.decode_buckets
            ],
            prefills=[
                dataclasses.replace(s, block_ids=on(s.block_ids), reversed=on(s.reversed)) for s in meta.prefills
            ],
            prepared={},
        )
        return self.module.paged_attention(on(q), on(k), on(v), on(cache), meta, tiles).cpu(), meta

    def write(self, data, k, v, slots):
        data = self._to_device(data)
        self.module.write_kv_cache_layers(data, self._to_device(k), self._to_device(v), self._to_device(slots))
        return data.cpu()

    def _to_device(self, t):
        return None if t is None else t.to(self.device)


@pytest.fixture(scope="module")
def tk(triton_kernels, kernel_device):
    return Kernels(triton_kernels, kernel_device)


def _tiles(tk, kind: str):
    from kernels.triton import tiles

    if kind == "one-split":
        return dataclasses.replace(tiles.INTERPRETER, target_programs=1)
    if kind == "splits":  # as many splits as the contexts allow, up to 3
        return dataclasses.replace(tiles.INTERPRETER, target_programs=10**6, max_splits=3)
    if kind == "hopper":
        return tiles.hopper(multiprocessors=132)
    raise ValueError(kind)


class Paged:
    """Sequences' logical K/V placed in random blocks of a cache whose every other slot is NaN
    (`poisoned`) or zero (`clean`, for the reference, which reads whole blocks). Block b of
    sequence i is reversed (BROS) when i + b is odd."""

    def __init__(self, kv_heads, head_dim, block_size, lengths, dtype, *, holes=(), seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        width = max(1, max(-(-n // block_size) for n in lengths))
        num_blocks = 1 + sum(-(-n // block_size) for n in lengths) + 3
        shape = (2, kv_heads, num_blocks, block_size, head_dim)
        self.clean = torch.zeros(shape, dtype=dtype)
        self.poisoned = torch.full(shape, float("nan"), dtype=dtype)
        free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.table = torch.zeros(len(lengths), width, dtype=torch.long)  # padding -> null block 0 (NaN)
        self.rev = torch.zeros(len(lengths), width, dtype=torch.bool)
        self.logical, self.visible = [], []
        for i, n in enumerate(lengths):
            kv = torch.randn(2, kv_heads, n, head_dim, generator=gen).to(dtype)
            self.logical.append(kv)
            keep = torch.ones(n, dtype=torch.bool)
            for b in range(-(-n // block_size)):
                block = free.pop()
                self.table[i, b] = block
                self.rev[i, b] = (i + b) % 2 == 1  # half the blocks, partial ones included, are reversed
                part = kv[:, :, b * block_size : (b + 1) * block_size]
                slots = torch.arange(part.shape[2])
                if self.rev[i, b]:
                    slots = block_size - 1 - slots
                for cache in (self.clean, self.poisoned):
                    cache[:, :, block, slots] = part
                if (i, b) in holes:  # a hole: the entry says "do not read"
                    self.table[i, b] = -1
                    keep[b * block_size : (b + 1) * block_size] = False
            self.visible.append(keep)

    def reversed_bits(self):
        return self.rev if self.rev.any() else None


def _dense(q, kv, visible, ctx_len, scale):
    """float64 attention of q rows ([n_q, heads, D], absolute positions ctx_len..) over the
    logical kv ([2, kv_heads, n, D]) with a causal mask and only `visible` keys."""
    k, v = kv.double()
    heads = q.shape[1]
    k, v = k.repeat_interleave(heads // k.shape[0], 0), v.repeat_interleave(heads // v.shape[0], 0)
    scores = torch.einsum("qhd,hkd->hqk", q.double(), k) * scale
    pos = torch.arange(kv.shape[2])
    rows = torch.arange(q.shape[0]).unsqueeze(1) + ctx_len
    mask = (pos.unsqueeze(0) <= rows) & visible.unsqueeze(0)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("hqk,hkd->qhd", probs, v)


def _decode_meta(paged, lengths, rows=None):
    valid = torch.arange(paged.table.shape[1] * paged.block_size) < torch.tensor(lengths).unsqueeze(1)
    bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf")).unsqueeze(1)
    rows = torch.arange(len(lengths)) if rows is None else rows
    return DecodeBucket(rows=rows, block_table=paged.table, bias=bias, reversed=paged.reversed_bits())


def _meta(buckets, spans, tokens, scale):
    return AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.long),
        decode_buckets=buckets,
        prefills=spans,
        scale=scale,
        decode_kernel="triton",
    )


def _close(got, expected, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), expected.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_matches_reference_and_dense(tk, dtype, head_dim, group):
    kv_heads = 2
    lengths = [1, 5, 8, 37, 50]  # one token, partial blocks, a whole block, several tiles
    paged = Paged(kv_heads, head_dim, 8, lengths, dtype, seed=group * head_dim)
    q = torch.randn(len(lengths), kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    bucket = _decode_meta(paged, lengths)
    tiles = _tiles(tk, "splits" if group != 3 else "one-split")  # both paths; splits also in the tests below
    got, _ = tk.attention(q, q, q, paged.poisoned, _meta([bucket], [], len(lengths), scale), tiles)
    assert got.dtype == dtype and not got.isnan().any()
    expected = reference.paged_attention(q, q, q, paged.clean, _meta([bucket], [], len(lengths), scale))
    _close(got, expected, dtype)
    for i, n in enumerate(lengths):
        _close(got[i : i + 1], _dense(q[i : i + 1], paged.logical[i], paged.visible[i], n - 1, scale), dtype)


def test_decode_splits_are_used_and_merge_exactly(tk):
    """The split path must really split (several partials per row), and agree with one split."""
    from kernels.triton.plan import step_plan

    lengths = [100, 3, 64]
    paged = Paged(2, 64, 4, lengths, torch.float32, seed=5)
    q = torch.randn(3, 6, 64)
    bucket = _decode_meta(paged, lengths)
    got, many = tk.attention(q, q, q, paged.poisoned, _meta([bucket], [], 3, 0.125), _tiles(tk, "splits"))
    plan = step_plan(many, 6, 2, 64, 4, _tiles(tk, "splits"))
    assert plan.decodes[0].splits == 3
    one, _ = tk.attention(q, q, q, paged.poisoned, _meta([bucket], [], 3, 0.125), _tiles(tk, "one-split"))
    torch.testing.assert_close(got, one, atol=1e-6, rtol=1e-6)


def test_holes_and_padding_are_never_read(tk):
    """Negative table entries (holes) drop their block's tokens from the softmax; padding past
    a row's length points at the NaN-filled null block and must not be touched."""
    lengths = [30, 17, 9]
    holes = {(0, 1), (1, 0)}
    paged = Paged(2, 64, 8, lengths, torch.float32, holes=holes, seed=11)
    q = torch.randn(3, 4, 64)
    bucket = _decode_meta(paged, lengths)
    for tiles in ("one-split", "splits"):
        got, _ = tk.attention(q, q, q, paged.poisoned, _meta([bucket], [], 3, 0.125), _tiles(tk, tiles))
        assert not got.isnan().any()
        for i, n in enumerate(lengths):
            _close(
                got[i : i + 1], _dense(q[i : i + 1], paged.logical[i], paged.visible[i], n - 1, 0.125), torch.float32
            )


def _prefill_case(kv_heads, group, head_dim, dtype, contexts, new_tokens, decode_lengths, seed, holes=()):
    """A mixed step, rows ordered like the runner's: decode rows first, then prefill spans.
    Each span's context + new tokens are in the cache (the model writes before it attends)."""
    lengths = [c + n for c, n in zip(contexts, new_tokens)]
    paged = Paged(kv_heads, head_dim, 8, decode_lengths + lengths, dtype, holes=holes, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = len(decode_lengths) + sum(new_tokens)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.empty(tokens, kv_heads, head_dim, dtype=dtype)
    v = torch.empty_like(k)
    n_dec = len(decode_lengths)
    bucket = DecodeBucket(
        rows=torch.arange(n_dec),
        block_table=paged.table[:n_dec],
        bias=_decode_meta(paged, decode_lengths + [0] * len(lengths)).bias[:n_dec],
        reversed=None if paged.reversed_bits() is None else paged.rev[:n_dec],
    )
    spans, row = [], n_dec
    for j, (ctx, n) in enumerate(zip(contexts, new_tokens)):
        i = n_dec + j
        k[row : row + n], v[row : row + n] = (
            paged.logical[i][0, :, ctx:].transpose(0, 1),
            paged.logical[i][1, :, ctx:].transpose(0, 1),
        )
        blocks = -(-(ctx + n) // 8)
        spans.append(
            PrefillSpan(
                q_start=row,
                q_len=n,
                ctx_len=ctx,
                block_ids=paged.table[i, :blocks] if ctx else None,
                reversed=paged.rev[i, :blocks] if ctx and paged.rev[i, :blocks].any() else None,
            )
        )
        row += n
    return paged, q, k, v, [bucket] if n_dec else [], spans


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_with_cached_prefix_matches_reference_and_dense(tk, dtype, head_dim, group):
    contexts = [0, 0, 13, 16, 29]
    new_tokens = [1, 17, 2, 16, 9]  # a one-token prompt, a fresh prompt, chunks after a prefix
    paged, q, k, v, buckets, spans = _prefill_case(2, group, head_dim, dtype, contexts, new_tokens, [9, 33], group)
    scale = head_dim**-0.5
    got, _ = tk.attention(q, k, v, paged.poisoned, _meta(buckets, spans, q.shape[0], scale), _tiles(tk, "splits"))
    assert got.dtype == dtype and not got.isnan().any()
    expected = reference.paged_attention(q, k, v, paged.clean, _meta(buckets, spans, q.shape[0], scale))
    _close(got, expected, dtype)
    for j, span in enumerate(spans):
        i = len(buckets[0].rows) + j
        rows = slice(span.q_start, span.q_start + span.q_len)
        _close(got[rows], _dense(q[rows], paged.logical[i], paged.visible[i], span.ctx_len, scale), dtype)


def test_hopper_tiles_under_the_interpreter(tk):
    """The tile sizes chosen for the GPU, on shapes that cross their 32/64-token tiles."""
    dtype = torch.bfloat16
    paged, q, k, v, buckets, spans = _prefill_case(2, 4, 128, dtype, [0, 70], [70, 20], [1, 100], 7)
    scale = 128**-0.5
    got, _ = tk.attention(q, k, v, paged.poisoned, _meta(buckets, spans, q.shape[0], scale), _tiles(tk, "hopper"))
    expected = reference.paged_attention(q, k, v, paged.clean, _meta(buckets, spans, q.shape[0], scale))
    assert not got.isnan().any()
    _close(got, expected, dtype)


def test_prefill_skips_holes_in_its_prefix(tk):
    """A hole in a span's cached prefix: its block is never read and its tokens are left out."""
    paged, q, k, v, buckets, spans = _prefill_case(2, 3, 64, torch.float32, [20, 9], [6, 11], [], 4, holes={(0, 1)})
    assert paged.table[0, 1] == -1 and not paged.visible[0][8:16].any()
    got, _ = tk.attention(q, k, v, paged.poisoned, _meta(buckets, spans, q.shape[0], 0.125), _tiles(tk, "splits"))
    assert not got.isnan().any()
    for i, span in enumerate(spans):
        rows = slice(span.q_start, span.q_start + span.q_len)
        _close(got[rows], _dense(q[rows], paged.logical[i], paged.visible[i], span.ctx_len, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_matches_reference(tk, dtype):
    """Every layer in one launch; reversed-block slots; a negative slot writes nothing."""
    layers, kv_heads, blocks, bs, dim = 3, 3, 10, 4, 64
    gen = torch.Generator().manual_seed(3)
    data = torch.randn(layers, 2, kv_heads, blocks, bs, dim, generator=gen).to(dtype)
    slots = torch.tensor([5, 4 * 3 + 3, 4 * 3 + 2, 39, -1, 8])  # block 3 filled from its right end
    k = torch.randn(layers, 6, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(layers, 6, kv_heads, dim, generator=gen).to(dtype)
    expected = data.clone()
    keep = slots >= 0
    reference.write_kv_cache_layers(expected, k[:, keep], v[:, keep], slots[keep])
    assert torch.equal(tk.write(data, k, v, slots), expected)
    one = tk.write(data[1:2], k[1:2], v[1:2], slots)  # a single layer
    assert torch.equal(one[0], expected[1])


def test_kernels_refuse_a_device_they_cannot_run_on(tk):
    assert tk.module.unavailable_reason(tk.device) is None
    assert tk.module.unavailable_reason("meta") is not None
    if not torch.cuda.is_available():
        assert tk.module.unavailable_reason("cuda") == "no CUDA device"


def test_plan_is_built_once_per_step(tk):
    """Every layer reuses the first layer's plan (tables, tile list, split buffers)."""
    from kernels.triton.plan import step_plan

    paged, q, k, v, buckets, spans = _prefill_case(1, 2, 64, torch.float32, [8], [5], [3], 0)
    first, meta = tk.attention(q, k, v, paged.poisoned, _meta(buckets, spans, q.shape[0], 0.125), _tiles(tk, "splits"))
    plan = step_plan(meta, 2, 1, 64, 8, _tiles(tk, "splits"))
    cache = paged.poisoned.to(tk.device)
    on = tk._to_device
    second = tk.module.paged_attention(on(q), on(k), on(v), cache, meta, _tiles(tk, "splits")).cpu()
    assert step_plan(meta, 2, 1, 64, 8, _tiles(tk, "splits")) is plan and len(meta.prepared) == 1
    assert torch.equal(first, second) and math.isfinite(float(first.abs().sum()))
