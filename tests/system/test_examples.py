"""The examples (plain PyTorch loops with llmtrain's public API added) under
``llmtrain launch``: each is its plain loop plus at most 25 lines of llmtrain, and with no
spare a node's loss leaves the survivor to go on alone and finish, its summary covering
both phases. (tests/system/test_chaos_examples.py puts each example, with spares and
without, through a killed rank, a lost node, a failed GPU and a hang.)"""

import ast

import pytest
from conftest import ROOT, events, wait_for_event

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
