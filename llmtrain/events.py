"""The run's event log: one JSON object a line, one file per process under
``<run dir>/events/``.

Everything a person or a tool needs after the fact (steps, losses, start-up phases,
checkpoints, hangs, restarts) lands here through fsspec, so it sits next to the
checkpoints on whatever storage the run uses and survives restarts. Every process writes
files of its own: one file shared by ranks on many hosts needs atomic appends, which NFS
does not promise across hosts and object stores do not have at all (each writer replaces
the whole object, last writer wins, and nothing shows before the writer closes it).

How a process writes, per kind of storage (``fsio.is_local``):

- local disks, NFS and FUSE mounts: ``rank-<N>.jsonl``, or ``launcher-<host>-<pid>.jsonl``
  for a process without a rank (the node launcher), opened for append and created 0o644
  whatever the umask. Each line is one write, flushed at once, so a killed process loses
  nothing it emitted. A restarted rank appends to its predecessor's file: one writer at a
  time, since a rank's successor starts once it has died.
- object stores and any other fsspec storage: ``<name>.<token>.<segment>.jsonl``, the
  token new for each log a process opens. A background thread uploads the current segment
  whole (one PUT, atomic) at most once every ``UPLOAD_EVERY_S`` and at close, so a burst
  of events costs one upload, and a killed process keeps everything up to its last upload.
  A segment only grows, and once it holds ``SEGMENT_BYTES`` the next one begins, which
  bounds what each upload re-sends.

Readers list ``events/`` and read every file from where they stopped (a file, or a
segment, only ever grows), merging by ``ts``. A run dir of an older version keeps its
single ``events.jsonl``; it is read too, once, since nothing writes it any more.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

import fsspec

from llmtrain.fsio import is_local, join

log = logging.getLogger(__name__)

UPLOAD_EVERY_S = 1.0
SEGMENT_BYTES = 256 << 10
LEGACY = "events.jsonl"


class EventLog:
    """Writes this process's events; listeners (the metrics exporter) see every event as
    it is written."""

    def __init__(self, run_dir: str, rank: int | None):
        self.run_dir, self.rank = run_dir, rank
        self.name = (f"rank-{rank}" if rank is not None
                     else f"launcher-{socket.gethostname()}-{os.getpid()}")
        self.dir = join(run_dir, "events")
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._writer: _Appender | _Uploader | None = None  # most ranks may never write one
        self._lock = threading.Lock()  # background checkpoint threads emit too
        self.silenced = False

    def emit(self, event: str, **fields: Any) -> None:
        record = {"ts": round(time.time(), 6), "event": event, "rank": self.rank, **fields}
        with self._lock:
            if self.silenced:
                return
            writer = self._writer = self._writer or self._open()
            writer.write((json.dumps(record) + "\n").encode())
            for listener in self.listeners:
                listener(record)

    def emit_once(self, event: str, **fields: Any) -> None:
        """An event every rank would report alike, written once: by rank 0."""
        if self.rank == 0:
            self.emit(event, **fields)

    def _open(self) -> _Appender | _Uploader:
        fs, path = fsspec.core.url_to_fs(self.dir)
        if is_local(fs):
            return _Appender(join(path, f"{self.name}.jsonl"))
        return _Uploader(fs, path, f"{self.name}.{uuid.uuid4().hex[:12]}")

    def silence(self) -> None:
        """Nothing this process emits from now on is written or seen: it was fenced out
        of the job (:mod:`llmtrain.recovery.fence`), and its events would read as the
        job's."""
        with self._lock:
            self.silenced = True

    def close(self) -> None:
        """Without the lock: the watchdog closes the log of a rank that may be stuck."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


class _Appender:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        try:
            fd = os.open(path, flags | os.O_EXCL, 0o644)
            os.fchmod(fd, 0o644)  # not what the umask leaves: never world-writable
        except FileExistsError:  # a restarted rank: append to its predecessor's events
            fd = os.open(path, flags)
        self.file = os.fdopen(fd, "ab")

    def write(self, line: bytes) -> None:
        self.file.write(line)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _Uploader:
    def __init__(self, fs: fsspec.AbstractFileSystem, dir_path: str, stem: str):
        self.fs, self.stem = fs, join(dir_path, stem)
        fs.makedirs(dir_path, exist_ok=True)
        self.segment, self.data, self.dirty, self.failing = 0, bytearray(), False, False
        self.lock = threading.Lock()       # writers vs. the upload's snapshot
        self.uploading = threading.Lock()  # one upload at a time, so the newest lands last
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="event-upload", daemon=True)
        self.thread.start()
        atexit.register(self.close)  # a process that ends without closing its log

    def write(self, line: bytes) -> None:
        with self.lock:
            self.data += line
            self.dirty = True

    def _run(self) -> None:
        while not self.stop.wait(UPLOAD_EVERY_S):
            self.upload()

    def upload(self) -> None:
        with self.uploading:
            with self.lock:
                if not self.dirty:
                    return
                data, self.dirty = bytes(self.data), False
            url = f"{self.stem}.{self.segment:06d}.jsonl"
            try:
                self.fs.pipe_file(url, data)
            except Exception as e:  # a transient store error: the next upload retries
                with self.lock:
                    self.dirty = True
                if not self.failing:  # once per outage, not once a second
                    log.warning("llmtrain: event log upload to %s failed (%s: %s); retrying "
                                "every %g s", url, type(e).__name__, e, UPLOAD_EVERY_S)
                self.failing = True
                return
            self.failing = False
            if len(data) >= SEGMENT_BYTES:
                with self.lock:
                    del self.data[:len(data)]
                    self.segment += 1

    def close(self) -> None:
        atexit.unregister(self.close)
        self.stop.set()
        self.thread.join()
        self.upload()


def _parse(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The whole lines of ``data`` as events, and how many bytes they took: a last line
    without its newline is an event still being written (or torn by a crash), not yet one.
    A line that is not an event (garbled by a crash or a misbehaving shared filesystem) is
    skipped, so one bad line never hides the rest of the log."""
    end = data.rfind(b"\n") + 1
    return [r for line in data[:end].splitlines() if (r := _event(line)) is not None], end


