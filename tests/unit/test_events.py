"""The event log: one file per process, read back merged; what a crash or a misbehaving
filesystem leaves is skipped, never fatal, so the launcher, goodput, the exporter and the
report all read on."""

import json
import os
import socket
import stat
import time
import uuid

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from llmtrain import events
from llmtrain.events import EventLog, EventTail, read_events
from logs import logged


def line(ts: float, step: int) -> bytes:
    return json.dumps({"ts": ts, "event": "step", "step": step}).encode() + b"\n"


def test_torn_last_lines_and_garbled_middle_lines_are_skipped_in_every_file(tmp_path):
    log = EventLog(str(tmp_path), rank=0)
    log.emit("step", step=1)
    log.close()
    rank0, rank1 = tmp_path / "events" / "rank-0.jsonl", tmp_path / "events" / "rank-1.jsonl"
    with open(rank0, "ab") as f:
        f.write(b'{"ts": 1, "eve\x00\xff garbled by a crash\n')           # a bad middle line
        f.write(b'[1, 2]\n{"event": "step", "ts": "no time"}\n' + line(2e9 + 2, 2))
        f.write(b'{"ts": 3, "event": "st')                               # torn: no newline
    rank1.write_bytes(line(2e9 + 1, 11) + b"\xff\xfe\n" + line(2e9 + 3, 12) + b'{"ts": 4, "ev')
    (tmp_path / "events.jsonl").write_bytes(line(1, 0) + b"garbled\n" + b'{"ts"')  # legacy
    tail = EventTail(str(tmp_path))
    assert [e["step"] for e in read_events(str(tmp_path), "step")] == [0, 1, 11, 2, 12]
    assert [e["step"] for e in tail.read()] == [0, 1, 11, 2, 12]
    with open(rank0, "ab") as f:  # the torn lines' writers finish them
        f.write(b'ep", "ts": 2000000004, "step": 3}\n')
    with open(rank1, "ab") as f:
        f.write(b'ent": "step", "ts": 2000000005, "step": 13}\n')
    assert [e["step"] for e in tail.read()] == [3, 13]
    assert [e["step"] for e in read_events(str(tmp_path), "step")] == [0, 1, 11, 2, 12, 3, 13]


def test_tail_reads_only_new_bytes_of_each_file_and_finds_new_files(tmp_path, monkeypatch):
    reads = []
    cat_file = LocalFileSystem.cat_file

    def spy(self, path, start=None, end=None, **kwargs):
        reads.append((os.path.basename(path), start))
        return cat_file(self, path, start=start, end=end, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "cat_file", spy)
    a, b = EventLog(str(tmp_path), rank=0), EventLog(str(tmp_path), rank=1)
    tail = EventTail(str(tmp_path), keep=frozenset({"step"}))
    assert tail.read() == []  # no log yet
    a.emit("step", step=1)
    a.emit("other")
    assert [e["step"] for e in tail.read()] == [1]
    size = (tmp_path / "events" / "rank-0.jsonl").stat().st_size
    reads.clear()
    assert tail.read() == [] and reads == []  # nothing new: nothing read
    b.emit("step", step=2)  # a new file
    a.emit("step", step=3)
    assert [e["step"] for e in tail.read()] == [2, 3]
    assert sorted(reads) == [("rank-0.jsonl", size), ("rank-1.jsonl", 0)]
    a.close()
    b.close()


def test_object_store_segments_grow_then_roll_over_and_are_followed(monkeypatch):
    """Storage without append (``memory://`` takes the object-store path): each upload
    replaces the current segment with a longer one, until it is full."""
    fs = fsspec.filesystem("memory")
    monkeypatch.setattr(events, "UPLOAD_EVERY_S", 0.01)
    monkeypatch.setattr(events, "SEGMENT_BYTES", 150)  # 3 events
    run_dir = f"memory://runs/{uuid.uuid4().hex}"
    log, tail, seen = EventLog(run_dir, rank=3), EventTail(run_dir), []
    try:
        for i in range(8):
            log.emit("tick", i=i)
            deadline = time.monotonic() + 10
            while len(seen) <= i and time.monotonic() < deadline:
                seen += tail.read()
        log.close()
        assert [e["i"] for e in seen] == list(range(8))
        assert [e["i"] for e in read_events(run_dir)] == list(range(8))
        names = sorted(os.path.basename(p) for p in fs.find(run_dir.removeprefix("memory://")))
        assert len({n.split(".")[1] for n in names}) == 1  # one process: one token
        assert [n.split(".")[2] for n in names] == [f"{s:06d}" for s in range(len(names))]
        assert len(names) >= 3
    finally:
        fs.rm(run_dir.removeprefix("memory://"), recursive=True)


def test_a_failed_upload_is_retried_and_said_once(monkeypatch):
    fs, errors = fsspec.filesystem("memory"), [OSError("503 Slow Down")] * 3
    pipe_file = type(fs).pipe_file

    def flaky(self, path, value, **kwargs):
        if errors:
            raise errors.pop()
        return pipe_file(self, path, value, **kwargs)

    monkeypatch.setattr(type(fs), "pipe_file", flaky)
    monkeypatch.setattr(events, "UPLOAD_EVERY_S", 0.01)
    run_dir = f"memory://runs/{uuid.uuid4().hex}"
    log, tail, seen = EventLog(run_dir, rank=0), EventTail(run_dir), []
    try:
        with logged() as said:
            log.emit("tick")
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                seen += tail.read()
            log.close()
        assert [e["event"] for e in seen] == ["tick"] and not errors
        assert "\n".join(said).count("503 Slow Down") == 1, said
    finally:
        fs.rm(run_dir.removeprefix("memory://"), recursive=True)


def test_launcher_files_are_per_process_and_a_restarted_rank_appends(tmp_path):
    for rank in (0, None, 0, None):
        log = EventLog(str(tmp_path), rank)
        log.emit("hello")
        log.close()
    launcher = f"launcher-{socket.gethostname()}-{os.getpid()}.jsonl"
    assert sorted(os.listdir(tmp_path / "events")) == [launcher, "rank-0.jsonl"]
    assert [e["rank"] for e in read_events(str(tmp_path))] == [0, None, 0, None]


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_event_files_are_0o644_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        log = EventLog(str(tmp_path), rank=0)
        log.emit("hello")
        log.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "events" / "rank-0.jsonl").stat().st_mode) == 0o644
    assert not stat.S_IMODE((tmp_path / "events").stat().st_mode) & 0o022


def test_no_event_log_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no event log"):
        read_events(str(tmp_path))
