"""The event log on real storage, written by real processes: an S3 server (moto), where
nothing appends and an object shows only once uploaded, and a FUSE mount."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import fsspec
import pytest

from conftest import ROOT
from llmtrain.events import EventTail, read_events

# One process's life: ``count`` events a little apart (rank "none": through two logs, as
# the node launcher and its health gate write), then close, or wait to be killed.
WRITER = r"""
import os, sys, time
from llmtrain.events import EventLog
run_dir, rank, count, then = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
logs = [EventLog(run_dir, None if rank == "none" else int(rank))
        for _ in range(2 if rank == "none" else 1)]
for i in range(count):
    logs[i % len(logs)].emit("tick", i=i, pid=os.getpid())
    time.sleep(0.04)
if then == "hold":
    print("emitted", flush=True)
    time.sleep(600)
for log in logs:
    log.close()
"""


def writer(run_dir: str, rank, count: int, then: str = "close") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, run_dir, str(rank), str(count), then],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)


def finish(*procs: subprocess.Popen) -> None:
    for p in procs:
        assert p.wait(timeout=60) == 0


def files(run_dir: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(run_dir)
    return sorted(os.path.basename(p) for p in fs.find(f"{root}/events"))


def ticks(run_dir: str) -> Counter:
    """Events per writing process."""
    return Counter(e["pid"] for e in read_events(run_dir, "tick"))


@pytest.fixture(params=["s3", "fuse"])
def shared_run_dir(request) -> str:
    if request.param == "s3":
        return f"{request.getfixturevalue('s3_url')}/run"
    return str(request.getfixturevalue("bindfs_mount") / "run")


def test_concurrent_processes_and_a_restarted_rank_keep_every_event(shared_run_dir):
    tail, seen = EventTail(shared_run_dir, keep=frozenset({"tick"})), []
    procs = [writer(shared_run_dir, rank, 40) for rank in (0, 1, "none")]
    while any(p.poll() is None for p in procs):  # followed while written (S3: re-uploaded)
        seen += tail.read()
        time.sleep(0.3)
    finish(*procs)
    restarted = writer(shared_run_dir, 0, 5)
    finish(restarted)
    assert ticks(shared_run_dir) == {**{p.pid: 40 for p in procs}, restarted.pid: 5}
    seen += tail.read()
    assert sorted((e["pid"], e["i"]) for e in seen) == sorted(
        (e["pid"], e["i"]) for e in read_events(shared_run_dir, "tick"))  # each once
    writers = {re.sub(r"(\.[0-9a-f]{12}\.\d{6})?\.jsonl$", "", name)  # S3: segments
               for name in files(shared_run_dir)}
    assert writers == {"rank-0", "rank-1", f"launcher-{socket.gethostname()}-{procs[2].pid}"}


@pytest.mark.parametrize("storage", ["s3", "local"])
def test_a_killed_process_keeps_its_events_up_to_its_last_flush(storage, request, tmp_path):
    run_dir = (f"{request.getfixturevalue('s3_url')}/run" if storage == "s3"
               else str(tmp_path / "run"))
    proc = writer(run_dir, 0, 10, then="hold")
    try:
        assert proc.stdout.readline() == "emitted\n"
        visible, deadline = EventTail(run_dir), time.monotonic() + 10
        seen = len(visible.read())
        while seen < 10 and time.monotonic() < deadline:  # on S3: uploaded within a second
            time.sleep(0.2)
            seen += len(visible.read())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert ticks(run_dir) == {proc.pid: 10}
    restarted = writer(run_dir, 0, 3)
    finish(restarted)
    assert ticks(run_dir) == {proc.pid: 10, restarted.pid: 3}
    if storage == "local":  # appended to its predecessor's file
        assert files(run_dir) == ["rank-0.jsonl"]
    else:  # segments of its own
        assert len({name.split(".")[1] for name in files(run_dir)}) == 2
