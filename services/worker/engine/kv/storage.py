"""The KV cache tensors and their sizing from a memory budget."""
from __future__ import annotations

import torch

from services.worker.engine.config import ModelConfig
from services.worker.engine.platform_tuning import empty_hugepage_tensor

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
    """

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (model.num_layers, 2, model.num_kv_heads, num_blocks, block_size, model.head_dim)
        if torch.device(device).type == "cpu":
            self.data = empty_hugepage_tensor(shape, dtype)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [self.data[i] for i in range(model.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
