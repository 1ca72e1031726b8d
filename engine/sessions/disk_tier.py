"""Disk copies of kept sessions: one KV file per session, written by one background thread.

Files live in `<session_dir>/<layout fingerprint>/<sha256(session_id)[:32]>.kv`, so a worker
restarted with another model or dtype never mistakes old files for its own. The engine
thread queues writes (the session's immutable host tensors) and deletions; a session with a
write still queued is coalesced to its latest version, so a fast-talking session costs one
file write per writer pass, not one per turn. A deletion coalesces with a queued write too:
a session dropped before its file was written is never written.

`BaseDiskTier` is what the session store uses. `DiskTier` is the file-backed tier;
`NullDiskTier` stands in when `session_dir` is unset, so the store has no "is there a disk
tier?" branches: it holds nothing, accepts every write as a no-op and fits any budget.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.sessions.kvfile import KVFormatError, KVHeader, KVLayout, file_size, read_file_header, write_kv_file

log = logging.getLogger(__name__)


@dataclass
class DiskEntry:
    path: Path
    nbytes: int
    num_tokens: int
    last_activity: float


@dataclass(frozen=True)
class _Job:
    session_id: str
    path: Path
    token_ids: tuple[int, ...] | None  # None: delete the file
    layers: Sequence[torch.Tensor] = ()
    entry: DiskEntry | None = None  # the index entry this write creates (None for a deletion)
    hash_root: bytes | None = None  # a salted session's hash root, recorded in the header


@dataclass(frozen=True)
class WriteResult:
    session_id: str
    nbytes: int  # bytes written (0 for a deletion or a failure)
    error: str | None
    # the index entry the job wrote: a failure forgets it only while it is still the current one
    entry: DiskEntry | None = field(default=None, compare=False, repr=False)


class BaseDiskTier(ABC):
    """The session store's view of the disk tier. Engine-thread methods unless marked."""

    enabled: bool  # False: nothing is ever kept on disk (the host tier then evicts whole sessions)
    dir: Path | None  # where this layout's files live

    @abstractmethod
    def holds(self, session_id: str) -> bool:
        """Whether the session has a disk copy (written, or queued to be). Any thread."""

    @abstractmethod
    def file_of(self, session_id: str) -> Path | None:
        """The session's file, which may still be queued for writing (see `wait`)."""

    @abstractmethod
    def file_size(self, session_id: str, token_ids: Sequence[int], hash_root: bytes | None = None) -> int:
        """The size the session's file would have."""

    @abstractmethod
    def fits(self, nbytes: int) -> bool:
        """Whether a file of `nbytes` fits the budget at all (with every other file gone)."""

    @abstractmethod
    def victims(self, incoming: int, exclude: str | None, is_busy: Callable[[str], bool]) -> list[str]:
        """Sessions to drop, least recently active first, so that `incoming` more bytes fit.
        `exclude` (the session being written, whose old file is replaced) and busy sessions
        are never chosen; the tier does not drop them itself (that is every tier's business)."""

    @abstractmethod
    def write(
        self,
        session_id: str,
        token_ids: Sequence[int],
        layers: Sequence[torch.Tensor],
        nbytes: int,
        now: float,
        hash_root: bytes | None = None,
    ) -> None:
        """Queue the session's file (the layers are read later, from the writer thread)."""

    @abstractmethod
    def delete(self, session_id: str) -> None:
        """Forget the session and queue the deletion of its file."""

    @abstractmethod
    def install(self, session_id: str, header: KVHeader, src: Path, now: float) -> bool:
        """Move a verified file in as the session's copy. False: this tier keeps no files, the
        caller must keep the content elsewhere."""

    @abstractmethod
    def reindex(self) -> list[tuple[KVHeader, DiskEntry]]:
        """Index the files a previous process left (a restart)."""

    @property
    @abstractmethod
    def has_results(self) -> bool:
        """Whether finished writes wait to be collected by `take_results`."""

    @abstractmethod
    def take_results(self) -> list[WriteResult]:
        """Finished writes and deletions since the last call. A failed write's session is no
        longer held (unless a newer copy was queued since)."""

    @abstractmethod
    def wait(self, session_id: str, timeout: float | None = None) -> bool:
        """Block until no write or deletion of the session is queued or running. Any thread."""

    @abstractmethod
    def export_path(self, session_id: str) -> Path | None:
        """The session's file once any queued write of it is done; None without one. Any thread."""

    @abstractmethod
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every queued write. Any thread."""

    @abstractmethod
    def close(self) -> None:
        """Flush and stop the writer."""


def make_disk_tier(session_dir: str | Path | None, layout: KVLayout, budget_bytes: int) -> BaseDiskTier:
    return DiskTier(session_dir, layout, budget_bytes) if session_dir else NullDiskTier()


class NullDiskTier(BaseDiskTier):
    """No disk tier: holds nothing, writes nothing, fits everything."""

    enabled = False
    dir = None
    has_results = False

    def holds(self, session_id):
        return False

    def file_of(self, session_id):
        return None

    def file_size(self, session_id, token_ids, hash_root=None):
        return 0

    def fits(self, nbytes):
        return True

    def victims(self, incoming, exclude, is_busy):
        return []

    def write(self, session_id, token_ids, layers, nbytes, now, hash_root=None):
        pass

    def delete(self, session_id):
        pass

    def install(self, session_id, header, src, now):
        return False

    def reindex(self):
        return []

    def take_results(self):
        return []

    def wait(self, session_id, timeout=None):
        return True

    def export_path(self, session_id):
        return None

    def flush(self, timeout=None):
        return True

    def close(self):
        pass


class DiskTier(BaseDiskTier):
    """`_entries` is the index the engine thread keeps; readers in other threads take `_lock`."""

    enabled = True

    def __init__(self, root: str | Path, layout: KVLayout, budget_bytes: int | None = None) -> None:
        """`budget_bytes`: None for no budget (tests of the writer alone)."""
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.dir = Path(root) / layout.fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, DiskEntry] = {}
        self._lock = threading.Condition()
        self._queue: deque[str] = deque()
        self._latest: dict[str, _Job] = {}  # queued, not yet started
        self._in_flight: str | None = None
        self._results: list[WriteResult] = []
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tandem-kv-writer", daemon=True)
        self._thread.start()

    def path_for(self, session_id: str) -> Path:
        return self.dir / f"{hashlib.sha256(session_id.encode()).hexdigest()[:32]}.kv"

    @property
    def has_results(self) -> bool:
        return bool(self._results)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    # -- engine thread ------------------------------------------------------------------

    def holds(self, session_id: str) -> bool:
        return session_id in self._entries

    def file_of(self, session_id: str) -> Path | None:
        entry = self._entries.get(session_id)
        return None if entry is None else entry.path

    def file_size(self, session_id: str, token_ids: Sequence[int], hash_root: bytes | None = None) -> int:
        return file_size(session_id, token_ids, self.layout, hash_root)

    def fits(self, nbytes: int) -> bool:
        return self.budget_bytes is None or nbytes <= self.budget_bytes

    def victims(self, incoming: int, exclude: str | None, is_busy: Callable[[str], bool]) -> list[str]:
        if self.budget_bytes is None:
            return []
        entries = self._entries
        total = self.nbytes - (entries[exclude].nbytes if exclude in entries else 0)
        chosen = []
        for sid in sorted(entries, key=lambda s: entries[s].last_activity):
            if total + incoming <= self.budget_bytes:
                break
            if sid == exclude or is_busy(sid):
                continue
            total -= entries[sid].nbytes
            chosen.append(sid)
        return chosen

    def write(
        self,
        session_id: str,
        token_ids: Sequence[int],
        layers: Sequence[torch.Tensor],
        nbytes: int,
        now: float,
        hash_root: bytes | None = None,
    ) -> None:
        path = self.path_for(session_id)
        entry = DiskEntry(path, nbytes, len(token_ids), now)
        with self._lock:
            self._entries[session_id] = entry
            self._enqueue(_Job(session_id, path, tuple(token_ids), tuple(layers), entry, hash_root))

    def delete(self, session_id: str) -> None:
        with self._lock:
            self._entries.pop(session_id, None)
            self._enqueue(_Job(session_id, self.path_for(session_id), None))

    def install(self, session_id: str, header: KVHeader, src: Path, now: float) -> bool:
        self.wait(session_id)  # after any queued job for it
        path = self.path_for(session_id)
        with self._lock:
            _move_atomically(src, path)
            self._entries[session_id] = DiskEntry(path, header.file_size, header.num_tokens, now)
        return True

    def take_results(self) -> list[WriteResult]:
        if not self._results:
            return []
        with self._lock:
            results, self._results = self._results, []
            for result in results:
                failed = result.error is not None and result.entry is not None
                if failed and self._entries.get(result.session_id) is result.entry:
                    del self._entries[result.session_id]  # a newer queued copy keeps its entry
        return results

    def reindex(self) -> list[tuple[KVHeader, DiskEntry]]:
        """Headers of this layout's files already on disk; other layouts are skipped."""
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write cut short by the previous process
        found = []
        for path in sorted(self.dir.glob("*.kv")):
            header = self._index_one(path)
            if header is not None:
                entry = DiskEntry(path, path.stat().st_size, header.num_tokens, path.stat().st_mtime)
                self._entries[header.session_id] = entry
                found.append((header, entry))
        if found:
            log.info("session store: %d sessions re-indexed from %s", len(found), self.dir)
        others = [p.name for p in self.dir.parent.iterdir() if p.is_dir() and p != self.dir]
        if others:
            log.info("session dir %s: ignoring %d directories of other model layouts", self.dir.parent, len(others))
        return found

    def _index_one(self, path: Path) -> KVHeader | None:
        try:
            header = read_file_header(path, self.layout)
        except (OSError, KVFormatError) as exc:
            log.warning("ignoring session file %s: %s", path, exc)
            return None
        if self.path_for(header.session_id) != path:
            log.warning("ignoring session file %s: its name does not match session %r", path, header.session_id)
            return None
        return header

    # -- any thread ---------------------------------------------------------------------

    def wait(self, session_id: str, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(
                lambda: session_id not in self._latest and self._in_flight != session_id, timeout
            )

    def export_path(self, session_id: str) -> Path | None:
        self.wait(session_id)
        with self._lock:
            entry = self._entries.get(session_id)
            return entry.path if entry is not None and entry.path.exists() else None

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: not self._queue and self._in_flight is None, timeout)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join()

    # -- writer thread ------------------------------------------------------------------

    def _enqueue(self, job: _Job) -> None:
        if job.session_id not in self._latest:
            self._queue.append(job.session_id)
        self._latest[job.session_id] = job
        self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                sid = self._queue.popleft()
                job = self._latest.pop(sid)
                self._in_flight = sid
            result = self._execute(job)
            with self._lock:
                self._in_flight = None
                self._results.append(result)
                self._lock.notify_all()

    def _execute(self, job: _Job) -> WriteResult:
        try:
            if job.token_ids is None:
                job.path.unlink(missing_ok=True)
                return WriteResult(job.session_id, 0, None)
            size = write_kv_file(job.path, job.session_id, job.token_ids, self.layout, job.layers, job.hash_root)
            return WriteResult(job.session_id, size, None, job.entry)
        except Exception as exc:  # noqa: BLE001 (a full disk must not kill the writer; the entry is dropped)
            log.error("writing session %r to %s failed: %s", job.session_id, job.path, exc)
            return WriteResult(job.session_id, 0, str(exc), job.entry)


def _move_atomically(src: Path, dst: Path) -> None:
    """Rename, or (another file system) copy beside `dst` and rename: readers never see half a file."""
    try:
        src.replace(dst)
    except OSError:
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
        shutil.copyfile(src, tmp)
        tmp.replace(dst)
        src.unlink()
