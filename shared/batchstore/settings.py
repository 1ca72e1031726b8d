"""Where the batch store lives; the gateway's and the queue service's settings both include it."""

from __future__ import annotations

import os
from pathlib import Path

from shared.settings import ServiceSettings


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "tandem")


class BatchStoreSettings(ServiceSettings):
    """The gateway and the queue service must point at the same store."""

    database_url: str = ""  # e.g. postgresql+asyncpg://user:pw@host/db; empty: SQLite under data_dir
    data_dir: str = _default_data_dir()  # holds tandem.db (SQLite, WAL) when no database_url

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{Path(self.data_dir).expanduser() / 'tandem.db'}"
