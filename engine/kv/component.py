"""The contract between the KV manager's core and its components.

The core (`KVCacheManager`) does what every policy needs: block tables, prefix matching and
publishing, allocation, freeing, whole-request moves to and from host, and the checks that
tables, reference counts and host space agree. What varies between policies is a
*component*, composed into the core with `KVCacheManager.attach`: two-ended shared blocks for
BROS today (`TwoEndedBlocks`), hidden-state blocks (Apt-Serve) and partial residency (eLLM)
next. A policy names the components it relies on (`SchedulingPolicy.kv_components`) and the
`Scheduler` attaches them to its manager before the first request.

**Ownership.** When the core creates a request's table it asks each component, in attach
order, whether it `owns` the request; the first that does places that table's blocks until
the table is dropped (`BlockTable.owner`). Tables nobody owns follow the core's forward rules:
free blocks filled from the left, no partial residency. So a component changes only the
requests it owns (a hidden-state component owns the requests in hidden mode; KV-mode requests
stay with the core), and components with disjoint requests compose.

**What a component may observe and change.** It is built with the manager's `KVLedger` and
may read all of it (tables, pools, pending copies). It changes tables, pools, host space and
copies only through the ledger's primitives, which log their inverse. Its own state it changes
freely but logs each change with `ledger.undo.push(inverse)` (when `ledger.undo.active`), so a
rollback restores the whole manager, component included. It never keeps references to
`Request`s: a request is passed to each call that needs one.

**Allocation.** There is one allocation path, `KVCacheManager.allocate`, for every policy. For
an owned table the core opens an undo mark, creates the table if needed (taking over the
prefix-cache hits), calls `grow`, and rolls back to its mark when `grow` returns False; so a
component may fail halfway. `restore` (bring host entries back) calls `restore_entry` per
entry and then copies the host part in itself.

**Freeing.** Before the core drops a table's hold on an entry's block (free, swap-out,
dropping reserved entries) it calls the owner's `on_detach`, which unhooks the entry from the
component's state; the core then releases the block and clears the entry.

**Publishing.** The core publishes a full, computed, forward, device-resident entry to the
prefix cache only if its owner agrees (`publishable`): a block another request may still
write into must not be served to readers.

**Invariants.** `KVCacheManager.check_invariants` checks every table's shape and the
pool's reference counts and host space against the tables, the forward rules for unowned
tables, then calls each component's `check_invariants`, which checks its own state and the
entries of the tables it owns. Tests call it after every step.

**How the runner learns slots.** The runner reads two lists of a table and nothing else:
`ids[e]` (the device block of entry e, 0 when it has none) and `rev[e]` (the entry fills its
block from the right: offset o at slot `bs-1-o`). Write slots are `ids[p//bs]*bs + offset`,
and decode buckets and prefill spans carry `ids` as block lists and `rev` as direction bits
(None when all are forward, so other policies pay nothing). A component must express its
layout in these (or add a per-entry list to `BlockTable` together with its runner support);
the runner never calls into a component, which keeps the per-step slot computation a list
lookup. `KVCacheManager.slot` is the same mapping for tests and tools.

Next features, in these terms (`docs/engine.md`, "Designed for what comes next"):
- *Hidden-state blocks (Apt-Serve, built: `hidden.py`)*: owns requests in HIDDEN form; `grow`
  takes `ceil(n·r)` pool blocks for n logical entries (budget in KV-block units) and keeps
  them in `BlockTable.held` (entries have no block of their own); where entry e's rows lie is
  arithmetic on `held` (`HiddenLayout`), which the runner reads. Such requests neither take
  nor serve prefix-cache hits (`uses_prefix_cache`, `publishable`) and are never swapped.
- *Partial residency (eLLM)*, built as `kv/partial.py`: owns requests with a non-resident prefix; dropping prefix
  entries detaches them to empty entries (id 0) without unregistering their hashes, so a
  later step can take them back as prefix-cache hits; its `check_invariants` accepts empty
  entries without a host copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from engine.kv.block_table import BlockTable
    from engine.kv.ledger import KVLedger
    from engine.scheduling.request import Request


class KVComponent(ABC):
    """A part of the KV manager for what varies between policies (see the module docstring).

    Subclasses take the manager's `KVLedger` as the first argument of their constructor:
    `KVCacheManager.attach(factory)` calls `factory(ledger)` once.
    """

    name: ClassVar[str]
    # False: requests this component would own neither take prefix-cache hits when admitted
    # nor (with `publishable`) serve them: their blocks do not hold K/V (hidden-state rows)
    uses_prefix_cache: ClassVar[bool] = True

    def __init__(self, ledger: KVLedger) -> None:
        self.ledger = ledger

    @abstractmethod
    def owns(self, request: Request) -> bool:
        """Whether this component places the blocks of `request` (asked once, when its table
        is created)."""

    @abstractmethod
    def grow(self, request: Request, table: BlockTable, target: int) -> bool:
        """Give positions [table.claimed, target) device slots: append entries, claim slots,
        record the copies that implies, and set `table.claimed = target` (all through the
        ledger). The table is resident and `target > table.claimed`. Return False when memory
        is short; the core rolls back everything done since the call began."""

    @abstractmethod
    def restore_entry(self, request: Request, table: BlockTable, entry: int) -> bool:
        """Give `entry` (whose KV is on host, `table.host[entry]`) a fresh device block, moving
        any part still resident on the old one into it (device to device). The core then
        copies the host part in and releases the host block. False when memory is short."""

    def on_detach(self, rid: str, table: BlockTable, entry: int) -> None:
        """The core is about to release `entry`'s device block and clear the entry: unhook it
        from this component's state (logged). Default: nothing to unhook."""

    def publishable(self, table: BlockTable, entry: int) -> bool:
        """Whether a full, computed, forward, resident entry may join the prefix cache."""
        return True

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError when this component's state or the entries of the tables it
        owns break its rules (the core has checked shapes and reference counts)."""
