"""The batch database as the gateway uses it: opened once, on first use, shared by the Files and
Batches API (`batch_api.py`), the key checks (`auth.py`) and key management (`keys_api.py`)."""

from __future__ import annotations

import asyncio

from shared.batchstore.db import BatchDatabase


class GatewayDatabase:
    def __init__(self, url: str) -> None:
        self.url = url
        self._db: BatchDatabase | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> BatchDatabase:
        """The open database (tables created); a failure to open is raised and retried next call."""
        async with self._lock:
            if self._db is None:
                db = BatchDatabase(self.url)
                try:
                    await db.start()
                except BaseException:
                    await db.close()
                    raise
                self._db = db
        return self._db

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None
