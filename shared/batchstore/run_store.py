"""The queue service's part of the batch store: validation outcome, items, results, finalisation.

Status changes are conditional updates (`WHERE status = ...`), so the queue service never
overwrites a decision the gateway made meanwhile (a cancel request), and an item's result is
recorded by `UPDATE ... WHERE status = 'in_flight' AND attempt = ?`: once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import select, update

from shared.batchstore.db import BatchDatabase, BatchRow, FileRow, ItemRow, KeyRow, new_id, now


@dataclass(frozen=True)
class BatchLine:
    """One valid input line, to become an item."""

    line: int  # 1-based line in the input file
    custom_id: str
    body: dict


@dataclass(frozen=True)
class Claimed:
    """An item just marked in flight, with what releasing it needs from its batch."""

    item: ItemRow
    endpoint: str
    cache_salt: str | None  # the owner key's prefix-cache salt (None: the batch has no owner)


@dataclass(frozen=True)
class Finished:
    """An item's outcome, to record once."""

    batch_id: str
    custom_id: str
    attempt: int
    succeeded: bool
    line: dict  # the output-file line


class BatchRunStore:
    def __init__(self, db: BatchDatabase) -> None:
        self.session = db.session

    async def input_content(self, file_id: str) -> bytes | None:
        """A batch's input file, or None when it was deleted meanwhile."""
        async with self.session() as s:
            return (await s.execute(select(FileRow.content).where(FileRow.id == file_id))).scalar_one_or_none()

    # -- batches -----------------------------------------------------------------------------

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

    async def claim(self, n: int) -> list[Claimed]:
        """Mark up to n queued items of in-progress batches in flight (oldest batch first)."""
        if n <= 0:
            return []
        async with self.session.begin() as s:
            q = (
                select(ItemRow, BatchRow.endpoint, KeyRow.cache_salt)
                .join(BatchRow, BatchRow.id == ItemRow.batch_id)
                .outerjoin(KeyRow, KeyRow.id == BatchRow.owner)
                .where(ItemRow.status == "queued", BatchRow.status == "in_progress")
                .order_by(BatchRow.seq, ItemRow.line)
                .limit(n)
                .with_for_update(of=ItemRow, skip_locked=True)
            )  # PostgreSQL: a concurrent cancel waits
            rows = [Claimed(item, endpoint, salt) for item, endpoint, salt in (await s.execute(q)).all()]
            for row in rows:
                row.item.status = "in_flight"
        return rows

    async def requeue(self, batch_id: str, custom_id: str, attempt: int) -> bool:
        """Put an in-flight item back in the queue as a new attempt (its release failed)."""
        return await self._next_attempt(batch_id, custom_id, attempt, status="queued")

    async def bump_attempt(self, batch_id: str, custom_id: str, attempt: int) -> bool:
        """Re-run an in-flight item from scratch as attempt + 1 (its worker was lost)."""
        return await self._next_attempt(batch_id, custom_id, attempt)

    async def _next_attempt(self, batch_id: str, custom_id: str, attempt: int, **values) -> bool:
        """Move an item still in flight as `attempt` to attempt + 1 (with `values`); False when
        it is no longer there (finished, cancelled or already moved)."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(ItemRow)
                .where(
                    ItemRow.batch_id == batch_id,
                    ItemRow.custom_id == custom_id,
                    ItemRow.status == "in_flight",
                    ItemRow.attempt == attempt,
                )
                .values(attempt=attempt + 1, **values)
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

    async def finish_batch(self, batch_id: str, old: str, new: str, outputs: dict[str, bytes], **values) -> bool:
        """Write the output/error files and move the batch to its final status, in one transaction."""
        async with self.session.begin() as s:
            res = await s.execute(
                update(BatchRow).where(BatchRow.id == batch_id, BatchRow.status == old).values(status=new, **values)
            )
            if res.rowcount == 0:
                return False
            owner = (await s.execute(select(BatchRow.owner).where(BatchRow.id == batch_id))).scalar()
            ids = {}
            for kind, content in outputs.items():
                row = FileRow(
                    id=new_id("file"),
                    purpose="batch_output",
                    filename=f"{batch_id}_{kind}.jsonl",
                    bytes=len(content),
                    created_at=now(),
                    content=content,
                    owner=owner,  # the batch's key reads its output; nobody else sees it
                )
                s.add(row)
                ids[f"{kind}_file_id"] = row.id
            if ids:
                await s.execute(update(BatchRow).where(BatchRow.id == batch_id).values(**ids))
        return True
