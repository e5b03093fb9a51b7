"""Training-state integrity in real 2-rank runs: a NaN step is never applied, a flipped
bit in one replica is found, named and rolled back, a diverging run stops (exit 78), and
no committed checkpoint ever holds a non-finite value."""

import math
from pathlib import Path

import pytest
import torch

from conftest import check, events, llmtrain
from llmtrain.checkpoint import shard_read, storage
from llmtrain.exit_codes import ExitCode

pytestmark = pytest.mark.slow

ARGS = ("--training.steps", "12", "--checkpoint.interval_steps", "5",
        "--metrics.log_every", "4", "--metrics.prometheus", "false")


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return shard_read.load_unsharded(storage.step_dir(str(run / "checkpoints"), step))["model"]


def assert_equal_weights(a: Path, b: Path, step: int) -> None:
    ref, got = weights(a, step), weights(b, step)
    assert ref.keys() == got.keys() and len(ref) > 10
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def assert_committed_all_finite(run: Path) -> list[int]:
    steps = [c.step for c in storage.list_checkpoints(str(run / "checkpoints")) if c.committed]
    for step in steps:
        for name, t in weights(run, step).items():
            assert torch.isfinite(t).all(), (step, name)
    return steps


@pytest.fixture(scope="module")
def skip7(tmp_path_factory) -> Path:
    """Told to skip step 7's batch: what a run meeting a NaN at step 7 must end up as."""
    run = tmp_path_factory.mktemp("integrity") / "skip7"
    check(llmtrain(run, *ARGS, "--integrity.skip_steps", "7", nproc=2))
    return run


def test_a_skipped_step_reports_no_loss_and_no_grad_norm(run_dir):
    """One rank whose first step is a skip (a resume whose next step a rollback learned
    bad starts the same way) trains on; each skipped step's report says it was skipped,
    with no loss and no gradient norm: not the last trained step's (nor a missing one's
    crash)."""
    proc = check(llmtrain(run_dir, "--training.steps", "4", "--integrity.skip_steps", "1,3",
                          "--metrics.log_every", "1", "--metrics.prometheus", "false",
                          "--metrics.progress", "plain", timeout=120))
    steps = {e["step"]: e for e in events(run_dir, "step")}
    assert sorted(steps) == [1, 2, 3, 4]
    for step in (1, 3):
        assert steps[step]["skipped"] and steps[step]["grad_norm"] is None, steps[step]
        assert math.isnan(steps[step]["loss"]), steps[step]
        assert f"step {step}/4 | skipped, not trained | lr" in proc.stdout, proc.stdout
    for step in (2, 4):
        e = steps[step]
        assert not e["skipped"] and e["grad_norm"] > 0 and math.isfinite(e["loss"]), e
    (end,) = events(run_dir, "run_end")
    assert end["complete"] and end["first_loss"] == steps[2]["loss"], end
    assert end["final_loss"] == steps[4]["loss"], end


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_a_nan_step_is_never_applied(tmp_path, skip7, policy):
    """Rank 1's loss of step 7 is NaN, so every rank's gradients are: the step is judged
    on the device and not applied ("skip"), or the run also goes back to checkpoint 5 and
    replays without step 7's batch ("rollback"). Either way the final weights are bit for
    bit those of the run that skipped that batch."""
    run = tmp_path / policy
    check(llmtrain(run, *ARGS, "--integrity.on_nonfinite", policy,
                   "--reliability.faults", "nan@loss:rank=1,step=7", nproc=2))
    (bad,) = [e for e in events(run, "step_skipped") if e["reason"] == "nonfinite"]
    assert (bad["step"], bad["ranks"], bad["samples"]) == (7, [1], [96, 112])
    rollbacks = events(run, "rollback")
    if policy == "rollback":
        assert [(r["step"], r["to_step"], r["skip"]) for r in rollbacks] == [(8, 5, [7])]
    else:
        assert rollbacks == []
    assert assert_committed_all_finite(run) == [5, 10, 12]
    assert_equal_weights(skip7, run, 12)


def test_a_flipped_bit_in_one_replica_is_found_named_and_rolled_back(tmp_path):
    """HSDP 2x1: both ranks hold the whole model. Rank 1 flips a mantissa bit of one of
    its parameters as step 6 starts (no NaN, the loss barely moves). The fingerprints of
    step 8 differ; with two replicas no majority says who is wrong, so the run rolls back
    to checkpoint 5 and replays: rank 1 is named, and the run ends with the weights of a
    run that never had the fault."""
    args = (*ARGS, "--parallelism.dp_replicate", "2", "--integrity.sdc_every", "4")
    check(llmtrain(tmp_path / "clean", *args, nproc=2))
    run = tmp_path / "flipped"
    check(llmtrain(run, *args, "--reliability.faults", "bitflip@step:rank=1,step=6,bit=12",
                   nproc=2))
    (failed,) = events(run, "state_check_failed")
    assert (failed["step"], failed["split"]) == (8, [[0, 1]])
    assert [(r["step"], r["to_step"]) for r in events(run, "rollback")] == [(8, 5)]
    (named,) = events(run, "replica_diverged")
    assert (named["step"], named["ranks"]) == (8, [1])
    assert_equal_weights(tmp_path / "clean", run, 12)


def test_a_diverging_run_stops_with_a_diagnosis_and_keeps_its_good_checkpoints(run_dir):
    """The learning rate of the original report (50): the loss goes non-finite, every bad
    step is skipped, and after integrity.max_bad_steps of them the run stops with exit 78
    (a restart would diverge again) instead of writing NaN checkpoints."""
    proc = llmtrain(run_dir, "--optim.lr", "50", "--optim.warmup_steps", "0",
                    "--training.steps", "40", "--checkpoint.interval_steps", "3",
                    "--integrity.max_bad_steps", "3", "--metrics.prometheus", "false")
    assert proc.returncode == ExitCode.FATAL, proc.stderr[-2000:]
    assert "training diverged at step" in proc.stderr
    (fatal,) = events(run_dir, "fatal")
    assert "TrainingDiverged" in fatal["error"]
    assert len(events(run_dir, "step_skipped")) >= 3
    assert assert_committed_all_finite(run_dir)


def test_a_rank_with_wrong_arithmetic_is_named_by_the_recompute(tmp_path):
    """3 ranks, each recomputing its neighbour's first micro-batch every 4 steps. From
    step 5 rank 1's losses come out one part in 2**20 off: step 4 agrees bit for bit
    (no false alarm), step 8 names rank 1 and, with on_sdc = "exclude", excludes it."""
    run = tmp_path / "badmath"
    proc = llmtrain(run, *ARGS, "--training.global_batch_size", "24",
                    "--integrity.recompute_every", "4", "--integrity.on_sdc", "exclude",
                    "--reliability.faults", "badmath@loss:rank=1,step=5", nproc=3)
    assert proc.returncode != 0
    # (a replica named by the replay is excluded the same way, through the same call)
    (mismatch,) = events(run, "recompute_mismatch")
    assert (mismatch["step"], mismatch["ranks"]) == (8, [1])
    assert sorted(map(tuple, mismatch["pairs"])) == [(0, 1), (1, 2)]
    (excluded,) = events(run, "node_excluded")
    assert excluded["rank"] == 1 and "arithmetic" in excluded["reason"]
