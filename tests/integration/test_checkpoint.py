"""Checkpoints under real faults: killed ranks, other world sizes, damaged files."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, check, events, llmtrain, step_losses
from llmtrain.checkpoint import index, storage
from llmtrain.checkpoint.shard_read import load_unsharded

pytestmark = pytest.mark.slow

CKPT = ("--checkpoint.interval_steps", "6", "--metrics.log_every", "1")


def final_weights(run_dir: Path, step: int, ckpt: Path | None = None) -> dict[str, torch.Tensor]:
    """The model's weights in the checkpoint of ``step`` (under ``ckpt``, by default the
    run dir's checkpoints)."""
    url = storage.step_dir(str(ckpt or run_dir / "checkpoints"), step)
    return load_unsharded(url)["model"]


def assert_bitwise_equal(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert ref.keys() == got.keys() and len(ref) > 10
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run of 24 steps, every checkpoint kept (6, 12, 18, 24). The
    tests only read it: one that damages checkpoints damages a copy."""
    run = tmp_path_factory.mktemp("checkpoint") / "reference"
    check(llmtrain(run, "--training.steps", "24", "--checkpoint.keep_last", "5", *CKPT,
                   nproc=2))
    return run


def test_killed_and_restarted_run_ends_bitwise_equal(tmp_path, reference):
    """torchrun restarts the job twice: rank 0 killed while writing checkpoint 12 (so 6 is
    the newest committed), then rank 1 killed mid-run at step 17. The final weights equal
    an uninterrupted run's bit for bit."""
    args = ("--training.steps", "24", *CKPT)
    faulty = tmp_path / "faulty"
    check(llmtrain(
        faulty, *args, "--reliability.faults", "kill@checkpoint_write:rank=0,step=12,"
        "restart=0;kill@step:rank=1,step=17,restart=1", nproc=2,
        max_restarts=2))
    loaded = events(faulty, "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [6, 12]
    assert all(e["planned_ranks"] == [] for e in loaded), loaded  # read in place, unplanned
    assert_bitwise_equal(final_weights(reference, 24),
                         final_weights(faulty, 24))


def test_a_rank_killed_writing_to_nfs_loses_only_that_checkpoint(tmp_path, reference,
                                                                 nfs_mount):
    """Checkpoints on NFS (nfs-ganesha, through an NFS client): rank 0 is killed while
    checkpoint 12 is being written. 12 is left incomplete, never committed; 6 stays
    committed and verifies; the next launch resumes from 6 and reaches step 12's weights
    of an uninterrupted run bit for bit."""
    run, ckpt = tmp_path / "run", nfs_mount / "ckpt"
    args = ("--training.steps", "12", "--checkpoint.url", str(ckpt), *CKPT)
    killed = llmtrain(run, *args, "--reliability.faults", "kill@checkpoint_write:rank=0,step=12",
                      nproc=2)
    assert killed.returncode != 0
    left = {c.step: c.committed for c in storage.list_checkpoints(str(ckpt))}
    assert left == {6: True, 12: False}, left
    assert storage.verify(storage.step_dir(str(ckpt), 6), checksums=True) == []
    check(llmtrain(run, *args, nproc=2))
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [6]
    committed = [c for c in storage.list_checkpoints(str(ckpt)) if c.committed]
    assert [c.step for c in committed] == [6, 12]
    assert all(storage.verify(c.url, checksums=True) == [] for c in committed)
    assert_bitwise_equal(final_weights(reference, 12),
                         final_weights(run, 12, ckpt))


RESHARD = ("--training.steps", "12", "--training.global_batch_size", "24",
           "--training.micro_batch_size", "4", *CKPT)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    two = tmp_path_factory.mktemp("reshard") / "two"
    check(llmtrain(two, *RESHARD, nproc=2))
    return two


@pytest.mark.parametrize("world", [1, 3])
def test_resume_a_two_rank_checkpoint_on_another_world_size(tmp_path, two_rank_run, world):
    """Global batch 24 fits 1, 2 and 3 ranks; the data order is global, so the resumed
    run sees the same batches and its losses follow the 2-rank run's."""
    two, args = two_rank_run, RESHARD
    other = tmp_path / "other"
    shutil.copytree(two / "checkpoints", other / "checkpoints")
    storage.remove(storage.step_dir(str(other / "checkpoints"), 12))
    check(llmtrain(other, *args, nproc=world))
    loaded = events(other, "checkpoint_loaded")
    assert [(e["step"], e["planned_ranks"]) for e in loaded] == [(6, list(range(world)))]
    ref, got = step_losses(two), step_losses(other)
    assert sorted(got) == list(range(7, 13))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-3), step


def flip(path: Path, at: int | None = None) -> None:
    """Flips one bit of the file's byte at ``at`` (default: its middle)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def test_damaged_checkpoints_are_refused_and_the_previous_one_loaded(tmp_path, reference):
    """Each rank of a restart at the saved world size reads only its own section of
    INDEX2.bin, checked against its digest: damage there refuses the checkpoint, damage in
    the indexes of every rank's items (ITEMS.json, .metadata) it never reads."""
    run = tmp_path / "run"
    args = ("--checkpoint.keep_last", "5", *CKPT)
    shutil.copytree(reference / "checkpoints", run / "checkpoints")  # 6, 12, 18, 24
    root = str(run / "checkpoints")
    assert [c.step for c in storage.list_checkpoints(root) if c.committed] == [6, 12, 18, 24]
    # 24: rank 1's section of INDEX2.bin; 18: a flipped byte; 12: a truncated shard
    index_file = Path(storage.step_dir(root, 24), index.INDEX)
    own_offset, own_length = index.entry(index_file.read_bytes(), 1, 2)[3:5]
    flip(index_file, own_offset + own_length // 2)
    flip(Path(storage.step_dir(root, 18), "__1_0.distcp"))
    shard = Path(storage.step_dir(root, 12), "__0_0.distcp")
    shard.write_bytes(shard.read_bytes()[:-7])
    for name in (index.ITEMS, ".metadata"):  # 6: what a restart at 2 ranks never reads
        flip(Path(storage.step_dir(root, 6), name))

    check(llmtrain(run, "--training.steps", "30", *args, nproc=2))
    rejected = {e["step"]: " ".join(e["problems"]) for e in events(run, "checkpoint_rejected")}
    assert sorted(rejected) == [12, 18, 24]
    assert "INDEX2.bin: a section of rank 1's entry differs from its digest" in rejected[24]
    # the flipped byte was found by the load, which checks each item as it reads it
    assert "__1_0.distcp: xxh3_128 differs from the manifest in " in rejected[18]
    assert "bytes, manifest says" in rejected[12] and "__0_0.distcp" in rejected[12]
    assert [(e["step"], e["checked_in_load"]) for e in events(run, "checkpoint_loaded")] == \
        [(6, True)]
    assert max(step_losses(run)) == 30
    # the run went on from 6 and committed fresh checkpoints over the damaged ones
    assert storage.verify(storage.step_dir(root, 18), checksums=True) == []


@pytest.mark.parametrize("mode", ["sync", "async_process"])
def test_other_save_modes_commit_and_resume(tmp_path, mode):
    run = tmp_path / "run"
    args = ("--checkpoint.mode", mode, *CKPT)
    check(llmtrain(run, "--training.steps", "12", *args, nproc=2))
    root = str(run / "checkpoints")
    assert [c.step for c in storage.list_checkpoints(root) if c.committed] == [6, 12]
    assert storage.verify(storage.step_dir(root, 12), checksums=True) == []
    check(llmtrain(run, "--training.steps", "14", *args, nproc=2))
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [12]


def test_a_peer_killed_during_resume_leaves_the_checkpoint_committed(tmp_path):
    """Rank 1 dies as the ranks start loading checkpoint 12, so rank 0's load fails too.
    That says nothing about the checkpoint: it stays committed (not demoted, not removed),
    the attempt fails as retryable, and torchrun's restart resumes from it."""
    run = tmp_path / "run"
    check(llmtrain(run, "--training.steps", "12", *CKPT, nproc=2))
    check(llmtrain(run, "--training.steps", "14", *CKPT,
                   "--reliability.faults", "kill@resume:rank=1,restart=0", nproc=2,
                   max_restarts=1))
    assert events(run, "checkpoint_rejected") == []
    (unreadable,) = [e for e in events(run, "checkpoint_unreadable") if e["rank"] == 0]
    assert unreadable["step"] == 12 and "load failed" in unreadable["errors"][0]
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [12]
    assert max(step_losses(run)) == 14
    root = str(run / "checkpoints")
    assert [c.step for c in storage.list_checkpoints(root) if c.committed] == [6, 12, 14]


# A world of one in this process: the staging copy is held back until the next step asks
# whether it is done, and half a second more, so an update that did not wait for it would
# change the weights before they are copied (however long the step's own work took).
STAGING_OVERLAP = """
import sys, threading, time
import torch
from llmtrain.checkpoint import staging, storage
from llmtrain.checkpoint.shard_read import load_unsharded
from llmtrain.config import load_config, parse_overrides
from llmtrain.trainer import Trainer

asked = threading.Event()
staged = staging.ReusedBufferStager._staged


def held_back(*a, **k):
    asked.wait(60)
    time.sleep(0.5)
    return staged(*a, **k)


staging.ReusedBufferStager._staged = held_back
cfg = load_config("debug_cpu", parse_overrides([
    "--training.run_dir", sys.argv[1], "--training.steps", "10", "--checkpoint.enable", "true",
    "--checkpoint.mode", "async_thread", "--checkpoint.interval_steps", "0",
    "--checkpoint.resume", "false", "--metrics.progress", "plain"]))
trainer = Trainer(cfg)
trainer.train_step(trainer.data.next_step())
at_save = {k: v.full_tensor().clone() for k, v in trainer.model.state_dict().items()}
trainer.session.checkpoints.save(1, trainer.session.state)
done = trainer.session.checkpoints.staged
trainer.session.checkpoints.staged = lambda: (done(), asked.set())[0]
start = time.perf_counter()
trainer.train_step(trainer.data.next_step())  # its update waits for the copy
waited = time.perf_counter() - start
trainer.session.checkpoints.wait()
saved = load_unsharded(storage.step_dir(trainer.session.checkpoints.url, 1))["model"]
assert saved.keys() == at_save.keys()
assert all(torch.equal(saved[k], at_save[k]) for k in at_save), "the update raced the copy"
assert not all(torch.equal(v.full_tensor(), at_save[k])
               for k, v in trainer.model.state_dict().items()), "the second step trained nothing"
trainer.close()
print(f"ok {waited:.3f}")
"""


def test_a_save_holds_back_only_the_update_until_its_copy_is_staged(tmp_path):
    """Staging runs beside the next step: that step's update, and only it, waits for the
    copy, so the checkpoint holds the state of its step, not a mix of two."""
    proc = subprocess.run([sys.executable, "-c", STAGING_OVERLAP, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    stalls = [e for e in events(tmp_path / "run", "span") if e["category"] == "checkpoint_stall"
              and e["name"].startswith("staging")]
    assert len(stalls) == 1 and stalls[0]["end"] - stalls[0]["start"] > 0.1


# A world of one in this process: a checkpoint is loaded in place (no planning) and then
# through DCP's planner, each after more training changed the live state.
LOAD_PATHS = """
import sys
import torch
from llmtrain.checkpoint import storage
from llmtrain.config import load_config, parse_overrides
from llmtrain.trainer import Trainer

cfg = load_config("debug_cpu", parse_overrides([
    "--training.run_dir", sys.argv[1], "--training.steps", "10", "--checkpoint.enable", "true",
    "--checkpoint.mode", "sync", "--checkpoint.interval_steps", "0",
    "--checkpoint.resume", "false", "--metrics.progress", "plain"]))
trainer = Trainer(cfg)
opt = trainer.optimizer

def snapshot():
    sd = trainer.model.state_dict()
    state = [t.full_tensor().clone() if hasattr(t, "full_tensor") else t.clone()
             for p in opt.param_groups[0]["params"] for t in opt.state[p].values()]
    return ({k: v.full_tensor().clone() for k, v in sd.items()}, state,
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            trainer.scheduler.state_dict(), trainer.data.state_dict())

def same(a, b):
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
            and a[2:] == b[2:])

def train(n):
    for _ in range(n):
        trainer.train_step(trainer.data.next_step())

train(2)
trainer.session.checkpoints.save(2, trainer.session.state)
trainer.session.checkpoints.wait()
saved = snapshot()
url = storage.step_dir(trainer.session.checkpoints.url, 2)
for g in opt.param_groups:
    g["lr"], g["betas"] = 123.0, (0.1, 0.2)
train(2)
assert not same(snapshot(), saved), "training changed nothing"
assert trainer.session.state.fits_in_place(url, checked=True), "no sum for some item"
assert trainer.session.state.load(url, check=True) == (2, [], False), "not loaded in place"
assert same(snapshot(), saved), "the load in place differs from the save"
train(2)
trainer.session.state._in_place = lambda *args, **kwargs: None  # as when the shards do not match
assert trainer.session.state.load(url) == (2, [], True), "not planned"
assert same(snapshot(), saved), "DCP's planned load differs from the save"
trainer.close()
print("ok")
"""


def test_a_load_in_place_and_a_planned_load_restore_the_same_state(tmp_path):
    """The unplanned load (each shard read straight into its live tensor) and DCP's
    planned one restore the same weights, optimizer state and hyperparameters, schedule
    and data position as were saved, over a state that training has changed."""
    proc = subprocess.run([sys.executable, "-c", LOAD_PATHS, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# A world of one in this process: the state of step 2 is saved and committed, training
# goes on, then returns to step 2 (as a warm recovery to an older snapshot does) and
# saves step 2 again, with every shard write failing; with a fault-injecting mount under
# the checkpoints (argv[2]), reading step 2's manifest fails with EIO too.
RESAVE = """
import errno, sys
from pathlib import Path
from llmtrain.chaos.mount import FaultMount
from llmtrain.checkpoint import storage
from llmtrain.config import load_config, parse_overrides
from llmtrain.events import read_events
from llmtrain.trainer import Trainer

run, mount = sys.argv[1], FaultMount(Path(sys.argv[2])) if len(sys.argv) > 2 else None
cfg = load_config("debug_cpu", parse_overrides([
    "--training.run_dir", run, "--training.steps", "10", "--checkpoint.enable", "true",
    "--checkpoint.mode", "sync", "--checkpoint.interval_steps", "0",
    "--checkpoint.resume", "false", "--metrics.progress", "plain",
    *(["--checkpoint.url", str(mount.mount / "ckpt")] if mount else [])]))
trainer = Trainer(cfg)
trainer.train_step(trainer.data.next_step())
trainer.session.checkpoints.save(2, trainer.session.state)
url = storage.step_dir(trainer.session.checkpoints.url, 2)
manifest = storage.read_manifest(url)
trainer.train_step(trainer.data.next_step())

def fail(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error")
storage.CommitWriter.write_data = fail
if mount:
    mount.set_rules([{"ops": ["open", "read"], "path": "*/step-00000002/MANIFEST.json",
                      "errno": "EIO"}])
trainer.session.checkpoints.save(2, trainer.session.state)
if mount:
    assert mount.fired("open") or mount.fired("read"), "the manifest was never read"
    mount.clear()
    (skipped,) = read_events(run, "checkpoint_skipped")
    assert "could not be read" in skipped["reason"], skipped
    assert "Input/output error" in skipped["reason"], skipped
assert storage.read_manifest(url) == manifest, "the committed checkpoint was touched"
assert storage.verify(url, checksums=True) == [], "the committed checkpoint was damaged"
assert [e["step"] for e in read_events(run, "checkpoint_skipped")] == [2]
assert not read_events(run, "checkpoint_failed")
trainer.close()
print("ok")
"""


def test_a_step_saved_again_never_writes_over_its_committed_checkpoint(tmp_path):
    """A warm recovery to a snapshot older than the newest checkpoint redoes steps that
    were saved: saving one again would clear its committed checkpoint before writing, and
    a write failing then would lose it. The save is skipped instead."""
    proc = subprocess.run([sys.executable, "-c", RESAVE, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_a_manifest_that_cannot_be_read_is_no_licence_to_save_over_it(tmp_path, faultfs):
    """The same re-save, with step 2's manifest unreadable (EIO from a real FUSE mount):
    an error says nothing of the checkpoint, so the save is skipped, naming the error,
    and the committed checkpoint survives the failing writes. (Before, the error read as
    "not committed", and the save cleared step 2 before its writes failed.)"""
    proc = subprocess.run([sys.executable, "-c", RESAVE, str(tmp_path / "run"),
                           str(faultfs.base)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
