"""The on-disk spool: JSONL files of request payloads that could not be sent (docs/transport.md).

Each file starts with a ``run`` record (the registration body, so an offline run can be registered later) followed
by one record per request: ``{"v": 1, "kind": "events"|"stats"|"finish", "n": <events>, "body": {...}}``. Bodies keep
their ids (batch_id, event ids, interval_id), so uploading a record twice never duplicates anything.

Two kinds of ``flock``, both released by the kernel when the process dies, so a crashed run's files are free:

- A writer holds an exclusive lock on the file it appends to; readers skip locked files, so nothing uploads a file a
  live run is still writing, and two uploaders never upload the same file at once.
- A writer also holds its *owner lock* (``.<writer>.owner``) from its first record until it is closed. Its finished
  files wait for its own replay; another transport or ``attnchecker sync`` uploads them only once it can take that
  lock (the writer closed or died), see :func:`claim_writer`.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

SPOOL_VERSION = 1
SUFFIX = ".jsonl"


def _fsync_dir(path: Path) -> None:
    # A new or renamed file is only durable once its directory entry is.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_line(kind: str, body: bytes, *, n: int = 0) -> bytes:
    """One spool line around an already encoded JSON body (no re-encoding of large batches)."""
    return b'{"v":%d,"kind":"%s","n":%d,"body":%s}\n' % (SPOOL_VERSION, kind.encode(), n, body)


class SpoolWriter:
    """Appends records to this writer's own files in ``spool_dir``, fsync'd, rotated by size.

    Thread-safe (one lock, held only around local file writes): the sender thread writes, and ``Transport.close``
    may write when the sender missed its deadline. Never used on the training thread's hot path.
    """

    def __init__(
        self, spool_dir: str | os.PathLike[str], run_body: bytes, *, max_file_bytes: int = 16 << 20,
        max_total_bytes: int = 1 << 30,
    ) -> None:
        self.dir = Path(spool_dir)
        self.run_body = run_body
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.prefix = uuid.uuid4().hex[:12]
        self._owner: IO[bytes] | None = None
        self._seq = 0
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self._file_bytes = 0
        self._total_bytes = 0
        self._lock = threading.Lock()

    def _open(self) -> IO[bytes]:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._owner is None:
            # Taken before the first file exists, so no other uploader ever sees this writer's files unowned.
            self._owner = open(owner_path(self.dir, self.prefix), "ab")
            fcntl.flock(self._owner.fileno(), fcntl.LOCK_EX)
        self._seq += 1
        # time first: names sort oldest first across writers, which is the order replay wants.
        path = self.dir / f"{time.time_ns():020d}-{self.prefix}-{self._seq:05d}{SUFFIX}"
        f = open(path, "ab")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        header = b'{"v":%d,"kind":"run","n":0,"body":%s}\n' % (SPOOL_VERSION, self.run_body)
        f.write(header)
        self._file, self._path, self._file_bytes = f, path, len(header)
        self._total_bytes += len(header)
        _fsync_dir(self.dir)
        return f

    def append(self, kind: str, body: bytes, *, n: int = 0) -> bool:
        """Write one record durably. False (nothing written) when the spool is over ``max_total_bytes``."""
        line = record_line(kind, body, n=n)
        with self._lock:
            if self._total_bytes + len(line) > self.max_total_bytes:
                return False
            f = self._file or self._open()
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
            self._file_bytes += len(line)
            self._total_bytes += len(line)
            if self._file_bytes >= self.max_file_bytes:
                self._rotate_locked()
        return True

    def _rotate_locked(self) -> None:
        if self._file is not None:
            self._file.close()  # releases the flock: the file is complete and may be replayed
            self._file = self._path = None

    def rotate(self) -> None:
        with self._lock:
            self._rotate_locked()

    def own_files(self) -> list[Path]:
        """This writer's complete files, oldest first (the one being appended to is not included)."""
        with self._lock:
            current = self._path
        return [p for p in list_files(self.dir) if f"-{self.prefix}-" in p.name and p != current]

    def forget(self, nbytes: int) -> None:
        """Replay uploaded and deleted ``nbytes`` of this writer's files: they no longer count against the cap."""
        with self._lock:
            self._total_bytes = max(0, self._total_bytes - nbytes)

    def close(self) -> None:
        """Close the current file and give up ownership: what is left may now be uploaded by anyone."""
        with self._lock:
            self._rotate_locked()
            if self._owner is None:
                return
            if not any(writer_of(p) == self.prefix for p in list_files(self.dir)):
                owner_path(self.dir, self.prefix).unlink(missing_ok=True)  # nothing left to own
            self._owner.close()
            self._owner = None


def writer_of(path: Path) -> str | None:
    """The writer prefix in a spool file's name (``<time_ns>-<writer>-<seq>.jsonl``), or None for another name."""
    parts = path.name.split("-")
    return parts[1] if len(parts) == 3 and path.name.endswith(SUFFIX) else None


def owner_path(spool_dir: Path, prefix: str) -> Path:
    # A dot file without the spool suffix: list_files() never takes it for data.
    return spool_dir / f".{prefix}.owner"


def list_files(spool_dir: str | os.PathLike[str]) -> list[Path]:
    d = Path(spool_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.name.endswith(SUFFIX) and p.is_file())


def _lock_now(f: IO[bytes], path: Path) -> bool:
    """Take ``f``'s lock without waiting. False when someone holds it, or when ``path`` no longer names the file we
    opened: an uploader that held the lock rewrote (replaced) or deleted it meanwhile, and the old copy is stale."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        return os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False


@contextmanager
def claim(path: Path) -> Iterator[bool]:
    """Try to take a file's lock without waiting; yields False when a live writer (or another replay) holds it, or
    the file is gone."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        yield False
        return
    with f:
        yield _lock_now(f, path)


@contextmanager
def claim_writer(spool_dir: Path, prefix: str | None) -> Iterator[bool]:
    """Take a writer's owner lock without waiting; yields False while that writer is alive (or another uploader holds
    it). A file name without a writer prefix has no owner: always True. On the way out the lock file is deleted when
    the writer has no files left."""
    if prefix is None:
        yield True
        return
    path = owner_path(spool_dir, prefix)
    try:
        f = open(path, "ab")
    except OSError:
        yield False
        return
    with f:
        mine = _lock_now(f, path)
        try:
            yield mine
        finally:
            if mine and not any(writer_of(p) == prefix for p in list_files(spool_dir)):
                path.unlink(missing_ok=True)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The file's records. A torn line (the process died mid-write, after the last fsync) is skipped and logged."""
    out = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                rec = json.loads(raw)
                if not isinstance(rec, dict) or "kind" not in rec or "body" not in rec:
                    raise ValueError("not a spool record")
            except ValueError as e:
                log.warning("spool %s line %d unreadable, skipped: %s", path, i, e)
                continue
            out.append(rec)
    return out


def rewrite(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``records`` atomically (what is left after a partial replay)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":"), allow_nan=False).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
