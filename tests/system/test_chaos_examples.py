"""Chaos on a loop of the user's (``llmtrain chaos --script``): the examples, plain PyTorch
loops with llmtrain's public API added, recover warm from a killed rank, a lost node, a
failed GPU and a hang, with a spare waiting (and then end bitwise equal to a fault-free
run of the same script) and without one (the job shrinks, and grows back once the node
returns); nothing committed is lost.

Four runs, about a minute each here: each example with spares (AdamW's moments, SGD's
momentum, the LR schedule's state and the loader's position must all come back bit for
bit through four warm recoveries) and without (the state resharded through four shrinks
and four grows)."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from llmtrain.chaos.kinds import FAULT_KINDS, KINDS, script_kinds, trainer_only_kinds
from llmtrain.chaos.runner import Chaos, ChaosConfig
from llmtrain.config import ConfigError
from llmtrain.events import read_events

EXAMPLES = ROOT / "examples"
# the kinds a warm path answers: a rank killed, a node lost, a GPU failed, a rank stopped
WARM_KINDS = ("kill_rank", "node_loss", "gpu_bad", "hang")


def chaos(work, example: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Every rank-level fault hits rank 0 (it hosts its round's store and leads the
    watchdog's reports). The job stops once every kind has run, so a long --steps costs
    nothing; with saves every 100 steps a one-rank CNN (a few ms a step) is not always
    writing one, which postponed its grow for half a minute at 10."""
    proc = subprocess.run([sys.executable, "-m", "llmtrain", "chaos", "--workdir", str(work),
                           "--script", str(EXAMPLES / example), "--faults", ",".join(WARM_KINDS),
                           "--steps", "20000", "--checkpoint-every", "100", "--interval", "0.5",
                           "--seed", "1", "--rank", "0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=540)
    verdict = work / "verdict.json"
    assert verdict.exists(), (f"chaos exited {proc.returncode}\n"
                              f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc, json.loads(verdict.read_text())


@pytest.mark.slow  # not alone: run beside another test, as a loaded machine would
@pytest.mark.parametrize("example", ["hf_causal_lm.py", "cnn_sgd.py"])
@pytest.mark.parametrize("spares", [True, False], ids=["spares", "no_spare"])
def test_an_example_recovers_warm_from_each_fault(tmp_path, faultfs, example, spares):
    """(The faultfs fixture only proves FUSE works here, or fails under CI=true; chaos
    mounts its own.)"""
    work = tmp_path / "chaos"
    proc, verdict = chaos(work, example, *([] if spares else ["--spares", "0", "--repair-s", "1"]))
    table = proc.stdout[-4000:] + proc.stderr[-2000:]
    # none of the four needs a link of its own: none may be left out, anywhere
    assert sorted(verdict["kinds"]) == sorted(WARM_KINDS), table
    assert not set(WARM_KINDS) & set(verdict["left_out"]) and verdict["no_room"] == [], table
    assert verdict["not_run"] == {}, table
    for v in verdict["verdicts"]:
        assert v["detected"] and v["correct"], (v, table)
        assert v["recover_s"] is not None, (v, table)
    paths = {v["kind"]: (v["path"], v["returned"]) for v in verdict["verdicts"]}
    want = ("warm", "") if spares else ("shrink", "grow")
    assert paths == {k: want for k in WARM_KINDS}, table
    # warm throughout: the one attempt, never a cold restart
    assert len(read_events(str(work / "run"), "attempt_start")) == 1, table
    assert verdict["finished"] and verdict["final_checkpoint_committed"], table
    assert verdict["committed_checkpoints_lost"] == [], table
    if spares:
        assert verdict["bitwise_equal_to_reference"] is True, table
    else:  # at another world size the sums ran in other orders: not compared
        assert (verdict["shrinks"], verdict["grows"]) == (4, 4), table
        assert "bitwise_equal_to_reference" not in verdict, table
    assert proc.returncode == 0, table


def test_kinds_only_the_trainer_meets_are_refused_for_a_script_and_left_out_by_default(tmp_path):
    script = str(EXAMPLES / "cnn_sgd.py")
    assert trainer_only_kinds() and set(trainer_only_kinds()) < set(KINDS)
    assert "nan" in trainer_only_kinds()  # the "loss" fault point is the trainer's
    assert set(script_kinds()) == set(KINDS) - set(trainer_only_kinds())
    with pytest.raises(ConfigError, match=r"--script .*cnn_sgd.py: fault kind\(s\) \['nan'\] "
                                          r"cannot strike a loop of your own \(nan: "):
        Chaos(ChaosConfig(workdir=str(tmp_path / "a"), faults="hang,nan", script=script))
    Chaos(ChaosConfig(workdir=str(tmp_path / "b"), faults="hang,nan"))  # the trainer meets it
    # the CLI: refused before anything starts, and left out of a script's default set
    for faults in (["--faults", "nan"], []):
        proc = subprocess.run([sys.executable, "-m", "llmtrain", "chaos", "--workdir",
                               str(tmp_path / "c"), "--script", "examples/nope.py", *faults],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and not (tmp_path / "c").exists(), proc.stderr
        assert ("['nan'] cannot strike" in proc.stderr) == bool(faults), proc.stderr
        assert ("examples/nope.py: no such file" in proc.stderr) != bool(faults), proc.stderr
    # the help names each kind a script cannot meet
    help_text = subprocess.run([sys.executable, "-m", "llmtrain", "chaos", "--help"],
                               capture_output=True, text=True, cwd=ROOT).stdout
    assert all(k in " ".join(help_text.split()) for k in trainer_only_kinds()), help_text


def test_a_script_runs_on_the_nodes_and_gets_only_the_settings(tmp_path):
    """The nodes get ``--script`` (a launch option), the workers no trainer-only
    argument (no --data.*, --model.*, --optim.*)."""
    script = EXAMPLES / "cnn_sgd.py"
    c = Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults=",".join(WARM_KINDS),
                          script=str(script)))
    assert c.launch_args == ("--script", str(script))
    assert not [a for a in c.train_args if a.split(".")[0] in ("--data", "--model", "--optim")]
    trainer = Chaos(ChaosConfig(workdir=str(tmp_path / "trainer"), faults="hang"))
    assert trainer.launch_args == () and "--data.seq_len" in trainer.train_args
    assert all(FAULT_KINDS[k].trainer_only == "" for k in WARM_KINDS)
