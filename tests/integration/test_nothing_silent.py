"""Failures in the background say so, and a failed run's close does not wait for ever."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, events

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys, time
from llmtrain.config import load_config, parse_overrides
from llmtrain.trainer import Trainer

run = sys.argv[1]
cfg = load_config("debug_cpu", parse_overrides([
    "--training.run_dir", run, "--training.steps", "10", "--checkpoint.mode", "async_thread",
    "--checkpoint.interval_steps", "0", "--checkpoint.resume", "false",
    "--checkpoint.keep_last", "1", "--metrics.progress", "plain",
    "--reliability.faults",
    "eio@retention:step=2;eio@checkpoint_write:rank=0,step=3;hang@checkpoint_write:rank=0,step=4"]))
t = Trainer(cfg)


def save_next(wait=True):
    t.train_step(t.data.next_step())
    t.session._step += 1
    t.session.checkpoints.save(t.step, t.session.state)
    if wait:
        t.session.checkpoints.wait()


save_next()
save_next()  # committed; its retention pass fails (EIO), in DCP's completion callback
save_next()  # its write fails (EIO)
save_next(wait=False)  # its write hangs
started = time.monotonic()
t.close(failed=True, timeout_s=2.0)
print(f"closed in {time.monotonic() - started:.2f}", flush=True)
os._exit(0)  # the hung writer thread would keep the interpreter from exiting
"""


def test_failed_saves_and_retention_are_said_and_a_failed_close_is_bounded(tmp_path):
    """Retention raises inside DCP's completion callback, where only a logger would see
    it: it must be an event naming the error, the checkpoint still committed. A failed
    write is an event too. Both are said on stderr, with the frame that raised: a run
    whose saves all fail must not look healthy. A failed run's close with a write stuck
    in the storage returns within its bound, says what it left behind, and still closes
    the event log."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(run)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "closed in" in proc.stdout, proc.stderr[-3000:]
    (failed,) = events(run, "checkpoint_retention_failed")
    assert failed["step"] == 2 and "Input/output error" in failed["error"], failed
    assert [e["step"] for e in events(run, "checkpoint_committed")] == [1, 2]
    (write,) = events(run, "checkpoint_failed")
    assert write["step"] == 3 and "Input/output error" in write["error"], write
    warnings = [line for line in proc.stderr.splitlines() if "llmtrain: warning:" in line]
    assert len(warnings) == 2, proc.stderr[-3000:]
    assert "retention pass after checkpoint 2 failed" in warnings[0], warnings
    assert "checkpoint 3 failed" in warnings[1] and "(at " in warnings[1], warnings
    assert float(proc.stdout.split("closed in")[1]) < 10  # the write hangs for an hour
    (abandoned,) = events(run, "checkpoint_abandoned")
    assert abandoned["timeout_s"] == 2.0
    shutdown = [e for e in events(run, "span") if e["name"] == "shutdown"]
    assert shutdown, "the event log was not closed after the rest"
    assert json.loads((run / "events" / "rank-0.jsonl").read_text().splitlines()[-1])
