"""Faults are injected only when the run's config asks: the environment alone arms none."""

import time

import pytest
import torch

from llmtrain import fault_points
from llmtrain.chaos.faults import Fault, Injector, collective_device
from logs import logged


@pytest.fixture(autouse=True)
def disarm():
    yield
    fault_points._injector = None


def test_environment_alone_arms_nothing_and_says_so(monkeypatch):
    monkeypatch.setenv("LLMTRAIN_FAULTS", "kill@step:rank=0,step=1")
    monkeypatch.setenv("LLMTRAIN_FAULTS_FILE", "/tmp/faults.txt")
    with logged() as said:
        fault_points.install("", rank=0)
    assert fault_points._injector is None
    fault_points.point("step", 1)  # would SIGKILL this process if armed
    (warning,) = said
    assert warning.startswith("llmtrain: warning: ignoring $LLMTRAIN_FAULTS and "
                              "$LLMTRAIN_FAULTS_FILE")
    assert 'reliability.faults = "env"' in warning

    with logged() as said:
        fault_points.install("hang@step:rank=1,step=3", rank=0)  # the config's own, only
    assert fault_points._injector.faults == [Fault("hang", "step", rank=1, step=3)]
    assert fault_points._injector.faults_file is None
    assert "ignoring $LLMTRAIN_FAULTS " in said[0]


def test_config_env_takes_the_faults_from_the_environment(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LLMTRAIN_FAULTS", "kill@step:rank=1,step=7")
    monkeypatch.setenv("LLMTRAIN_FAULTS_FILE", str(tmp_path / "faults.txt"))
    with logged() as said:
        fault_points.install("env", rank=0)
    assert said == []
    injector = fault_points._injector
    assert injector.faults == [Fault("kill", "step", rank=1, step=7)]
    (tmp_path / "faults.txt").write_text("hang@step:rank=0,id=late\n")
    assert injector._armed_at_run_time() == [Fault("hang", "step", rank=0, id="late")]
    assert capsys.readouterr().err == ""


def test_nothing_set_nothing_armed_nothing_said(monkeypatch, capsys):
    monkeypatch.delenv("LLMTRAIN_FAULTS", raising=False)
    monkeypatch.delenv("LLMTRAIN_FAULTS_FILE", raising=False)
    with logged() as said:
        for spec in ("", "env"):
            fault_points.install(spec, rank=0)
            assert fault_points._injector is None
    assert capsys.readouterr().err == "" and said == []


def test_desync_tensors_live_where_the_groups_backend_takes_them(monkeypatch):
    """On NCCL a CPU tensor raises instead of desyncing the ranks: the GPU's, there."""
    assert collective_device("gloo") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device("nccl") == torch.device("cuda", 3)


def test_a_slow_rank_is_slowed_by_its_fastest_step_not_by_one_step_slowed_by_load():
    """``slow`` stretches each step from ``step`` on by (factor - 1) times the shortest
    step before it: the step just before, slowed by the machine, does not set the pace."""
    injector = Injector("slow@step:step=4,factor=3", rank=0)
    took = {}
    for step, work in enumerate((0.15, 0.05, 0.3, 0.3, 0.0)):  # step 3 "loaded"
        started = time.perf_counter()
        injector.point("step", step)
        took[step] = time.perf_counter() - started
        time.sleep(work)
    assert max(took[s] for s in range(4)) < 0.1  # no sleep before step 4
    assert 0.1 <= took[4] < 0.45  # 2 x 0.05 s, not 2 x 0.3 s
