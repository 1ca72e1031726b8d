"""Settings of the batch store (shared by the gateway's batch API and the queue service) and of the
queue service itself (`TANDEM_*` env vars)."""

from __future__ import annotations

import os
from pathlib import Path

from shared.settings import ServiceSettings


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "tandem")


class StoreSettings(ServiceSettings):
    """Where batch state lives. The gateway and the queue service must point at the same store."""

    database_url: str = ""  # e.g. postgresql+asyncpg://user:pw@host/db; empty: SQLite under data_dir
    data_dir: str = _default_data_dir()  # holds tandem.db (SQLite, WAL) when no database_url
    max_file_bytes: int = 100 * 1024 * 1024  # uploads above this are a 413
    max_batch_lines: int = 50_000  # a batch input with more lines fails validation
    max_batch_errors: int = 100  # validation errors listed per failed batch (the rest are counted)

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{Path(self.data_dir).expanduser() / 'tandem.db'}"


class QueueSettings(StoreSettings):
    queue_id: str = "queue"  # its results come back on crc32(queue_id) % partitions
    queue_reply_partition: int | None = None  # override the results partition it reads
    tick_interval_s: float = 0.2  # how often it validates, releases, expires and finalises
    capacity_stale_s: float = 3.0  # no BE capacity report this long: release nothing new
