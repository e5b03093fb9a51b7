"""The short soak: every kind of fault once against one running multi-node job."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from llmtrain.chaos.runner import KINDS
from llmtrain.config import ReliabilityConfig
from llmtrain.events import read_events

pytestmark = pytest.mark.slow


def test_every_fault_is_detected_diagnosed_and_survived(tmp_path, faultfs):
    """(The faultfs fixture only proves FUSE works here; chaos mounts its own.)"""
    work = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "llmtrain", "chaos", "--workdir", str(work),
                           "--steps", "800", "--interval", "1", "--seed", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    verdict = json.loads((work / "verdict.json").read_text())
    table = proc.stdout[-6000:]
    assert sorted(verdict["kinds"]) == sorted(KINDS), table
    for v in verdict["verdicts"]:
        assert v["detected"] and v["correct"], (v, table)
    assert verdict["finished"], table
    assert verdict["committed_checkpoints_lost"] == [], table
    assert verdict["bitwise_equal_to_reference"] is True, table
    assert 0 < verdict["ettr"] < 1 and 0 < verdict["ettr_predicted"] < 1
    assert proc.returncode == 0, table


def test_a_stopped_rank_0_is_named_and_its_dump_not_awaited(tmp_path):
    """Rank 0 hosts its round's store; the watchdogs meet in the rendezvous store instead,
    so rank 1 sees rank 0's heartbeat stop and the report names rank 0 without waiting
    ``dump_timeout_s`` for a dump a stopped process cannot write."""
    work = tmp_path / "hang0"
    proc = subprocess.run([sys.executable, "-m", "llmtrain", "chaos", "--workdir", str(work),
                           "--steps", "200", "--interval", "1", "--faults", "hang",
                           "--rank", "0", "--no-reference"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    table = proc.stdout[-3000:]
    assert proc.returncode == 0, table + proc.stderr[-3000:]
    (v,) = json.loads((work / "verdict.json").read_text())["verdicts"]
    assert v["kind"] == "hang" and v["target"].startswith("rank 0 ") and v["correct"], table
    (hang,) = read_events(str(work / "run"), "hang")
    assert hang["culprits"] == [0] and hang["rank"] == 1, hang  # rank 1 led the report
    dump_timeout_s = ReliabilityConfig().dump_timeout_s  # chaos runs with the default
    assert hang["reported_after_s"] - hang["detected_after_s"] < dump_timeout_s / 2, hang
