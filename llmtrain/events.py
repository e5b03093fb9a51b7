"""The run's event log: one JSON object a line in ``<run dir>/events.jsonl``.

Everything a person or a tool needs after the fact (steps, losses, start-up phases, and
later checkpoints, hangs, restarts) lands here through fsspec, so it sits next to the
checkpoints on whatever storage the run uses and survives restarts.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import fsspec


class EventLog:
    """Appends events; each line is flushed at once so a crash loses at most one.

    Listeners (the metrics exporter) see every event this rank emits, as it is written.
    """

    def __init__(self, run_dir: str, rank: int | None):
        self.rank = rank
        self.url = f"{run_dir.rstrip('/')}/events.jsonl"
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._file = None  # opened on the first event: most ranks may never write one
        self._lock = threading.Lock()  # background checkpoint threads emit too

    def emit(self, event: str, **fields: Any) -> None:
        record = {"ts": round(time.time(), 6), "event": event, "rank": self.rank, **fields}
        with self._lock:
            if self._file is None:
                self._file = fsspec.open(self.url, "a").open()
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            for listener in self.listeners:
                listener(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _parse(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The whole lines of ``data`` as events, and how many bytes they took: a last line
    without its newline is an event still being written (or torn by a crash), not yet one.
    A line that is not an event (garbled by concurrent appends on a shared filesystem) is
    skipped, so one bad line never hides the rest of the log."""
    end = data.rfind(b"\n") + 1
    return [r for line in data[:end].splitlines() if (r := _event(line)) is not None], end


def _event(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return None
    return record if isinstance(record, dict) and "event" in record else None


def read_events(run_dir: str, event: str | None = None) -> list[dict[str, Any]]:
    """The run's events, optionally only those named ``event``."""
    with fsspec.open(f"{run_dir.rstrip('/')}/events.jsonl", "rb") as f:
        records, _ = _parse(f.read())
    return [r for r in records if event is None or r["event"] == event]


class EventTail:
    """Follows a run's event log: each ``read`` returns only the events appended since the
    last one, so that re-reading a long run's log stays cheap."""

    def __init__(self, run_dir: str, keep: frozenset[str] | None = None):
        self.url = f"{run_dir.rstrip('/')}/events.jsonl"
        self.keep = keep
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with fsspec.open(self.url, "rb") as f:
                f.seek(self.offset)
                records, used = _parse(f.read())
        except FileNotFoundError:
            return []
        self.offset += used
        return [r for r in records if self.keep is None or r["event"] in self.keep]
