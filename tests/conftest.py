import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.metrics.events import read_events

ROOT = Path(__file__).resolve().parent.parent


def llmtrain(run_dir: Path, *overrides: str, nproc: int | None = None, timeout: float = 600,
             torchrun_args: tuple[str, ...] = (), env: dict | None = None,
             ) -> subprocess.CompletedProcess:
    """``llmtrain train`` on the debug preset: alone, or under torchrun with ``nproc`` ranks."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}", *torchrun_args, "-m", "llmtrain"] if nproc
                else [sys.executable, "-m", "llmtrain"])
    cmd = [*launcher, "train", "--config", "debug_cpu", "--training.run_dir", str(run_dir),
           *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def events(run_dir: Path, name: str) -> list[dict]:
    return read_events(str(run_dir), name)


def step_losses(run_dir: Path) -> dict[int, float]:
    """The logged loss of every step; a step run twice (resumed) keeps its last value."""
    return {e["step"]: e["loss"] for e in events(run_dir, "step")}


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"
from storage_fixtures import *  # noqa: E402,F401,F403  (bindfs_mount, faultfs, s3_url, ...)
