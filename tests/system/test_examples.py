"""The examples (plain PyTorch loops with llmtrain's public API added) under
``llmtrain launch``, with real kills: a node lost with a warm spare waiting is replaced
from memory and the run ends with the weights of a run that never failed, bit for bit;
with no spare the survivor goes on alone; and each example is its plain loop plus at most
25 lines of llmtrain."""

import ast
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, events, wait_for_event
from test_elastic import final_weights

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples"
STEPS = 300  # a step takes 20-80 ms: long enough to kill a node mid-run
TRAIN = ("--training.steps", str(STEPS), "--checkpoint.interval_steps", "100",
         "--metrics.log_every", "50", "--metrics.port", "0", "--health.monitor", "false")


def api_lines(path) -> list[int]:
    """The lines of ``path``'s code (not its docstrings or comments) that use llmtrain:
    they name the package, or the session (``run``)."""
    tree = ast.parse(path.read_text())
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in ("llmtrain", "run"):
            lines.add(node.lineno)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                a.name.startswith("llmtrain") for a in node.names) or (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmtrain")):
            lines.add(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize("example", ["cnn_sgd.py", "hf_causal_lm.py"])
def test_each_example_is_its_loop_plus_a_few_lines_of_llmtrain(example):
    lines = api_lines(EXAMPLES / example)
    assert 5 <= len(lines) <= 25, (example, lines)
    # the counter sees what it counts: the loop's own lines are not llmtrain's
    text = (EXAMPLES / example).read_text().splitlines()
    assert not [n for n in lines if "loss.backward()" in text[n - 1]]


def reference(run, example: str) -> dict[str, torch.Tensor]:
    """The example run without a fault by torchrun alone, at the same world size."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(EXAMPLES / example),
                           "--training.run_dir", str(run), *TRAIN],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return final_weights(run, STEPS)


def test_a_spare_replaces_a_killed_node_of_the_cnn_and_the_weights_match(cluster, tmp_path):
    """cnn_sgd.py (SGD with momentum: its momentum buffers are part of the snapshots)."""
    expected = reference(tmp_path / "reference", "cnn_sgd.py")
    c = cluster("2:2", ("--script", str(EXAMPLES / "cnn_sgd.py"), *TRAIN))
    c.start("node1")
    c.start("node2")
    c.start("spare1", spare=True)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 10,
                   timeout=180)
    c.kill("node2")
    rec = wait_for_event(c.run, "warm_recovery", c.nodes["node1"], timeout=120)
    assert rec["kind"] != "shrink" and rec["spares"], rec
    assert c.wait("node1") == 0, c.log("node1")
    assert c.wait("spare1") == 0, c.log("spare1")
    assert not events(c.run, "attempt_start")[1:], "a cold restart happened"
    got = final_weights(c.run, STEPS)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected), "weights differ"


def test_without_a_spare_the_hf_model_shrinks_and_finishes(cluster):
    """hf_causal_lm.py: a node lost with no spare waiting; the survivor goes on alone,
    its state resharded from memory, and finishes; nothing committed is lost."""
    c = cluster("1:2", ("--script", str(EXAMPLES / "hf_causal_lm.py"), *TRAIN))
    c.start("node1")
    c.start("node2")
    wait_for_event(c.run, "checkpoint_committed", c.nodes["node1"], timeout=180,
                   where=lambda e: e["step"] >= 100)
    c.kill("node2")
    rec = wait_for_event(c.run, "warm_recovery", c.nodes["node1"], timeout=120)
    assert rec["kind"] == "shrink" and rec["world_size"] == 1, rec
    assert c.wait("node1") == 0, c.log("node1")
    (end,) = [e for e in events(c.run, "run_end")]
    assert end["steps"] == STEPS and end["complete"], end
    # the summary covers both phases (two ranks, then one), not the last alone
    first = min(events(c.run, "step"), key=lambda e: e["step"])
    assert end["trained"] == STEPS and end["first_loss"] == first["loss"], end
    committed = {e["step"] for e in events(c.run, "checkpoint_committed")}
    assert {100, STEPS} <= committed, committed
