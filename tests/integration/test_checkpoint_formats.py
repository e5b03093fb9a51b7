"""Both checkpoint formats from a real 2-rank run: ``checkpoint.format = "dcp"`` is read by
stock DCP with no llmtrain import, and ``ckpt convert`` round trips are bitwise equal, verify,
and resume to the same losses as the original."""

import subprocess
import sys

import pytest
import torch

from conftest import ROOT, check, llmtrain, llmtrain_start, step_losses
from llmtrain.checkpoint import storage
from llmtrain.checkpoint.convert import convert, differences
from llmtrain.checkpoint.shard_read import load_unsharded
from llmtrain.config import ConfigError

pytestmark = pytest.mark.slow

ARGS = ("--checkpoint.interval_steps", "4", "--metrics.log_every", "1",
        "--metrics.prometheus", "false")
STOCK = """
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
assert not [m for m in sys.modules if m.startswith("llmtrain")], "llmtrain was imported"
"""


def convert_cli(src: str, to: str, dst: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "llmtrain", "ckpt", "convert", src, "--to",
                           to, dst], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "read back and equal" in proc.stdout


def test_dcp_format_is_read_by_stock_tools_and_conversions_round_trip(tmp_path):
    run = tmp_path / "run"
    check(llmtrain(run, "--training.steps", "4", "--checkpoint.format", "dcp", *ARGS, nproc=2))
    original = storage.step_dir(str(run / "checkpoints"), 4)
    assert storage.read_manifest(original)["format"] == "dcp"

    # stock DCP, in a process that never imports llmtrain
    (tmp_path / "stock.py").write_text(STOCK)
    whole = tmp_path / "stock.pt"
    proc = subprocess.run([sys.executable, str(tmp_path / "stock.py"), original, str(whole)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = load_unsharded(original)
    stock = torch.load(whole, weights_only=False)  # this test's own file
    assert differences(state["model"], stock["model"]) == []

    # dcp -> raw -> dcp, and -> torch: every result reads back bitwise equal
    raw_root = tmp_path / "raw"
    raw = storage.step_dir(str(raw_root), 4)
    convert_cli(original, "raw", raw)  # the command once; in this process after
    convert(raw, "dcp", str(tmp_path / "dcp-again"))
    convert(raw, "torch", str(tmp_path / "state.pt"))
    assert storage.read_manifest(raw)["format"] == "raw"
    for url in (raw, str(tmp_path / "dcp-again")):
        assert storage.verify(url, checksums=True) == []
        assert differences(state, load_unsharded(url)) == [], url

    # the converted checkpoint resumes as the original does (on one rank each, at once:
    # resharded)
    resumes = {name: llmtrain_start(tmp_path / name, "--training.steps", "6",
                                    "--checkpoint.url", str(root), *ARGS)
               for name, root in (("from-original", run / "checkpoints"), ("from-raw", raw_root))}
    for name, proc in resumes.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
    resumed = [step_losses(tmp_path / name) for name in resumes]
    assert sorted(resumed[0]) == [5, 6] and resumed[0] == resumed[1]


def test_a_checkpoint_that_does_not_verify_is_not_converted(tmp_path):
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(ConfigError, match="no MANIFEST.json, the save never completed"):
        convert(str(tmp_path / "unfinished"), "dcp", str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="nothing: no checkpoint there .nothing at that path"):
        convert(str(tmp_path / "nothing"), "dcp", str(tmp_path / "out"))
