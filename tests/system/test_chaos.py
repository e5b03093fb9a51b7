"""The short soak: every kind of fault once against one running multi-node job."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

from llmtrain.reliability.chaos import KINDS

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
