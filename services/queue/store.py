"""The batch store: every read and write of batch state, in short transactions.

Used by the gateway's batch API (files, batch creation, listing, cancel requests) and by the
queue service (validation, release, results, finalisation). Status changes are conditional
updates (`WHERE status = ...`), so the two processes never overwrite each other's decision, and
an item's result is recorded by `UPDATE ... WHERE status = 'in_flight' AND attempt = ?`: once.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.queue.db import BatchRow, FileRow, ItemRow, create_tables, make_engine, sessions
from services.queue.objects import CANCELLABLE
from services.queue.validation import BatchLine


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class Finished:
    """An item's outcome, to record once."""

    batch_id: str
    custom_id: str
    attempt: int
    succeeded: bool
    line: dict  # the output-file line


class BatchStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: AsyncEngine = make_engine(url)
        self.session = sessions(self.engine)

    async def start(self) -> None:
        await create_tables(self.engine)

    async def close(self) -> None:
        await self.engine.dispose()

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

    # -- batches (API side) ------------------------------------------------------------------

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

    # -- batches (queue side) ----------------------------------------------------------------

    async def batches_in(self, *statuses: str) -> list[BatchRow]:
        async with self.session() as s:
            q = select(BatchRow).where(BatchRow.status.in_(statuses)).order_by(BatchRow.seq)
            return list((await s.execute(q)).scalars())

    async def fail_validation(self, batch_id: str, errors: dict) -> bool:
        return await self.move(batch_id, "validating", "failed", failed_at=now(), errors_json=json.dumps(errors))

    async def start_batch(self, batch: BatchRow, lines: Sequence[BatchLine], request_ids: Sequence[str]) -> bool:
        """Insert the items and move validating -> in_progress, in one transaction."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(BatchRow)
                .where(BatchRow.id == batch.id, BatchRow.status == "validating")
                .values(status="in_progress", in_progress_at=now(), total=len(lines))
            )
            if res.rowcount == 0:
                return False  # cancelled while we validated
            s.add_all(
                ItemRow(
                    batch_id=batch.id,
                    custom_id=ln.custom_id,
                    line=ln.line,
                    request_id=rid,
                    body_json=json.dumps(ln.body),
                    status="queued",
                    attempt=0,
                )
                for ln, rid in zip(lines, request_ids)
            )
        return True

    async def move(self, batch_id: str, old: str, new: str, **values) -> bool:
        """old -> new status (and timestamps); False when the batch was no longer `old`."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(BatchRow).where(BatchRow.id == batch_id, BatchRow.status == old).values(status=new, **values)
            )
            return res.rowcount > 0

    # -- items -----------------------------------------------------------------------------

    async def requeue_in_flight(self) -> int:
        """After a restart: every item that was in flight is released again as a new attempt."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(ItemRow)
                .where(ItemRow.status == "in_flight")
                .values(status="queued", attempt=ItemRow.attempt + 1)
            )
            return res.rowcount

    async def claim(self, n: int) -> list[tuple[ItemRow, str]]:
        """Mark up to n queued items of in-progress batches in flight (oldest batch first); with their endpoint."""
        if n <= 0:
            return []
        async with self.session.begin() as s:
            q = (
                select(ItemRow, BatchRow.endpoint)
                .join(BatchRow, BatchRow.id == ItemRow.batch_id)
                .where(ItemRow.status == "queued", BatchRow.status == "in_progress")
                .order_by(BatchRow.seq, ItemRow.line)
                .limit(n)
                .with_for_update(of=ItemRow, skip_locked=True)
            )  # PostgreSQL: a concurrent cancel waits
            rows = [(item, endpoint) for item, endpoint in (await s.execute(q)).all()]
            for item, _ in rows:
                item.status = "in_flight"
        return rows

    async def requeue(self, batch_id: str, custom_id: str, attempt: int) -> bool:
        """Put an in-flight item back in the queue as a new attempt (its release failed)."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(ItemRow)
                .where(
                    ItemRow.batch_id == batch_id,
                    ItemRow.custom_id == custom_id,
                    ItemRow.status == "in_flight",
                    ItemRow.attempt == attempt,
                )
                .values(status="queued", attempt=attempt + 1)
            )
            return res.rowcount > 0

    async def bump_attempt(self, batch_id: str, custom_id: str, attempt: int) -> bool:
        """Re-run an in-flight item from scratch as attempt + 1 (its worker was lost)."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(ItemRow)
                .where(
                    ItemRow.batch_id == batch_id,
                    ItemRow.custom_id == custom_id,
                    ItemRow.status == "in_flight",
                    ItemRow.attempt == attempt,
                )
                .values(attempt=attempt + 1)
            )
            return res.rowcount > 0

    async def record(self, results: Iterable[Finished]) -> list[Finished]:
        """Record outcomes once each; returns those recorded now (the others were already final)."""
        recorded = []
        async with self.session.begin() as s:
            for r in results:
                res = await s.execute(
                    update(ItemRow)
                    .where(
                        ItemRow.batch_id == r.batch_id,
                        ItemRow.custom_id == r.custom_id,
                        ItemRow.status == "in_flight",
                        ItemRow.attempt == r.attempt,
                    )
                    .values(
                        status="done" if r.succeeded else "failed", result_json=json.dumps(r.line), finished_at=now()
                    )
                )
                if res.rowcount:
                    recorded.append(r)
                    counter = BatchRow.completed if r.succeeded else BatchRow.failed
                    await s.execute(update(BatchRow).where(BatchRow.id == r.batch_id).values({counter: counter + 1}))
        return recorded

    async def stop_items(self, batch_id: str, status: str) -> list[str]:
        """Mark every unfinished item cancelled/expired; returns the request ids that were in flight.

        Conditional updates, not read-then-write: a result recorded concurrently keeps its item.
        """
        unfinished = ItemRow.batch_id == batch_id
        async with self.session.begin() as s:
            res = await s.execute(
                update(ItemRow)
                .where(unfinished, ItemRow.status == "in_flight")
                .values(status=status, finished_at=now())
                .returning(ItemRow.request_id)
            )
            in_flight = list(res.scalars())
            queued = await s.execute(
                update(ItemRow).where(unfinished, ItemRow.status == "queued").values(status=status, finished_at=now())
            )
            n = len(in_flight) + queued.rowcount
            if n:
                await s.execute(update(BatchRow).where(BatchRow.id == batch_id).values(failed=BatchRow.failed + n))
        return in_flight

    async def items_of(self, batch_id: str) -> list[ItemRow]:
        async with self.session() as s:
            q = select(ItemRow).where(ItemRow.batch_id == batch_id).order_by(ItemRow.line)
            return list((await s.execute(q)).scalars())

    async def count_items(self, batch_id: str, *statuses: str) -> int:
        async with self.session() as s:
            q = (
                select(func.count())
                .select_from(ItemRow)
                .where(ItemRow.batch_id == batch_id, ItemRow.status.in_(statuses))
            )
            return (await s.execute(q)).scalar_one()

    async def finish_batch(self, batch_id: str, old: str, new: str, outputs: dict[str, bytes], **values) -> bool:
        """Write the output/error files and move the batch to its final status, in one transaction."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(BatchRow).where(BatchRow.id == batch_id, BatchRow.status == old).values(status=new, **values)
            )
            if res.rowcount == 0:
                return False
            ids = {}
            for kind, content in outputs.items():
                row = FileRow(
                    id=new_id("file"),
                    purpose="batch_output",
                    filename=f"{batch_id}_{kind}.jsonl",
                    bytes=len(content),
                    created_at=now(),
                    content=content,
                )
                s.add(row)
                ids[f"{kind}_file_id"] = row.id
            if ids:
                await s.execute(update(BatchRow).where(BatchRow.id == batch_id).values(**ids))
        return True
