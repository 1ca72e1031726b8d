"""The gateway's part of the batch store: files, batch creation, reads and cancel requests.

Everything the Files and Batches API (`services/gateway/batch_api.py`) reads and writes. A
cancel is only a request (`validating | in_progress -> cancelling`, conditional); the queue
service stops the items and finishes the batch (`run_store.py`).
"""

from __future__ import annotations

import json

from sqlalchemy import delete, select, update

from shared.batchstore.db import BatchDatabase, BatchRow, FileRow, new_id, now
from shared.batchstore.objects import CANCELLABLE


class BatchAPIStore:
    def __init__(self, db: BatchDatabase) -> None:
        self.session = db.session

    # -- files -----------------------------------------------------------------------------

    async def add_file(self, content: bytes, filename: str, purpose: str) -> FileRow:
        row = FileRow(
            id=new_id("file"), purpose=purpose, filename=filename, bytes=len(content), created_at=now(), content=content
        )
        async with self.session.begin() as s:
            s.add(row)
        return row

    async def get_file(self, file_id: str) -> FileRow | None:
        async with self.session() as s:
            return (await s.execute(select(FileRow).where(FileRow.id == file_id))).scalar_one_or_none()

    async def list_files(self, purpose: str | None, limit: int, after: str | None) -> tuple[list[FileRow], bool]:
        async with self.session() as s:
            q = select(FileRow).order_by(FileRow.seq.desc())
            if purpose:
                q = q.where(FileRow.purpose == purpose)
            if after:
                q = q.where(FileRow.seq < select(FileRow.seq).where(FileRow.id == after).scalar_subquery())
            rows = list((await s.execute(q.limit(limit + 1))).scalars())
        return rows[:limit], len(rows) > limit

    async def delete_file(self, file_id: str) -> bool:
        async with self.session.begin() as s:
            return (await s.execute(delete(FileRow).where(FileRow.id == file_id))).rowcount > 0

    # -- batches ----------------------------------------------------------------------------

    async def add_batch(
        self, input_file_id: str, endpoint: str, window: str, window_s: int, metadata: dict | None
    ) -> BatchRow:
        t = now()
        row = BatchRow(
            id=new_id("batch"),
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=window,
            metadata_json=json.dumps(metadata),
            status="validating",
            created_at=t,
            expires_at=t + window_s,
            total=0,
            completed=0,
            failed=0,
        )
        async with self.session.begin() as s:
            s.add(row)
        return row

    async def get_batch(self, batch_id: str) -> BatchRow | None:
        async with self.session() as s:
            return (await s.execute(select(BatchRow).where(BatchRow.id == batch_id))).scalar_one_or_none()

    async def list_batches(self, limit: int, after: str | None) -> tuple[list[BatchRow], bool]:
        async with self.session() as s:
            q = select(BatchRow).order_by(BatchRow.seq.desc())
            if after:
                q = q.where(BatchRow.seq < select(BatchRow.seq).where(BatchRow.id == after).scalar_subquery())
            rows = list((await s.execute(q.limit(limit + 1))).scalars())
        return rows[:limit], len(rows) > limit

    async def request_cancel(self, batch_id: str) -> bool:
        """validating | in_progress -> cancelling; False when the batch is past that."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.status.in_(CANCELLABLE))
                .values(status="cancelling", cancelling_at=now())
            )
            return res.rowcount > 0
