"""Checkpoints on real storage: a FUSE mount, a fault-injecting FUSE filesystem, NFS, S3.
(A run killed while saving to NFS: tests/integration/test_checkpoint.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, check, events, llmtrain, llmtrain_start, step_losses, wait_for_event
from storage_fixtures import is_mounted
from llmtrain.checkpoint import storage
from llmtrain.exit_codes import ExitCode
from llmtrain.fsio import join, write_atomic

pytestmark = pytest.mark.slow

CKPT = ("--checkpoint.interval_steps", "6", "--metrics.log_every", "1")


def committed_steps(url: str) -> list[int]:
    return [c.step for c in storage.list_checkpoints(url) if c.committed]


def test_save_and_resume_through_a_fuse_mount(bindfs_mount, tmp_path):
    run = bindfs_mount / "run"
    check(llmtrain(run, "--training.steps", "12", *CKPT, nproc=2))
    assert is_mounted(bindfs_mount)
    root = str(run / "checkpoints")
    assert committed_steps(root) == [6, 12]
    assert all(storage.verify(storage.step_dir(root, s), checksums=True) == [] for s in (6, 12))
    check(llmtrain(run, "--training.steps", "18", *CKPT, nproc=2))
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [12]
    assert committed_steps(root) == [6, 12, 18]


def test_enospc_and_eio_fail_saves_but_lose_nothing(faultfs, tmp_path):
    """Checkpoint 12 hits a full disk, 18's shard an I/O error, 24's manifest an I/O
    error at commit: each save fails on every rank, training goes on, checkpoint 6 stays
    committed and valid, and 30 (storage healthy again) commits."""
    ckpt = faultfs.mount / "ckpt"
    faultfs.set_rules([
        {"ops": ["write"], "path": "/ckpt/step-00000012/*", "errno": "ENOSPC"},
        {"ops": ["create"], "path": "/ckpt/step-00000018/__1_*", "errno": "EIO"},
        {"ops": ["write"], "path": "/ckpt/step-00000024/MANIFEST.json*", "errno": "EIO"},
    ])
    run = tmp_path / "run"
    check(llmtrain(run, "--training.steps", "30", "--checkpoint.url", str(ckpt),
                   "--checkpoint.keep_last", "5", *CKPT, nproc=2))
    assert max(step_losses(run)) == 30
    failed = {}
    for e in events(run, "checkpoint_failed"):
        failed.setdefault(e["step"], "")
        failed[e["step"]] += e["error"]
    assert sorted(failed) == [12, 18, 24]
    assert "No space left on device" in failed[12]
    assert "Input/output error" in failed[18] and "Input/output error" in failed[24]
    assert committed_steps(str(ckpt)) == [6, 30]
    assert storage.verify(storage.step_dir(str(ckpt), 6), checksums=True) == []
    assert {r["errno"] for r in faultfs.fired()} == {"ENOSPC", "EIO"}


def test_a_checkpoint_that_stays_unreadable_is_passed_over_and_kept(faultfs, tmp_path):
    """Every read of checkpoint 12's second shard fails with EIO (a bad sector, an object
    gone to an archive tier). Both ranks learn it at once (before, the failing rank raised
    while the other waited in the agreement: a hang), read it twice more, then resume from
    checkpoint 6, where every attempt failed on 12 before and the job looped through its
    restarts. Checkpoint 12 is neither quarantined nor saved over: the run's step 12 is
    skipped as committed already, and with the storage healthy it loads again."""
    ckpt = faultfs.mount / "ckpt"
    run = tmp_path / "run"
    on_faultfs = ("--checkpoint.url", str(ckpt), *CKPT)
    check(llmtrain(run, "--training.steps", "12", *on_faultfs, nproc=2))
    faultfs.set_rules([{"ops": ["read"], "path": "/ckpt/step-00000012/__1_0.distcp",
                        "errno": "EIO"}])
    check(llmtrain(run, "--training.steps", "14", *on_faultfs, nproc=2))
    assert {r["errno"] for r in faultfs.fired()} == {"EIO"}
    unreadable = events(run, "checkpoint_unreadable")
    assert [e["step"] for e in unreadable] == [12] * 3, unreadable
    assert "Input/output error" in unreadable[0]["errors"][0]
    (passed,) = events(run, "checkpoint_passed_over")
    assert passed["step"] == 12 and passed["tries"] == 3
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [6]
    assert events(run, "checkpoint_rejected") == [] and committed_steps(str(ckpt)) == [6, 12, 14]
    assert any(e["step"] == 12 and "committed already" in e["reason"]
               for e in events(run, "checkpoint_skipped"))
    faultfs.set_rules([])
    assert storage.verify(storage.step_dir(str(ckpt), 12), checksums=True) == []


def test_an_unreadable_old_manifest_blocks_neither_resume_nor_retention(faultfs, tmp_path):
    """Old checkpoint 6 (kept by keep_every) cannot be opened any more: EIO on its manifest
    for good. Listing it raised, so every resume failed (CheckpointUnreadable) and every
    retention pass too, although 12 was intact. Now the resume loads 12, says it passed 6
    over, and retention runs on around it: 6 is never deleted, the others come and go."""
    ckpt = faultfs.mount / "ckpt"
    run = tmp_path / "run"
    on_faultfs = ("--checkpoint.url", str(ckpt), "--checkpoint.interval_steps", "3",
                  "--checkpoint.keep_last", "1", "--checkpoint.keep_every", "6")
    check(llmtrain(run, "--training.steps", "12", *on_faultfs, nproc=2))
    assert committed_steps(str(ckpt)) == [6, 12]
    faultfs.set_rules([{"ops": ["open"], "path": "/ckpt/step-00000006/MANIFEST.json",
                        "errno": "EIO"}])
    check(llmtrain(run, "--training.steps", "18", *on_faultfs, nproc=2))
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [12]
    assert {(e["step"], e["by"]) for e in events(run, "checkpoint_passed_over")} == {
        (6, "resume"), (6, "retention")}
    assert events(run, "checkpoint_retention_failed") == []
    assert 15 in {e["step"] for e in events(run, "checkpoint_removed")}
    listing = storage.list_checkpoints(str(ckpt))
    assert [(c.step, c.committed, bool(c.error)) for c in listing] == [
        (6, False, True), (12, True, False), (18, True, False)]
    faultfs.set_rules([])
    assert committed_steps(str(ckpt)) == [6, 12, 18]


def test_waits_on_storage_longer_than_the_hang_timeout_are_not_hangs(faultfs, tmp_path):
    """A save that waits for the previous save's write, and a resume, cannot beat the
    watchdog: both are declared long phases, with reliability.phase_timeout_s instead of
    the 3 s hang timeout. Checkpoint 6's shards take 4 s to create, so the async save of
    step 9 waits for them (a 1B model's 13 GB did so on an H100, and the run was stopped
    as hung); opening each shard of 12 takes 2 s. Both runs finish without a hang."""
    ckpt = faultfs.mount / "ckpt"
    run = tmp_path / "run"
    on_faultfs = ("--checkpoint.url", str(ckpt), "--reliability.hang_timeout_s", "3",
                  "--checkpoint.mode", "async_thread", "--checkpoint.interval_steps", "3",
                  "--metrics.log_every", "1")
    faultfs.set_rules([{"ops": ["create"], "path": "/ckpt/step-00000006/*.distcp", "delay": 4}])
    check(llmtrain(run, "--training.steps", "12", *on_faultfs, nproc=2))
    (waited,) = [e for e in events(run, "checkpoint_wait") if e["step"] == 9]
    assert waited["seconds"] > 3, waited
    faultfs.set_rules([{"ops": ["open"], "path": "/ckpt/step-00000012/*.distcp", "delay": 2}])
    check(llmtrain(run, "--training.steps", "14", *on_faultfs, nproc=2))
    assert events(run, "hang") == []
    resume = [e for e in events(run, "span") if e["name"] == "resume"][-1]  # the second run's
    assert resume["end"] - resume["start"] > 3, resume
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [12]


def test_slow_storage_does_not_stall_training(faultfs, tmp_path):
    """Every shard takes 2 s to create: saves stage in well under a second, write in the
    background, and a save due while the previous one still writes is skipped."""
    ckpt = faultfs.mount / "ckpt"
    faultfs.set_rules([{"ops": ["create"], "path": "*.distcp", "delay": 2.0}])
    run = tmp_path / "run"
    check(llmtrain(run, "--training.steps", "24", "--checkpoint.url", str(ckpt),
                   "--checkpoint.interval_steps", "3", "--checkpoint.if_busy", "skip",
                   "--metrics.log_every", "1", nproc=2))
    staged = events(run, "checkpoint_staged")
    committed = events(run, "checkpoint_committed")
    assert staged and max(e["blocking_s"] for e in staged) < 0.5
    assert min(e["total_s"] for e in committed) > 2.0
    assert events(run, "checkpoint_skipped")
    assert committed[-1]["step"] == 24  # the final save always waits
    step_times = [e["step_time_s"] for e in events(run, "step") if e["step"] > 3]
    assert max(step_times) < 1.5  # no step sat through a 2 s write


def test_skip_if_busy_is_decided_by_every_rank_together(faultfs, tmp_path):
    """Rank 0's write ends seconds after rank 1's: after the commit it reads the manifest
    and lists every checkpoint for retention, and each manifest read takes 1.5 s on this
    mount (an object store at scale). A save due in that window is skipped by both ranks
    (an agreement), where rank 0 skipped alone, rank 1 waited in the save's all-reduce and
    rank 0 in the next step's collectives: a deadlock the watchdog then called a hang."""
    ckpt = faultfs.mount / "ckpt"
    faultfs.set_rules([{"ops": ["open"], "path": "/ckpt/*/MANIFEST.json", "delay": 1.5}])
    run = tmp_path / "run"
    check(llmtrain(run, "--training.steps", "16", "--checkpoint.url", str(ckpt),
                   "--checkpoint.interval_steps", "2", "--checkpoint.if_busy", "skip",
                   nproc=2))
    assert events(run, "hang") == [] and events(run, "failure") == []
    skipped = [e["step"] for e in events(run, "checkpoint_skipped")
               if e["reason"].startswith("previous still writing")]
    committed = [e["step"] for e in events(run, "checkpoint_committed")]
    assert skipped and committed[-1] == 16, (skipped, committed)
    assert not set(skipped) & set(committed)


