"""How a rank leaves its process groups: destroyed after a clean end of training,
abandoned (NCCL communicators aborted) after any exception, where destroying can hang."""

import gc
import os
from types import SimpleNamespace

import pytest

from llmtrain.config import JobConfig
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
