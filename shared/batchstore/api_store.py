"""The gateway's part of the batch store: files, batch creation, reads and cancel requests.

Everything the Files and Batches API (`services/gateway/batch_api.py`) reads and writes. A
cancel is only a request (`validating | in_progress -> cancelling`, conditional); the queue
service stops the items and finishes the batch (`run_store.py`).

Every read and write is scoped to an `owner`: the caller's key id, or None on an open stack
(then only rows without an owner exist). Another key's file or batch is "not found", never
"forbidden": its id tells nobody else anything.
"""

from __future__ import annotations

import json

from sqlalchemy import delete, func, select, update

from shared.batchstore.db import BatchDatabase, BatchRow, FileRow, new_id, now
from shared.batchstore.objects import CANCELLABLE, UNFINISHED

Owner = str | None  # a key id; None: the open stack


def _owned(table, owner: Owner):
    """The WHERE clause of the owner's rows."""
    return table.owner.is_(None) if owner is None else table.owner == owner


def count_requests(content: bytes) -> int:
    """The requests in a batch input file: its non-blank lines (what validation will count)."""
    return sum(1 for line in content.splitlines() if line.strip())


class BatchAPIStore:
    def __init__(self, db: BatchDatabase) -> None:
        self.session = db.session

    # -- files -----------------------------------------------------------------------------

    async def add_file(self, content: bytes, filename: str, purpose: str, owner: Owner = None) -> FileRow:
        row = FileRow(
            id=new_id("file"),
            purpose=purpose,
            filename=filename,
            bytes=len(content),
            created_at=now(),
            content=content,
            owner=owner,
            requests=count_requests(content),
        )
        async with self.session.begin() as s:
            s.add(row)
        return row

    async def get_file(self, file_id: str, owner: Owner = None) -> FileRow | None:
        async with self.session() as s:
            q = select(FileRow).where(FileRow.id == file_id, _owned(FileRow, owner))
            return (await s.execute(q)).scalar_one_or_none()

    async def list_files(
        self, purpose: str | None, limit: int, after: str | None, owner: Owner = None
    ) -> tuple[list[FileRow], bool]:
        async with self.session() as s:
            q = select(FileRow).where(_owned(FileRow, owner)).order_by(FileRow.seq.desc())
            if purpose:
                q = q.where(FileRow.purpose == purpose)
            if after:
                q = q.where(FileRow.seq < select(FileRow.seq).where(FileRow.id == after).scalar_subquery())
            rows = list((await s.execute(q.limit(limit + 1))).scalars())
        return rows[:limit], len(rows) > limit

    async def delete_file(self, file_id: str, owner: Owner = None) -> bool:
        async with self.session.begin() as s:
            res = await s.execute(delete(FileRow).where(FileRow.id == file_id, _owned(FileRow, owner)))
            return res.rowcount > 0

    # -- batches ----------------------------------------------------------------------------

    async def add_batch(
        self, input_file_id: str, endpoint: str, window: str, window_s: int, metadata: dict | None, owner: Owner = None
    ) -> BatchRow:
        t = now()
        row = BatchRow(
            owner=owner,
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

    async def get_batch(self, batch_id: str, owner: Owner = None) -> BatchRow | None:
        async with self.session() as s:
            q = select(BatchRow).where(BatchRow.id == batch_id, _owned(BatchRow, owner))
            return (await s.execute(q)).scalar_one_or_none()

    async def list_batches(self, limit: int, after: str | None, owner: Owner = None) -> tuple[list[BatchRow], bool]:
        async with self.session() as s:
            q = select(BatchRow).where(_owned(BatchRow, owner)).order_by(BatchRow.seq.desc())
            if after:
                q = q.where(BatchRow.seq < select(BatchRow.seq).where(BatchRow.id == after).scalar_subquery())
            rows = list((await s.execute(q.limit(limit + 1))).scalars())
        return rows[:limit], len(rows) > limit

    async def request_cancel(self, batch_id: str, owner: Owner = None) -> bool:
        """validating | in_progress -> cancelling; False when the batch is past that."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.status.in_(CANCELLABLE), _owned(BatchRow, owner))
                .values(status="cancelling", cancelling_at=now())
            )
            return res.rowcount > 0

    async def unfinished_requests(self, owner: Owner) -> int:
        """Requests in the owner's unfinished batches (what its batch quota bounds): a validating
        batch counts its input file's lines, a running one what is not finished yet."""
        async with self.session() as s:
            running = select(func.coalesce(func.sum(BatchRow.total - BatchRow.completed - BatchRow.failed), 0)).where(
                _owned(BatchRow, owner), BatchRow.status.in_(UNFINISHED - {"validating"})
            )
            validating = (
                select(func.coalesce(func.sum(func.coalesce(FileRow.requests, 0)), 0))
                .select_from(BatchRow)
                .join(FileRow, FileRow.id == BatchRow.input_file_id)
                .where(_owned(BatchRow, owner), BatchRow.status == "validating")
            )
            return int((await s.execute(running)).scalar()) + int((await s.execute(validating)).scalar())
