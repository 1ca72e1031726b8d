"""The KV cache tensors and their sizing from a memory budget."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import torch

from engine.config import ModelConfig
from engine.kv.copies import CopyKind, KVCopy
from engine.platform_tuning import empty_hugepage_tensor, no_hugepages

_GIB = 1 << 30


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


def num_blocks_for_budget(model: ModelConfig, block_size: int, dtype: torch.dtype, gib: float) -> int:
    """Blocks that fit in `gib` GiB (one of them is the reserved null block)."""
    return int(gib * _GIB) // bytes_per_block(model, block_size, dtype)


class KVCacheStorage:
    """One tensor `[layers, 2, kv_heads, num_blocks, block_size, head_dim]` with per-layer views.

    Head-major per layer (see kernels/attention.py); a block's data for one layer is
    `data[layer, :, :, block]`, which block copies (swap, transfer) index directly.

    `host_in_pool` (a CPU only, where host swap space and the pool are the same DRAM): the swap
    space's `host_blocks` are the tail of the same tensor's block dimension, host block `h` at
    block id `host_offset + h` (= `num_blocks + h`) of every layer's view. Kernels then read a
    host-kept block in place through a block table that names it (partial residency's host
    source, `engine/rebuilt_prefix.py`): no per-layer copy and no separate attention for it, so
    such a step stays on the compiled decode path. The pool's accounting is unchanged (the
    block pool hands out ids `< num_blocks`, the host pool its own `< host_blocks`); `nbytes`
    counts the pool only. Only the pool's part is zeroed at start and the swap space's parts
    are taken off huge pages, so untouched swap space costs address space, not memory
    (measured: with huge pages on it, touching the pool committed a 2 MiB page of swap space
    per layer, K/V and head row, ~350 MiB for SmolLM2).
    """

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device,
        host_blocks: int = 0,
        host_in_pool: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        on_cpu = torch.device(device).type == "cpu"
        if host_in_pool and not on_cpu:
            raise ValueError("host swap space can share the pool's tensor only on a CPU (the same memory)")
        self.host_offset: int | None = num_blocks if host_in_pool else None
        blocks = num_blocks + (host_blocks if host_in_pool else 0)
        shape = (model.num_layers, 2, model.num_kv_heads, blocks, block_size, model.head_dim)
        if on_cpu:
            self.data = empty_hugepage_tensor(shape, dtype, zero=not host_in_pool)
            if host_in_pool:  # swap space off huge pages (it is touched rarely), then the pool zeroed
                for row in self.data[:, :, :, num_blocks:].flatten(0, 2):
                    no_hugepages(row.data_ptr(), row.numel() * row.element_size())
                self.data[:, :, :, :num_blocks].zero_()
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [self.data[i] for i in range(model.num_layers)]
        self._host_shape = (model.num_layers, 2, model.num_kv_heads, host_blocks, block_size, model.head_dim)
        self._host: torch.Tensor | None = None  # swap space, allocated on first use

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (not of swap space kept in the same tensor)."""
        return self.data[:, :, :, : self.num_blocks].numel() * self.data.element_size()

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // (self.num_blocks * self.block_size)

    def host(self) -> torch.Tensor:
        """`[layers, 2, kv_heads, host_blocks, block_size, head_dim]` swap space (with
        `host_in_pool` a view of the pool tensor's tail, not contiguous)."""
        if self.host_offset is not None:
            return self.data[:, :, :, self.host_offset :]
        if self._host is None:  # pinned on GPU machines so copies can be asynchronous
            pin = self.data.device.type == "cuda"
            self._host = torch.empty(self._host_shape, dtype=self.data.dtype, pin_memory=pin)
        return self._host

    def execute(self, copies: Sequence[KVCopy]) -> None:
        """Run a step's KV copies in order; consecutive copies of one kind go as one gather/scatter.

        Within such a run no copy reads what another writes (a run only reads one side and
        writes the other, or for device moves writes only freshly taken blocks), so gathering
        every source before scattering is exact.
        """
        for kind, run in groupby(copies, key=lambda c: c.kind):
            run = list(run)
            src = torch.tensor([s for c in run for s in c.src_slots], dtype=torch.long)
            dst = torch.tensor([d for c in run for d in c.dst_slots], dtype=torch.long)
            if self.host_offset is not None:  # host slots sit after the pool's in the one tensor
                host_slot0 = self.host_offset * self.block_size
                src = src + host_slot0 if kind is CopyKind.H2D else src
                dst = dst + host_slot0 if kind is CopyKind.D2H else dst
            src_t, dst_t = self._flat(kind is CopyKind.H2D), self._flat(kind is CopyKind.D2H)
            moved = src_t.index_select(3, src.to(src_t.device))
            dst_t.index_copy_(3, dst.to(dst_t.device), moved.to(dst_t.device))

    def _flat(self, on_host: bool) -> torch.Tensor:
        """`[layers, 2, kv_heads, blocks * block_size, head_dim]` view of the device cache or host
        space (with `host_in_pool` both are the one tensor; host slots are offset by the caller)."""
        t = self.host() if on_host and self.host_offset is None else self.data
        layers, two, heads, blocks, bs, dim = t.shape
        return t.view(layers, two, heads, blocks * bs, dim)