def test_a_shard_held_open_on_nfs_delays_removal_but_never_leaves_it_committed(nfs_mount):
    """NFS's silly rename: a file deleted while its client holds it open lives on under a
    hidden name, so its directory cannot be removed yet. Removing the checkpoint fails
    then, after its manifest went first: it is left incomplete, never committed with a
    file missing, and once the file is closed the next removal completes."""
    root = str(nfs_mount / "ckpt")
    url = storage.step_dir(root, 6)
    os.makedirs(url)
    shard = os.path.join(url, "__0_0.distcp")
    with open(shard, "wb") as f:
        f.write(b"x" * 1000)
    write_atomic(join(url, storage.MANIFEST), json.dumps(
        {"step": 6, "files": {"__0_0.distcp": {"size": 1000, "sha256": ""}}}).encode())
    assert committed_steps(root) == [6]
    with open(shard, "rb"):
        with pytest.raises(OSError):
            storage.remove(url)
        assert [(c.step, c.committed) for c in storage.list_checkpoints(root)] == [(6, False)]
    deadline = time.monotonic() + 5  # the hidden file goes once the client closed it
    while os.listdir(url) and time.monotonic() < deadline:
        time.sleep(0.02)
    storage.remove(url)
    assert storage.list_checkpoints(root) == []


