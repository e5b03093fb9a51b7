"""Hangs on real ranks: the watchdog dumps the flight recorder, names the culprit and the
collective, and the job exits RETRYABLE for torchrun to restart."""

import json

import pytest

from conftest import check, events, llmtrain
from llmtrain.reliability.elastic import ExitCode

pytestmark = pytest.mark.slow

TIMEOUT = 5.0
WATCH = ("--reliability.hang_timeout_s", str(TIMEOUT), "--reliability.dump_timeout_s", "3",
         "--training.steps", "40", "--checkpoint.enable", "false")
# Bound on detection + dumps + analysis after the timeout: one heartbeat interval (1 s),
# the dump wait when a rank cannot answer (3 s), and slack for a loaded 2-core machine.
BOUND = 1.0 + 3.0 + 6.0


@pytest.mark.parametrize("fault, verdict_words, culprit_stack", [
    ("hang", ["rank(s) [1] never reached", "gloo:"], "_strike"),
    ("sigstop", ["rank(s) [1] never reached", "gloo:"], None),
    ("desync", ["desync at gloo:all_reduce", "gloo:all_gather"], "_desync"),
])
def test_fault_is_diagnosed_and_restartable(tmp_path, fault, verdict_words, culprit_stack):
    run = tmp_path / "run"
    proc = llmtrain(run, *WATCH, nproc=2, env={"LLMTRAIN_FAULTS": f"{fault}@step:rank=1,step=6"})
    assert proc.returncode != 0
    assert f"exitcode  : {int(ExitCode.RETRYABLE)}" in proc.stderr  # the live rank(s)
    [hang] = events(run, "hang")
    assert hang["culprits"] == [1], hang
    for w in verdict_words:
        assert w in hang["verdict"], hang["verdict"]
    assert hang["reported_after_s"] <= TIMEOUT + BOUND
    report_dir = run / "diagnostics" / hang["id"]
    report = json.loads((report_dir / "report.json").read_text())
    assert report["culprits"] == [1] and report["collective"]["pg"]
    dumps = sorted(p.name for p in report_dir.glob("rank-*.json"))
    assert dumps == (["rank-00000.json"] if fault == "sigstop"
                     else ["rank-00000.json", "rank-00001.json"])
    if culprit_stack:
        assert culprit_stack in report["stacks"]["1"]
    assert "Python stack of rank" in (report_dir / "report.md").read_text()


def test_healthy_run_raises_no_false_alarm(tmp_path):
    run = tmp_path / "run"
    check(llmtrain(run, "--training.steps", "300", "--reliability.hang_timeout_s", "3",
                   "--checkpoint.interval_steps", "100", nproc=2))
    assert events(run, "hang") == []
    assert not list((run / "diagnostics").glob("hang-*"))
    assert events(run, "run_end")[0]["steps"] == 300
