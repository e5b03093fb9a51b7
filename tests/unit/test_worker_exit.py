"""How a rank leaves its process groups: destroyed after a clean end of training,
abandoned (NCCL communicators aborted) after any exception, where destroying can hang."""

import gc
import io
import json
import os
import sys
from types import SimpleNamespace

import pytest

from llmtrain.config import JobConfig
from llmtrain.distributed.process_group import WorldInfo
from llmtrain.exit_codes import ExitCode
from llmtrain.launch import worker
from llmtrain.recovery.coordinator import Resized
from llmtrain.reliability.integrity import TrainingDiverged


@pytest.fixture
def closes(monkeypatch):
    """The ``failed`` of each Trainer.close by run_worker (and "abandon" for each call of
    it), around a trainer whose run raises ``error`` (or returns)."""
    calls = []

    class Trainer:
        step, exit_code, error = 0, ExitCode.CLEAN, None
        events = SimpleNamespace(emit=lambda *a, **k: None)

        def __init__(self, cfg, plan, held):
            if self.error is not None and self.error.args == ("at start",):
                raise self.error

        def run(self):
            if self.error is not None:
                raise self.error

        def close(self, failed=False):
            calls.append(failed)

    monkeypatch.setattr(worker, "Trainer", Trainer)
    monkeypatch.setattr(worker, "abandon", lambda: calls.append("abandon"))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    yield Trainer, calls
    gc.unfreeze()  # run_worker froze the test process's objects


@pytest.mark.parametrize("error", [None, RuntimeError("NCCL communicator was aborted"),
                                   TimeoutError("warm recovery budget spent"),
                                   TrainingDiverged("the loss is NaN"), KeyboardInterrupt()])
def test_only_a_clean_end_of_training_destroys_the_groups(tmp_path, closes, error):
    trainer, calls = closes
    trainer.error = error
    cfg = JobConfig()
    cfg.training.run_dir = str(tmp_path)
    if error is None:
        assert worker.run_worker(cfg) == ExitCode.CLEAN
    else:
        with pytest.raises(type(error)):
            worker.run_worker(cfg)
    assert calls == [error is not None]


def test_a_start_that_fails_after_the_group_formed_abandons_it(tmp_path, closes):
    trainer, calls = closes
    trainer.error = RuntimeError("at start")  # e.g. a peer lost while resuming
    cfg = JobConfig()
    cfg.training.run_dir = str(tmp_path)
    with pytest.raises(RuntimeError):
        worker.run_worker(cfg)
    assert calls == ["abandon"]


def test_a_shrink_closes_the_trainer_and_trains_on_at_the_smaller_size(tmp_path, closes,
                                                                         monkeypatch):
    """The survivors of a lost node go on in their processes: the trainer that saw the
    shrink is closed as failed (its groups abandoned, not destroyed), and the next one is
    built with the new rank and world size, and the snapshots the survivor held."""
    trainer, calls = closes
    assignment = {"kind": "shrink", "rank": 0, "world_size": 1, "local_world_size": 1}
    held = {0: "own snapshot", 1: "the lost ward's replica"}
    starts = []

    def init(self, cfg, plan, held):
        starts.append((plan, held, os.environ["RANK"], os.environ["WORLD_SIZE"]))

    def run(self):
        if len(starts) == 1:
            raise Resized(assignment, held)
    monkeypatch.setattr(trainer, "__init__", init)
    monkeypatch.setattr(trainer, "run", run)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = JobConfig()
    cfg.training.run_dir = str(tmp_path)
    assert worker.run_worker(cfg) == ExitCode.CLEAN
    assert calls == [True, False]
    assert starts == [(None, None, "1", "2"), (assignment, held, "0", "1")]


def test_spares_of_one_standby_host_take_their_ranks_places_on_a_node(tmp_path, monkeypatch):
    """Two spares of one standby host take the two ranks of a grown node: each takes its
    rank's place on a node, as torchrun numbers a node's workers (its local rank, the GPU
    its process group binds, and the node's size and number). Every spare took local rank
    0 of a one-rank node: both bound cuda:0."""
    cfg = JobConfig()
    cfg.training.run_dir = str(tmp_path)
    places = []

    def run_worker(cfg, plan):
        places.append((WorldInfo.from_env(), os.environ["LOCAL_WORLD_SIZE"],
                       os.environ["GROUP_RANK"]))
        return ExitCode.CLEAN
    monkeypatch.setattr(worker, "run_worker", run_worker)
    monkeypatch.setenv("LLMTRAIN_RDZV_ENDPOINT", "127.0.0.1:29400")
    monkeypatch.delenv("LLMTRAIN_SPARE_READY_FD", raising=False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.setenv(name, "0")  # as the standby launcher left them; put back after
    for rank in (2, 3):  # a job of one 2-rank node grows by one
        plan = {"kind": "grow", "rank": rank, "world_size": 4, "local_world_size": 2,
                "gen": 1, "step": 10}
        monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(plan) + "\n"))
        assert worker.run_spare(cfg) == ExitCode.CLEAN
    assert [(w.rank, w.world_size, w.local_rank, per_node, node)
            for w, per_node, node in places] == [(2, 4, 0, "2", "1"), (3, 4, 1, "2", "1")]
