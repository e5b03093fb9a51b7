"""A benchmark leaves no process behind, whichever way it ends: benchmarks/watchdog.py's
SIGSTOP job (a 2-rank torchrun job whose rank 1 is stopped; torchrun's workers live in
sessions of their own), run to its end, and interrupted while the rank is stopped.

Every process the benchmark starts inherits a marker in its environment; after the
benchmark has ended, no live process may carry it."""

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, process_state

pytestmark = pytest.mark.slow

MARKER = "LLMTRAIN_TEST_BENCHMARK_RUN"
COMMAND = [sys.executable, "benchmarks/watchdog.py", "--segments", "0", "--faults", "sigstop",
           "--fault-step", "8", "--hang-timeout", "5"]


def marked(token: str) -> dict[int, str]:
    """The live processes carrying the marker: pid -> its state letter and command."""
    found = {}
    needle = f"{MARKER}={token}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            state = process_state(f"/proc/{entry}/stat")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found[int(entry)] = f"{state} {cmd}"
    return found


def left_after(token: str, grace_s: float = 5.0) -> dict[int, str]:
    """The marked processes still alive ``grace_s`` after the benchmark ended; any found
    are killed, so that a failing test leaves none either."""
    deadline = time.monotonic() + grace_s
    while (left := marked(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return left


def start(token: str) -> subprocess.Popen:
    return subprocess.Popen(COMMAND, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, MARKER: token,
                                            "OMP_NUM_THREADS": "1"})


def test_watchdog_benchmark_leaves_no_process(tmp_path):
    token = secrets.token_hex(8)
    proc = start(token)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        left = left_after(token)
    assert not left, left
    assert proc.returncode == 0, err[-3000:]
    assert '"sigstop_detected_s": ' in out and '"sigstop_detected_s": null' not in out, out


def test_watchdog_benchmark_terminated_mid_fault_leaves_no_process(tmp_path):
    """SIGTERM while rank 1 is stopped: the benchmark unwinds as on Ctrl-C, and ends the
    job, stopped rank and all, on its way out."""
    token = secrets.token_hex(8)
    proc = start(token)
    try:
        deadline = time.monotonic() + 240
        while not any(v.startswith("T") for v in marked(token).values()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no rank was stopped within 240 s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        left = left_after(token)
    assert not left, left
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, (proc.returncode, err[-3000:])
