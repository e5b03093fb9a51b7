"""A chaos verdict never counts a kind that did not run (llmtrain/chaos/summary.py): a
kind left out for want of network namespaces has no row, no rate and no share of the
totals; the table names it as not run; under CI=true it fails the run, and outside CI
the run passes only on what did run, saying what was skipped."""

import random
import time

import pytest

from llmtrain.chaos.job import Job, JobStopped
from llmtrain.chaos.runner import Chaos, ChaosConfig
from llmtrain.chaos.summary import by_kind, passed, table, weighted
from llmtrain.chaos.verdict import Verdict
from llmtrain.events import EventLog


def _result(chaos: Chaos, verdicts: list[Verdict]) -> dict:
    """A finished run's result, as ``Chaos.execute`` assembles it, with ``verdicts``."""
    rows = [vars(v) for v in verdicts]
    return {"finished": True, "steps": 400, "faults": len(rows),
            "kinds": sorted({v.kind for v in verdicts}),
            "detected": sum(v.detected for v in verdicts),
            "correct": sum(v.correct for v in verdicts),
            "committed_checkpoints_lost": [],
            **chaos.kinds_result({v.kind for v in verdicts}),
            "final_checkpoint_committed": True, "verdicts": rows}


def _recovered(kind: str) -> Verdict:
    return Verdict(kind, "rank 0 (node1)", 100, 0.0, detected=True, detect_s=1.0,
                   correct=True, recover_s=2.0, steps_lost=1, path="warm")


def test_a_kind_left_out_for_want_of_namespaces_is_not_run_and_counted_nowhere(tmp_path):
    chaos = Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults="kill_rank,partition"))
    chaos.leave_out("network namespaces need root")  # what execute does on loopback
    assert chaos.left_out == {"partition": "nodes on loopback (network namespaces need root)"}
    result = _result(chaos, [_recovered("kill_rank")])
    assert result["not_run"] == {"partition": chaos.left_out["partition"]}
    assert result["kinds"] == ["kill_rank"] and result["faults"] == 1
    # never recovered, warm or otherwise: no row, no path
    assert "partition" not in {v["kind"] for v in result["verdicts"]}
    per_kind = by_kind(result["verdicts"], result["not_run"]).splitlines()
    (row,) = [line for line in per_kind if line.startswith("partition")]
    assert "NOT RUN" in row and "warm" not in row and "  0  " in row
    # under CI=true a requested kind that did not run fails the run; outside, the run
    # passes on what ran, and the table says what was skipped
    assert passed(result, ci=True) is False
    assert passed(result, ci=False) is True
    text = table(result, ci=False)
    assert "NOT RUN: partition (nodes on loopback (network namespaces need root)): " \
           "skipped, counted nowhere" in text
    assert "under CI=true that fails the run" in table(result, ci=True)
    assert "faults detected: 1/1, diagnosed right: 1/1" in text


def test_a_kind_that_did_not_run_holds_no_share_of_a_mixs_rates(tmp_path):
    chaos = Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"),
                              mix={"kill_rank": 1.0, "partition": 3.0}))
    chaos.leave_out("--no-netns")
    assert [k.name for k in chaos.requested()] == ["kill_rank", "partition"]
    result = _result(chaos, [_recovered("kill_rank")])
    assert result["not_run"] == {"partition": "nodes on loopback (--no-netns)"}
    rates = weighted(result["verdicts"], {"kill_rank": 1.0, "partition": 3.0})
    assert rates["mix_covered"] == 0.25  # partition's weight is not covered


def test_only_the_kinds_a_run_asks_for_are_left_out(tmp_path):
    """On loopback, a run that asked for no kind needing namespaces leaves none out."""
    chaos = Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults="hang,kill_rank"))
    chaos.leave_out("network namespaces need root")
    result = _result(chaos, [_recovered("hang"), _recovered("kill_rank")])
    assert result["left_out"] == {} and result["not_run"] == {}
    assert passed(result, ci=True) is True


def test_a_run_where_no_fault_ran_does_not_pass(tmp_path):
    chaos = Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults="partition"))
    chaos.leave_out("network namespaces need root")
    result = _result(chaos, [])
    assert passed(result, ci=False) is False
    assert "no fault ran: nothing was tested" in table(result, ci=False)


def test_a_kind_the_steps_left_no_room_for_is_not_run(tmp_path):
    chaos = Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults="hang,store_stall"))
    chaos.no_room.append("store_stall")
    result = _result(chaos, [_recovered("hang")])
    assert result["not_run"] == {"store_stall": "no room: the job neared its last step first"}
    assert passed(result, ci=False) is False  # no room fails everywhere


def test_a_job_ended_by_a_fatal_error_ends_the_schedule_at_once(tmp_path, capsys):
    """A run stopped as diverged once waited out 180 s for a grow and 300 s for a full
    world before the chaos run failed with no verdict: its waits now end at the ``fatal``
    event, and the schedule with them, every kind left counted as not run."""
    chaos = Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults="kill_rank,hang"))
    job = Job(chaos.cfg, tmp_path, ["node1", "node2"], 0, cluster=None, mount=None,
              network=None, faults_file=tmp_path / "faults.txt", rng=random.Random(0))
    with pytest.raises(TimeoutError):  # no fatal yet: a plain wait runs out
        job.wait(lambda: False, "a step", 0.3)
    EventLog(str(job.run), 0).emit("fatal", step=9, error="TrainingDiverged: training diverged")
    began = time.monotonic()
    with pytest.raises(JobStopped, match="rank 0 ended the job: TrainingDiverged"):
        job.wait(lambda: False, "a step", 60)
    chaos._inject(job)  # its first wait (a full world) meets the fatal event
    assert time.monotonic() - began < 5
    assert "rank 0 ended the job" in capsys.readouterr().out
    assert job.verdicts == []
    assert set(chaos.kinds_result(set())["not_run"]) == {"kill_rank", "hang"}
