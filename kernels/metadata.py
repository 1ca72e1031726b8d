"""The per-step inputs every attention kernel reads: the types shared by the runner and the kernels.

Kept apart from `kernels/attention.py` (which dispatches to the kernels) so that kernels
import these types directly and nothing imports back into the dispatcher: no import cycles.

The runner flattens a step's tokens into one batch ordered *decodes first, then prefill
chunks*. Everything that depends only on the batch (slot indices, masks) is built once per
step in `AttentionMetadata` and reused by every layer, so per-layer work is only the math.
Layout and slot conventions are described in `kernels/attention.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.hidden import HiddenBatch


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
    (`kernels/reference/resident.py`). Its rows are in no decode bucket or prefill span.

    With `from_host` the prefix is not rebuilt but kept in host memory: `prefix_start` is
    then its first row in `AttentionMetadata.host_prefix` (this layer's K/V, loaded from host
    before the layer), and the step has no rows for it."""

    q_start: int  # first row of the sequence's new tokens
    q_len: int
    ctx_len: int  # tokens before this step (the first new token's position)
    prefix_start: int  # first row of its rebuilt prefix in the flattened batch
    prefix_len: int  # rebuilt tokens (whole blocks)
    block_ids: torch.Tensor  # [n] the logical blocks of all ctx_len + q_len tokens (0 for empty entries)
    from_host: bool = False  # the prefix's K/V come from `AttentionMetadata.host_prefix`


@dataclass
class HostPrefixKV:
    """The current layer's K/V of every host-kept prefix of the step (eLLM's host source),
    spans' rows one after another (`TransientSpan.prefix_start`): filled before each layer by
    the runner's loader (`engine/rebuilt_prefix.py`), read by that layer's attention, replaced
    by the next layer's. A per-step scratch of one layer, not a cache."""

    keys: torch.Tensor | None = None  # [N, kv_heads, head_dim]
    values: torch.Tensor | None = None  # [N, kv_heads, head_dim]


@dataclass
class DecodeBucket:
    """Single-token sequences attended together: for the reference path, rows of similar
    context length padded to the longest; for the fused path, every decode row of the step
    (it cuts contexts into chunks itself, `chunks`)."""

    rows: torch.Tensor  # [B] rows of these sequences in the flattened batch
    block_table: torch.Tensor  # [B, max_blocks] blocks of each sequence's context (padded with 0)
    bias: torch.Tensor  # [B, 1, max_blocks * block_size] float32 additive mask: 0 valid, -inf padding
    reversed: torch.Tensor | None = None  # [B, max_blocks] bool direction bits; None when all forward
    lens: torch.Tensor | None = None  # [B] int64 context lengths (the valid part of `bias`); derived when None
    # `rows` as a slice when they are consecutive (the split-K kernels' one bucket: rows 0..B-1),
    # so every layer reads q and writes its output through views, not an index gather/scatter
    row_range: slice | None = None
    _slot_bias: torch.Tensor | None = field(default=None, repr=False)
    _chunks: tuple[int, DecodeChunks] | None = field(default=None, repr=False)
    prepared: dict = field(default_factory=dict, repr=False)  # what a kernel derives once per step

    def row_index(self) -> slice | torch.Tensor:
        """What selects this bucket's rows of the step's [T, ...] tensors: `row_range` if set
        (a view, no copy), else the index tensor `rows`."""
        return self.rows if self.row_range is None else self.row_range

    def covers(self, total_rows: int) -> bool:
        """Whether this bucket is rows 0..total_rows-1 in order: all of the step's rows."""
        r = self.row_range
        return r is not None and r.start == 0 and r.stop == total_rows

    def chunks(self, width: int) -> DecodeChunks:
        """The bucket cut into chunks of `width` blocks (once per step; see DecodeChunks)."""
        if self._chunks is None or self._chunks[0] != width:
            self._chunks = (width, DecodeChunks.cut(self.block_table, self.slot_bias(), width))
        return self._chunks[1]

    @property
    def block_size(self) -> int:
        return self.bias.shape[-1] // self.block_table.shape[1]

    def context_lens(self) -> torch.Tensor:
        """[B] int64 context length of each row (for kernels that take lengths, not masks)."""
        if self.lens is None:
            self.lens = (self.bias[:, 0] == 0).sum(-1)
        return self.lens

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
    # How decode buckets are attended: "reference" gathers blocks then matmuls (the oracle);
    # "fused" is kernels/compiled/decode.py; "cpp" is kernels/cpu/; "triton" runs decodes
    # *and* prefills through kernels/triton (CUDA, or CPU under the interpreter).
    decode_kernel: str = "reference"
    # What a kernel derives from the fields above on the step's first layer and reuses in
    # every later one (kernels/triton/plan.py), keyed by the kernel and model shape.
    prepared: dict = field(default_factory=dict, repr=False)
    # HIDDEN-form rows of the hybrid cache (kernels/hidden.py), attended by `hidden_attention`
    # after the paged attention; None when the step has none
    hidden: HiddenBatch | None = None
    # Partially resident sequences (eLLM) and the rows of their rebuilt prefixes; empty otherwise.
    transient: list[TransientSpan] = field(default_factory=list)
    # The current layer's K/V of the host-kept prefixes among `transient`; None when there are none.
    host_prefix: HostPrefixKV | None = None
