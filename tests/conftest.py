import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def llmtrain(run_dir: Path, *overrides: str, nproc: int | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """``llmtrain train`` on the debug preset: alone, or under torchrun with ``nproc`` ranks."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}", "-m", "llmtrain"] if nproc
                else [sys.executable, "-m", "llmtrain"])
    cmd = [*launcher, "train", "--config", "debug_cpu", "--training.run_dir", str(run_dir),
           *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def step_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "events.jsonl") as f:
        events = [json.loads(line) for line in f]
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"
