"""KV copies a scheduling decision implies: checkpoints, swaps and relocations.

The KV manager records them as it allocates; the policy hands them to the engine on the
`ScheduledBatch`, and the engine executes them in order before the forward pass. A model-free
simulator reads the same list to charge their time (`ScheduledBatch.swap_bytes`).

Slots are flat indices `block * block_size + offset` into the device cache or the host swap
space (same block size). The list order is causal: a copy may read what an earlier one wrote.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CopyKind(str, enum.Enum):
    D2H = "d2h"  # device -> host: lazy checkpoint or whole-request swap-out
    H2D = "h2d"  # host -> device: restore / swap-in
    D2D = "d2d"  # device -> device: relocating a BE block's resident part


@dataclass(frozen=True, slots=True)
class KVCopy:
    kind: CopyKind
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    nbytes: int  # len(slots) x the manager's bytes_per_token (0 when the manager was given none)
    reason: str  # "checkpoint", "swap_out", "restore" or "relocate"
    request_id: str = ""

    @property
    def num_slots(self) -> int:
        return len(self.src_slots)

    @property
    def crosses_host(self) -> bool:
        return self.kind is not CopyKind.D2D