def test_checkpoints_in_s3(s3_url, tmp_path):
    run, ckpt = tmp_path / "run", f"{s3_url}/ckpt"
    check(llmtrain(run, "--training.steps", "12", "--checkpoint.url", ckpt, *CKPT, nproc=2))
    assert committed_steps(ckpt) == [6, 12]
    assert storage.verify(storage.step_dir(ckpt, 12), checksums=True) == []
    check(llmtrain(run, "--training.steps", "18", "--checkpoint.url", ckpt, *CKPT, nproc=2))
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [12]


@pytest.mark.parametrize("launcher", ["torchrun", "alone"])
def test_sigterm_saves_then_exits_for_a_restart_and_a_stop_request_ends_the_run(tmp_path,
                                                                              launcher):
    """Preemption: SIGTERM (to torchrun, which passes it on, or to a lone rank) makes the
    ranks agree on a step, commit a checkpoint there and exit RETRYABLE (75); the next
    launch resumes from it. ``llmtrain stop`` then ends that run the same way, but as
    finished: exit 0 (nothing restarts it), its run_end marked stopped, the request gone so
    that a later launch goes on."""
    run = tmp_path / "run"
    nproc = 2 if launcher == "torchrun" else None
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2"] if nproc else [sys.executable])
    cmd = [*prefix, "-m", "llmtrain", "train", "--training.run_dir", str(run),
           "--training.steps", "100000", "--checkpoint.interval_steps", "0",
           "--metrics.log_every", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (
            (run / "events").exists() and len(events(run, "step")) >= 5):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    preempted = events(run, "preempted")
    assert len(preempted) == 1, stderr[-3000:]
    step = preempted[0]["step"]
    assert [e["step"] for e in events(run, "checkpoint_committed")] == [step]
    assert events(run, "run_end")[0]["steps"] == step
    if launcher == "alone":
        assert proc.returncode == ExitCode.RETRYABLE
    resumed = llmtrain_start(run, "--training.steps", "100000", "--checkpoint.interval_steps",
                             "0", "--metrics.log_every", "1", nproc=nproc,
                             torchrun=True)
    wait_for_event(run, "step", resumed, where=lambda e: e["step"] >= step + 2)
    stop = subprocess.run([sys.executable, "-m", "llmtrain", "stop", str(run), "--reason",
                           "the test"], capture_output=True, text=True, cwd=ROOT)
    assert stop.returncode == 0, stop.stderr
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == ExitCode.CLEAN, err[-3000:]
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [step]
    (asked,) = events(run, "stop_requested")
    assert asked["reason"] == "the test" and asked["step"] > step
    assert [e["step"] for e in events(run, "checkpoint_committed")] == [step, asked["step"]]
    assert [(e["steps"], e["stopped"]) for e in events(run, "run_end")] == [
        (step, False), (asked["step"], True)]
    assert not (run / "stop_request.json").exists()
