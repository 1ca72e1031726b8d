"""Host (CPU) swap space in block-sized units for checkpointed and swapped-out KV.

A host block holds one logical block of one request at its logical offsets (slot
`host_block * block_size + offset`), whatever the direction of the device block it came from.
"""

from __future__ import annotations


class HostPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"host swap space must be >= 0 blocks (got {num_blocks})")
        self.num_blocks = num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # an ordered set: O(1) both ways

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.popitem()[0] if self._free else None

    def release(self, host_block: int) -> None:
        self._free[host_block] = None

    def unrelease(self, host_block: int) -> None:
        """Undo of `release`: take the block back out of the free list."""
        del self._free[host_block]
