"""How a rank leaves its process groups: destroyed after a clean end of training,
abandoned (NCCL communicators aborted) after any exception, where destroying can hang."""

import gc
import io
import json
import os
import sys

import pytest

from llmtrain import api
from llmtrain.config import JobConfig, Settings
from llmtrain.distributed.process_group import WorldInfo
from llmtrain.exit_codes import ExitCode
from llmtrain.launch import worker
from llmtrain.reliability.integrity import TrainingDiverged


@pytest.fixture
def ends(monkeypatch):
    """How each session end left the process groups: "shutdown" (destroyed) or
    "abandon" (NCCL's aborted), as llmtrain.api calls them."""
    calls = []
    monkeypatch.setattr(api, "abandon", lambda: calls.append("abandon"))
    monkeypatch.setattr(api, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return calls


@pytest.mark.parametrize("error", [None, RuntimeError("NCCL communicator was aborted"),
                                   TimeoutError("warm recovery budget spent"),
                                   TrainingDiverged("the loss is NaN"), KeyboardInterrupt()])
def test_only_a_clean_end_of_training_destroys_the_groups(tmp_path, ends, error):
    """A session that ends by an exception abandons its groups and records the failure
    (a diverged run as fatal: a restart would diverge the same way)."""
    settings = Settings(run_dir=str(tmp_path), steps=1)
    settings.metrics.prometheus = False
    session = api.Session(settings)
    session.finish = lambda: None  # no group was formed: nothing to account
    if error is None:
        with session:
            pass
    else:
        with pytest.raises(type(error)), session:
            raise error
    assert ends == ["abandon" if error is not None else "shutdown"]
    said = [json.loads(line)["event"] for line in (tmp_path / "events").glob("*.jsonl")
            .__next__().read_text().splitlines()] if error is not None else []
    if isinstance(error, TrainingDiverged):
        assert "fatal" in said and session.exit_code == ExitCode.FATAL
    elif error is not None:
        assert "failure" in said


def test_a_start_that_fails_after_the_group_formed_abandons_it(tmp_path, monkeypatch):
    calls = []

    class Trainer:
        def __init__(self, cfg):
            raise RuntimeError("at start")  # e.g. a peer lost while resuming

    monkeypatch.setattr(worker, "Trainer", Trainer)
    monkeypatch.setattr(worker, "abandon", lambda: calls.append("abandon"))
    cfg = JobConfig()
    cfg.training.run_dir = str(tmp_path)
    with pytest.raises(RuntimeError):
        worker.run_worker(cfg)
    gc.unfreeze()  # run_worker froze the test process's objects
    assert calls == ["abandon"]


def test_spares_of_one_standby_host_keep_their_own_devices_whatever_ranks_they_take(
        tmp_path, monkeypatch):
    """A standby launcher binds each of its spares to one local rank (its GPU) from its
    start. Two spares of one host take ranks 3 and 2 of a grown node: each keeps its own
    device, and takes the node's size and number as torchrun gives them. (Numbered by
    rank modulo the node's size, two spares taking ranks 1 and 3 of two lost nodes bound
    the same GPU.) A spare that no launcher bound takes its rank's place on a node."""
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
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.setenv(name, "0")  # as the standby launcher left them; put back after

    def spare(rank: int, local_rank: int | None) -> None:
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        plan = {"kind": "grow", "rank": rank, "world_size": 4, "local_world_size": 2,
                "gen": 1, "step": 10}  # a job of one 2-rank node grows by one
        monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(plan) + "\n"))
        assert worker.run_spare(cfg) == ExitCode.CLEAN
    spare(3, 0)
    spare(2, 1)
    spare(3, None)
    assert [(w.rank, w.world_size, w.local_rank, per_node, node)
            for w, per_node, node in places] == [(3, 4, 0, "2", "1"), (2, 4, 1, "2", "1"),
                                                 (3, 4, 1, "2", "1")]


def test_a_loop_on_an_excluded_node_refuses_to_start(tmp_path, monkeypatch):
    """A node excluded earlier in the run (its GPU failed) exits EXCLUDE_NODE at
    llmtrain.start, before anything is built, whatever loop it runs."""
    from llmtrain.reliability.health.exclusion import exclude_host
    monkeypatch.setenv("LLMTRAIN_HOST", "bad-node")
    exclude_host(str(tmp_path), "bad-node", "uncorrectable ECC errors", findings=[], rank=0)
    built = []
    with pytest.raises(SystemExit) as ended:
        api.start(Settings(run_dir=str(tmp_path), steps=1), lambda world: built.append(world))
    assert ended.value.code == ExitCode.EXCLUDE_NODE and not built
    cfg = JobConfig()
    cfg.training.run_dir = str(tmp_path)
    assert worker.run_worker(cfg) == ExitCode.EXCLUDE_NODE  # llmtrain's own loop too
