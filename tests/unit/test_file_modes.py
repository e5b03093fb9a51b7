"""Run-dir files and directories get explicit modes: a permissive umask never leaves a run
dir that anyone can write (where a manifest or an exclusion record could be swapped)."""

import os
import stat

import pytest
import torch
import torch.distributed.checkpoint as dcp

from llmtrain.checkpoint.storage import CommitWriter
from llmtrain.config import ReliabilityConfig
from llmtrain.fsio import DIR_MODE, FILE_MODE, write_atomic
from llmtrain.reliability.health.exclusion import exclude_host
from llmtrain.reliability.watchdog import configure_diagnostics


@pytest.fixture
def umask0():
    old = os.umask(0)
    yield
    os.umask(old)


def test_run_dir_modes_ignore_a_permissive_umask(tmp_path, umask0, monkeypatch):
    run = tmp_path / "run"
    write_atomic(f"{run}/monitoring/targets/h-0.json", b"[]")
    exclude_host(str(run), "node1", "test")
    monkeypatch.setattr(os, "environ", os.environ.copy())  # it sets torch's defaults
    configure_diagnostics(ReliabilityConfig(), str(run))
    dcp.save({"w": torch.zeros(8)}, no_dist=True, storage_writer=CommitWriter(
        f"{run}/checkpoints/step-00000001", {"step": 1}))

    found = {p.relative_to(run).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [run, *run.rglob("*")]}
    assert {"excluded_hosts.json", "diagnostics/nccl-timeout", "monitoring/targets/h-0.json",
            "checkpoints/step-00000001/MANIFEST.json",
            "checkpoints/step-00000001/.metadata"} <= found.keys()
    wrong = {p: oct(m) for p, m in found.items()
             if m != (DIR_MODE if (run / p).is_dir() else FILE_MODE)}
    assert wrong == {}
