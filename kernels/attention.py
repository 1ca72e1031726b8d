"""Paged attention: the contract between the model runner and the kernels.

The runner flattens a step's tokens into one batch ordered *decodes first, then prefill
chunks*. Everything that depends only on the batch (slot indices, masks) is built once per
step in `AttentionMetadata` and reused by every layer, so per-layer work is only the math.

KV cache layout, per layer: one tensor `[2, num_kv_heads, num_blocks, block_size,
head_dim]` (K then V; head-major, so a gather of blocks is directly a per-head matrix). A
token's *slot* is `block_id * block_size + offset`. New tokens are written by slot; reads
go through per-sequence block lists built by the runner from block tables, plus a direction
bit per block (BROS): a *reversed* block holds logical offset o at in-block slot
`block_size - 1 - o` (a BE request filling from the right end). Gathers return keys in
logical order whatever the directions, so the attention math (and its floating-point
summation order) is the same as for forward blocks.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.compiled import decode as _compiled
from kernels.reference import attention as _ref
from kernels.reference import resident as _resident


@dataclass
class PrefillSpan:
    """One sequence with more than one new token in this step."""

    q_start: int  # first row of this sequence in the flattened batch
    q_len: int  # new tokens in this step
    ctx_len: int  # tokens already in the cache before this step
    block_ids: torch.Tensor | None  # [n] blocks holding all ctx_len + q_len tokens; None when ctx_len == 0
    reversed: torch.Tensor | None = None  # [n] bool direction bits; None when every block is forward


@dataclass
class TransientSpan:
    """A sequence whose oldest `prefix_len` tokens have no K/V in the pool (partial residency,
    `engine/kv/partial.py`): this step rebuilds them as extra rows `prefix_start ..` of the
    batch (positions 0 .. prefix_len-1, attended as a ctx-0 prefill span of their own), and
    its query rows attend those rows' K/V merged with its paged part
    (`kernels/reference/resident.py`). Its rows are in no decode bucket or prefill span."""

    q_start: int  # first row of the sequence's new tokens
    q_len: int
    ctx_len: int  # tokens before this step (the first new token's position)
    prefix_start: int  # first row of its rebuilt prefix in the flattened batch
    prefix_len: int  # rebuilt tokens (whole blocks)
    block_ids: torch.Tensor  # [n] the logical blocks of all ctx_len + q_len tokens (0 for empty entries)


@dataclass
class DecodeBucket:
    """Single-token sequences attended together: for the reference path, rows of similar
    context length padded to the longest; for the fused path, every decode row of the step
    (it cuts contexts into chunks itself, `chunks`)."""

    rows: torch.Tensor  # [B] rows of these sequences in the flattened batch
    block_table: torch.Tensor  # [B, max_blocks] blocks of each sequence's context (padded with 0)
    bias: torch.Tensor  # [B, 1, max_blocks * block_size] float32 additive mask: 0 valid, -inf padding
    reversed: torch.Tensor | None = None  # [B, max_blocks] bool direction bits; None when all forward
    _slot_bias: torch.Tensor | None = field(default=None, repr=False)
    _chunks: tuple[int, DecodeChunks] | None = field(default=None, repr=False)

    def chunks(self, width: int) -> DecodeChunks:
        """The bucket cut into chunks of `width` blocks (once per step; see DecodeChunks)."""
        if self._chunks is None or self._chunks[0] != width:
            self._chunks = (width, DecodeChunks.cut(self.block_table, self.slot_bias(), width))
        return self._chunks[1]

    def slot_bias(self) -> torch.Tensor:
        """`bias` in slot order (a reversed block's tokens sit at its far end), computed once
        per step for kernels that read blocks in place instead of gathering them."""
        if self.reversed is None:
            return self.bias
        if self._slot_bias is None:
            batch, _, width = self.bias.shape
            blocks = self.bias.view(batch, self.reversed.shape[1], -1)
            flip = self.reversed.unsqueeze(-1)
            self._slot_bias = torch.where(flip, blocks.flip(-1), blocks).view(batch, 1, width)
        return self._slot_bias


@dataclass(frozen=True)
class DecodeChunks:
    """Decode contexts cut into chunks of `width` blocks, for split-K kernels that attend
    chunks independently and combine each sequence's partial results."""

    table: torch.Tensor  # [C, width] blocks of each chunk (a sequence's last chunk padded with block 0)
    seq: torch.Tensor  # [C] bucket row each chunk belongs to
    bias: torch.Tensor  # [C, 1, width * block_size] float32 slot mask: 0 valid, -inf not
    seq_chunks: torch.Tensor  # [B, M] each row's chunk indices, padded with C (no chunk)

    @staticmethod
    def cut(block_table: torch.Tensor, slot_bias: torch.Tensor, width: int) -> DecodeChunks:
        rows, blocks = block_table.shape
        bs = slot_bias.shape[-1] // blocks
        per_row = -(-blocks // width)
        pad = per_row * width - blocks
        table = F.pad(block_table, (0, pad)).view(rows, per_row, width)
        bias = F.pad(slot_bias.view(rows, blocks * bs), (0, pad * bs), value=float("-inf"))
        bias = bias.view(rows, per_row, width * bs)
        used = (bias == 0).any(-1)  # [rows, per_row]: chunks holding at least one token
        count = int(used.sum())
        ids = torch.full((rows, per_row), count, dtype=torch.long, device=table.device)
        ids[used] = torch.arange(count, device=table.device)
        seq = torch.arange(rows, device=table.device).unsqueeze(1).expand(rows, per_row)[used]
        return DecodeChunks(table[used], seq, bias[used].unsqueeze(1), ids)


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by all layers."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    decode_buckets: list[DecodeBucket]
    prefills: list[PrefillSpan]
    scale: float
    # Called with the layer index before each layer's attention while KV for this batch is
    # still being loaded layer by layer (session promotion); None otherwise.
    wait_layer: Callable[[int], None] | None = None
    # How decode buckets are attended: "reference" gathers blocks then matmuls (the CPU path
    # and the GPU kernels' reference); "fused" is kernels/compiled/decode.py; "triton" runs
    # decodes *and* prefills through kernels/triton (CUDA, or CPU under the interpreter).
    decode_kernel: str = "reference"
    # What a kernel derives from the fields above on the step's first layer and reuses in
    # every later one (kernels/triton/plan.py), keyed by the kernel and model shape.
    prepared: dict = field(default_factory=dict, repr=False)
    # Partially resident sequences (eLLM) and the rows of their rebuilt prefixes; empty otherwise.
    transient: list[TransientSpan] = field(default_factory=list)


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) at their slots."""
    write_kv_cache_layers(kv_cache.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), slot_mapping)


def write_kv_cache_layers(kv_data: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Every layer at once: kv_data is the whole cache `[layers, 2, kv_heads, blocks, block_size,
    head_dim]`, k and v are `[layers, T, kv_heads, head_dim]` (a compiled decode step's output)."""
    if kv_data.is_cuda and _triton_installed():
        _triton().write_kv_cache_layers(kv_data, k, v, slot_mapping)
    else:
        _ref.write_kv_cache_layers(kv_data, k, v, slot_mapping)


def decode_attention_with_new(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    chunks: tuple[torch.Tensor, ...],
    scale: float,
) -> torch.Tensor:
    """Decode attention for tracing inside a compiled layer: one query row per sequence (q
    [S, heads, D]) over its cached context, given as `kernels.compiled.decode.graph_chunks`
    of a bucket whose lengths exclude this step's token, plus that token's own k, v ([S,
    kv_heads, D], not in the cache). Returns [S, heads, D]."""
    return _compiled.decode_with_new_math(q, k, v, kv_cache, *chunks, scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached and new tokens.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (already written to the cache).
    Returns [T, heads, head_dim]. Heads are grouped as in Hugging Face's `repeat_kv`:
    query head h reads KV head h // (heads // kv_heads).
    """
    if meta.decode_kernel == "triton":
        out = _triton().paged_attention(q, k, v, kv_cache, meta)
    elif meta.decode_kernel == "fused":
        out = _ref.paged_attention(q, k, v, kv_cache, meta, decode=_compiled.decode)
    else:
        out = _ref.paged_attention(q, k, v, kv_cache, meta)
    if meta.transient:  # partial residency: rebuilt prefix + paged part, merged (reference on every device)
        _resident.attend_transient(out, q, k, v, kv_cache, meta.transient, meta.scale)
    return out


# -- dispatch by device -------------------------------------------------------------------
# CUDA tensors go to the Triton kernels: the KV write always where Triton is installed (it
# has no metadata to say otherwise), attention when the engine resolved its kernel to
# "triton" (`attention` auto on CUDA; "reference" keeps the PyTorch oracle on any device).
# CPU tensors take the paths above, and Triton only when forced (`attention="triton"` under
# TRITON_INTERPRET=1, for tests; the KV write then stays the reference's).


def triton_unavailable(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on `device` in this process, or None if they can."""
    if not _triton_installed():
        return "triton is not installed"
    return _triton().unavailable_reason(device)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton():
    """kernels.triton, imported on first use: Triton is a GPU (and test) dependency only."""
    from kernels import triton as triton_kernels

    return triton_kernels