def _event(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return None
    ok = (isinstance(record, dict) and "event" in record
          and isinstance(record.get("ts"), (int, float)))  # merged by it
    return record if ok else None


def read_events(run_dir: str, event: str | None = None,
                writer: str | None = None) -> list[dict[str, Any]]:
    """Every process's events in time order, optionally only those named ``event``, or
    only those one process wrote (``writer``: its log's name, ``rank-<N>``);
    FileNotFoundError when the run has no event log (yet)."""
    tail = EventTail(run_dir, keep=None if event is None else frozenset({event}),
                     writer=writer)
    records = tail.read()
    if not tail.offsets:
        raise FileNotFoundError(f"no event log in {run_dir} (no events/ or {LEGACY})")
    return records


class EventTail:
    """Follows a run's event log: each ``read`` returns only the events written since the
    last one, in time order, reading only the new bytes of each file (files that appeared
    since included), so that re-reading a long run's log stays cheap. With ``writer`` (a
    log's name, ``rank-<N>``), only the files that process wrote (and an older version's
    single log)."""

    def __init__(self, run_dir: str, keep: frozenset[str] | None = None,
                 writer: str | None = None):
        self.fs, root = fsspec.core.url_to_fs(run_dir)
        self.dir, self.legacy = join(root, "events"), join(root, LEGACY)
        self.keep = keep
        self.prefix = None if writer is None else f"{writer}."  # rank-1.jsonl, rank-1.<token>...
        self.offsets: dict[str, int] = {}  # every file seen: the bytes read of it
        self.legacy_read = False

    def read(self) -> list[dict[str, Any]]:
        records = []
        if not self.legacy_read:
            self.legacy_read = True
            try:
                records, self.offsets[self.legacy] = _parse(self.fs.cat_file(self.legacy))
            except FileNotFoundError:
                pass
        self.fs.invalidate_cache(self.dir)  # other processes write here: list afresh
        for path, info in sorted(self.fs.find(self.dir, detail=True).items()):
            if not path.endswith(".jsonl") or (
                    self.prefix and not path.rpartition("/")[2].startswith(self.prefix)):
                continue
            start = self.offsets.setdefault(path, 0)
            if info["size"] > start:
                got, used = _parse(self.fs.cat_file(path, start=start))
                records += got
                self.offsets[path] = start + used
        records.sort(key=lambda r: r["ts"])
        return [r for r in records if self.keep is None or r["event"] in self.keep]
