"""The batch store's tables (SQLAlchemy 2 ORM), the async engine, and `BatchDatabase`.

SQLite (WAL) by default, PostgreSQL through `TANDEM_DATABASE_URL`. On SQLite every transaction
starts with `BEGIN IMMEDIATE`: the gateway and the queue service write the same file from two
processes, and a deferred transaction that reads and then writes can fail with SQLITE_BUSY
instead of waiting; taking the write lock up front makes the busy timeout apply.

The API keys live here too (`KeyRow`, managed by `shared/apikeys`): every deployment has this
database, and a batch's owner is a key. Files and batches carry their owner's key id (`owner`,
NULL when the stack was open), so each key sees only its own.

Schema changes are additive (new tables, new nullable columns); `create_tables` adds the
columns a database made by an older version lacks, so an upgrade needs no migration tool.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from sqlalchemy import Boolean, Float, Index, Integer, LargeBinary, String, Text, event, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SQLITE_BUSY_TIMEOUT_S = 30


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Wall-clock seconds, as the rows' timestamps (and OpenAI's objects) hold them."""
    return int(time.time())


class Base(DeclarativeBase):
    pass


class FileRow(Base):
    __tablename__ = "tandem_files"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # list order
    id: Mapped[str] = mapped_column(String(64), unique=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)  # key id; NULL: open stack
    requests: Mapped[int | None] = mapped_column(Integer, nullable=True)  # non-blank lines (batch quotas)


class BatchRow(Base):
    __tablename__ = "tandem_batches"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    metadata_json: Mapped[str] = mapped_column(Text, default="null")
    status: Mapped[str] = mapped_column(String(16), index=True)
    errors_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[int] = mapped_column(Integer)
    in_progress_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    finalizing_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completed_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    failed_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    expired_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cancelling_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cancelled_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)  # key id; NULL: open stack


class KeyRow(Base):
    """An API key: its SHA-256 hash (never the key), limits, allowed classes and cache salt."""

    __tablename__ = "tandem_api_keys"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(32), unique=True)  # also inside the key, for the lookup
    name: Mapped[str] = mapped_column(String(128))
    secret_hash: Mapped[str] = mapped_column(String(64))  # hex SHA-256 of the whole key
    created_at: Mapped[int] = mapped_column(Integer)
    revoked_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    requests_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # None: unlimited
    tokens_per_min: Mapped[int | None] = mapped_column(Integer, nullable=True)
    batch_quota: Mapped[int | None] = mapped_column(Integer, nullable=True)  # unfinished batch requests
    classes: Mapped[str] = mapped_column(String(16), default="rt,be")  # allowed service classes
    admin: Mapped[bool] = mapped_column(Boolean, default=False)  # may manage keys over HTTP
    cache_salt: Mapped[str] = mapped_column(String(64))  # prefix-cache isolation (random, server-side)


class ItemRow(Base):
    """One input line. (batch_id, custom_id) is the key results are recorded under, once."""

    __tablename__ = "tandem_batch_items"
    __table_args__ = (
        Index("ix_items_batch_status_line", "batch_id", "status", "line"),
        Index("ix_items_status", "status"),
    )

    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(512), primary_key=True)
    line: Mapped[int] = mapped_column(Integer)  # 1-based line in the input file
    request_id: Mapped[str] = mapped_column(String(128))
    body_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # queued | in_flight | done | failed | cancelled | expired
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    result_json: Mapped[str | None] = mapped_column(Text, nullable=True)  # the output line, once finished
    finished_at: Mapped[int | None] = mapped_column(Integer, nullable=True)


def make_engine(url: str) -> AsyncEngine:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_async_engine(url, pool_pre_ping=True)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
    _sqlite_wal_and_immediate(engine)
    return engine


def _sqlite_wal_and_immediate(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes in WAL mode
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000}")
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


async def create_tables(engine: AsyncEngine) -> None:
    """Idempotent; safe when the gateway and the queue service start together."""
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_create_and_extend)
    except Exception:  # noqa: BLE001 (PostgreSQL: the other process created them first)
        async with engine.begin() as conn:
            await conn.run_sync(_create_and_extend)


def _create_and_extend(conn) -> None:
    Base.metadata.create_all(conn)
    _add_missing_columns(conn)


def _add_missing_columns(conn) -> None:
    """Add the nullable columns a database made by an older version lacks (`ALTER TABLE ... ADD
    COLUMN`, which SQLite and PostgreSQL both do in place); the new indexes follow with them."""
    inspector = inspect(conn)
    for table in Base.metadata.sorted_tables:
        have = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            if not column.nullable:
                raise RuntimeError(f"table {table.name} lacks column {column.name}, which cannot be added in place")
            kind = column.type.compile(dialect=conn.dialect)
            conn.exec_driver_sql(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}")
            if column.index:
                conn.exec_driver_sql(
                    f"CREATE INDEX IF NOT EXISTS ix_{table.name}_{column.name} ON {table.name} ({column.name})"
                )


def sessions(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)


class BatchDatabase:
    """The engine and session factory over the batch tables. Each process opens one and builds
    its part of the store on it (`BatchAPIStore`, `BatchRunStore`)."""

    def __init__(self, url: str) -> None:
        self.engine: AsyncEngine = make_engine(url)
        self.session = sessions(self.engine)

    async def start(self) -> None:
        await create_tables(self.engine)

    async def close(self) -> None:
        await self.engine.dispose()
