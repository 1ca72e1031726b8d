"""The queue service's one settings object (`TANDEM_*` env vars; `tandem queue` flags override)."""

from __future__ import annotations

from shared.batchstore.settings import BatchStoreSettings


class QueueSettings(BatchStoreSettings):
    queue_id: str = "queue"  # its results come back on crc32(queue_id) % partitions
    queue_reply_partition: int | None = None  # override the results partition it reads
    # The work loop runs on events and deadlines (services/queue/wakeup.py); with none, at least
    # this often (a safety net for a lost batch notice).
    idle_tick_s: float = 5.0
    capacity_stale_s: float = 3.0  # no BE capacity report this long: release nothing new
    max_batch_lines: int = 50_000  # a batch input with more lines fails validation
    max_batch_errors: int = 100  # validation errors listed per failed batch (the rest are counted)
