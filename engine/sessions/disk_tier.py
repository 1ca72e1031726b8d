"""Disk copies of kept sessions: one KV file per session, written by one background thread.

Files live in `<session_dir>/<layout fingerprint>/<sha256(session_id)[:32]>.kv`, so a worker
restarted with another model or dtype never mistakes old files for its own. The engine
thread queues writes (the session's immutable host tensors) and deletions; a session with a
write still queued is coalesced to its latest version, so a fast-talking session costs one
file write per writer pass, not one per turn. `entries` is the index the engine thread
keeps; readers in other threads take `lock`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.sessions.kvfile import KVFormatError, KVHeader, KVLayout, read_file_header, write_kv_file

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


@dataclass(frozen=True)
class WriteResult:
    session_id: str
    nbytes: int  # bytes written (0 for a deletion or a failure)
    error: str | None


class DiskTier:
    def __init__(self, root: str | Path, layout: KVLayout) -> None:
        self.layout = layout
        self.dir = Path(root) / layout.fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, DiskEntry] = {}
        self.lock = threading.Condition()
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
        return sum(e.nbytes for e in self.entries.values())

    # -- engine thread ------------------------------------------------------------------

    def write(
        self,
        session_id: str,
        token_ids: Sequence[int],
        layers: Sequence[torch.Tensor],
        nbytes: int,
        last_activity: float,
    ) -> None:
        path = self.path_for(session_id)
        with self.lock:
            self.entries[session_id] = DiskEntry(path, nbytes, len(token_ids), last_activity)
            self._enqueue(_Job(session_id, path, tuple(token_ids), tuple(layers)))

    def delete(self, session_id: str) -> None:
        with self.lock:
            self.entries.pop(session_id, None)
            self._enqueue(_Job(session_id, self.path_for(session_id), None))

    def install(self, session_id: str, header: KVHeader, src: Path, last_activity: float) -> Path:
        """Move a verified file in as this session's copy (after any queued job for it)."""
        self.wait(session_id)
        path = self.path_for(session_id)
        with self.lock:
            _move_atomically(src, path)
            self.entries[session_id] = DiskEntry(path, header.file_size, header.num_tokens, last_activity)
        return path

    def take_results(self) -> list[WriteResult]:
        if not self._results:
            return []
        with self.lock:
            results, self._results = self._results, []
        return results

    def reindex(self) -> list[tuple[KVHeader, DiskEntry]]:
        """Headers of this layout's files already on disk (a restart); others are skipped."""
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write cut short by the previous process
        found = []
        for path in sorted(self.dir.glob("*.kv")):
            header = self._index_one(path)
            if header is not None:
                entry = DiskEntry(path, path.stat().st_size, header.num_tokens, path.stat().st_mtime)
                self.entries[header.session_id] = entry
                found.append((header, entry))
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
        """Block until no write or deletion of this session is queued or running."""
        with self.lock:
            return self.lock.wait_for(lambda: session_id not in self._latest and self._in_flight != session_id, timeout)

    def flush(self, timeout: float | None = None) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: not self._queue and self._in_flight is None, timeout)

    def close(self) -> None:
        with self.lock:
            self._closing = True
            self.lock.notify_all()
        self._thread.join()

    # -- writer thread ------------------------------------------------------------------

    def _enqueue(self, job: _Job) -> None:
        if job.session_id not in self._latest:
            self._queue.append(job.session_id)
        self._latest[job.session_id] = job
        self.lock.notify_all()

    def _run(self) -> None:
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                sid = self._queue.popleft()
                job = self._latest.pop(sid)
                self._in_flight = sid
            result = self._execute(job)
            with self.lock:
                self._in_flight = None
                self._results.append(result)
                self.lock.notify_all()

    def _execute(self, job: _Job) -> WriteResult:
        try:
            if job.token_ids is None:
                job.path.unlink(missing_ok=True)
                return WriteResult(job.session_id, 0, None)
            size = write_kv_file(job.path, job.session_id, job.token_ids, self.layout, job.layers)
            return WriteResult(job.session_id, size, None)
        except Exception as exc:  # noqa: BLE001 (a full disk must not kill the writer; the store drops the entry)
            log.error("writing session %r to %s failed: %s", job.session_id, job.path, exc)
            return WriteResult(job.session_id, 0, str(exc))


def _move_atomically(src: Path, dst: Path) -> None:
    """Rename, or (another file system) copy beside `dst` and rename: readers never see half a file."""
    try:
        src.replace(dst)
    except OSError:
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
        shutil.copyfile(src, tmp)
        tmp.replace(dst)
        src.unlink()
