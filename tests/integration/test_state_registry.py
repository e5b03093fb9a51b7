"""One registry of training state: a resume from a checkpoint and a warm restore from an
in-memory snapshot bring back the same things, every registered item included."""

import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

BOTH_PATHS = """
import random, sys
import torch
from llmtrain.checkpoint.snapshots import Schedule, Snapshots
from llmtrain.state_registry import state_tensors
from llmtrain.config import load_config, parse_overrides
from llmtrain.recovery.registry_snapshots import restore_snapshot, take_snapshot
from llmtrain.trainer import Trainer

cfg = load_config("debug_cpu", parse_overrides([
    "--training.run_dir", sys.argv[1], "--training.steps", "40", "--checkpoint.mode", "sync",
    "--checkpoint.interval_steps", "0", "--checkpoint.resume", "false",
    "--checkpoint.keep_last", "10", "--integrity.enable", "true",
    "--integrity.spike_window", "8", "--metrics.progress", "plain"]))
t = Trainer(cfg)
r = t.session.registry
snapshots = Snapshots(Schedule(1), 0, buddy=None, ward=None, events=t.session.events)


def advance(steps):
    for _ in range(steps):
        t.train_step(t.data.next_step())
        t.session._step += 1
    torch.rand(3), random.random()  # the RNGs move as a step's draws would


def state():
    return ([x.clone() for x in state_tensors(r.model, r.optimizer, [])],
            {**r.shared(), **r.own()})


def differing(a, b):
    names = sorted(n for n in a[1] if a[1][n] != b[1][n])
    return names + ([] if all(map(torch.equal, a[0], b[0])) else ["model/optimizer"])


def save_both():
    t.session.checkpoints.save(t.step, t.session.state, final=True)
    assert take_snapshot(snapshots, t.step, r)
    return t.step


def restore_both(step):
    assert t.session.checkpoints.resume(t.session.state) == step
    from_storage = state()
    advance(2)
    restore_snapshot(snapshots.own.at(step), r)
    return from_storage, state()


advance(6)
items = sorted(r.items)
assert items == ["data", "integrity", "rng", "scheduler"], items
step, saved = save_both(), state()
advance(2)
assert differing(saved, state()) == [*items, "model/optimizer"]  # everything moved
from_storage, from_memory = restore_both(step)
assert differing(saved, from_storage) == [] and differing(saved, from_memory) == []
assert from_storage[1]["integrity"]["judged"] == 6  # the window came back too

for name in items:  # an item left out of the registry is caught by both comparisons
    item = r.items.pop(name)
    advance(1)
    step = save_both()
    r.items[name] = item
    saved = state()
    advance(2)
    from_storage, from_memory = restore_both(step)
    assert differing(saved, from_storage) == [name], (name, differing(saved, from_storage))
    assert differing(saved, from_memory) == [name], (name, differing(saved, from_memory))
t.close()
print("ok")
"""


def test_a_resume_and_a_warm_restore_bring_back_every_registered_item(tmp_path):
    """Train, then save the state both ways at one step (a checkpoint, a snapshot); train
    on, and restore each: the model and optimizer shards and every item (the LR schedule,
    the data position, the RNGs, the integrity window) equal those saved. Taking each
    item out of the registry in turn makes both comparisons name it."""
    proc = subprocess.run([sys.executable, "-c", BOTH_PATHS, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
