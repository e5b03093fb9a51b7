"""A production install (no extras) trains and checks health; the tools behind extras
say which extra to install. The extras' modules are made unimportable in a subprocess,
as on an install without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

from llmtrain.exit_codes import ExitCode

WITHOUT_EXTRAS = ("import sys\n"
                  "sys.modules.update(dict.fromkeys(['matplotlib', 'mfusepy', 'nfs4fs',\n"
                  "                                 'torchx', 'tokenizers', 'pyarrow',\n"
                  "                                 'safetensors'],\n"
                  "                                None))\n"
                  "from llmtrain.cli import main\n"
                  "sys.exit(main(sys.argv[1:]))\n")


def llmtrain_without_extras(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_train_and_health_need_no_extra(tmp_path):
    run = str(tmp_path / "run")
    train = llmtrain_without_extras("train", "--training.run_dir", run, "--training.steps", "2",
                                    "--metrics.prometheus", "false")
    assert train.returncode == 0, train.stderr[-3000:]
    assert "done: 2 steps" in train.stdout
    health = llmtrain_without_extras("health", "--json", "--training.run_dir", run)
    report = json.loads(health.stdout)  # a warning (say, an unsynced clock here) exits 1
    assert health.returncode == {"warn": 1}.get(report["worst"], 0), health.stderr[-3000:]
    assert {f["check"] for f in report["findings"]} >= {"run_storage", "shm"}


def test_chaos_and_report_name_their_extra(tmp_path):
    chaos = llmtrain_without_extras("chaos", "--workdir", str(tmp_path / "chaos"))
    assert chaos.returncode == ExitCode.FATAL
    assert "pip install 'llmtrain[chaos]'" in chaos.stderr
    report = llmtrain_without_extras("report", str(tmp_path))
    assert report.returncode == ExitCode.FATAL
    assert "pip install 'llmtrain[report]'" in report.stderr
    data = llmtrain_without_extras("data", "prepare", str(tmp_path), "--tokenizer", "t.json",
                                   "--out", str(tmp_path / "out"))
    assert data.returncode == ExitCode.FATAL
    assert "pip install 'llmtrain[data]'" in data.stderr
