import json
import posixpath
import subprocess
import sys

import fsspec
import pytest

from llmtrain.checkpoint import storage
from llmtrain.checkpoint.storage import CheckpointInfo, retention_victims
from llmtrain.fsio import join, write_atomic


def fake_checkpoint(root: str, step: int, files: dict[str, bytes], commit: bool = True) -> str:
    """A checkpoint directory as CommitWriter leaves it (the files' content is opaque)."""
    import hashlib
    url = storage.step_dir(root, step)
    for name, data in files.items():
        write_atomic(join(url, name), data)
    if commit:
        manifest = {"step": step, "files": {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                                            for n, d in files.items()},
                    "bytes": sum(map(len, files.values())), "committed_at": 1.0}
        write_atomic(join(url, storage.MANIFEST), json.dumps(manifest).encode())
    return url


FILES = {".metadata": b"meta" * 10, "__0_0.distcp": b"a" * 1000, "__1_0.distcp": b"b" * 999}


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "ckpts")
        return
    url = f"memory://ckpts-{tmp_path.name}"
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_verify_names_each_kind_of_damage(root):
    good = fake_checkpoint(root, 10, FILES)
    assert storage.verify(good, checksums=True) == []
    url = fake_checkpoint(root, 20, FILES)
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{path}/__0_0.distcp", b"a" * 999 + b"X")  # same size, flipped content
    fs.pipe_file(f"{path}/__1_0.distcp", b"b" * 10)           # truncated
    fs.rm_file(f"{path}/.metadata")                           # missing
    problems = storage.verify(url, checksums=True)
    assert len(problems) == 3
    assert any("__0_0.distcp: sha256 differs" in p for p in problems)
    assert any("__1_0.distcp: 10 bytes, manifest says 999" in p for p in problems)
    assert any(".metadata: missing" in p for p in problems)
    # sizes only: the flipped byte goes unnoticed, the rest does not
    assert len(storage.verify(url, checksums=False)) == 2
    # whole-file sums left out (an item check after them): the same
    assert storage.verify(url, checksums=True, whole=False) == storage.verify(url, checksums=False)
    # shared between two ranks: each checks a disjoint half, together all of it
    halves = [storage.verify(url, checksums=True, part=(i, 2)) for i in (0, 1)]
    assert sorted(halves[0] + halves[1]) == sorted(problems) and all(halves)
    incomplete = fake_checkpoint(root, 30, FILES, commit=False)
    assert "never completed" in storage.verify(incomplete, checksums=True)[0]


def test_list_quarantine_and_remove(root):
    fake_checkpoint(root, 5, FILES)
    fake_checkpoint(root, 10, FILES, commit=False)
    fake_checkpoint(root, 15, FILES)
    assert [(c.step, c.committed) for c in storage.list_checkpoints(root)] == [
        (5, True), (10, False), (15, True)]
    moved = storage.quarantine(storage.step_dir(root, 15), ["flipped byte"])
    # out of the listing (so out of resume and retention), every file kept, reasons beside
    assert [c.step for c in storage.list_checkpoints(root)] == [5, 10]
    fs, path = fsspec.core.url_to_fs(moved)
    assert sorted(posixpath.basename(f) for f in fs.ls(path, detail=False)) == sorted(
        [*FILES, storage.MANIFEST, storage.REJECTED])
    assert storage.verify(moved, checksums=True) == []  # whole: a person may move it back
    storage.remove(storage.step_dir(root, 5))
    assert [c.step for c in storage.list_checkpoints(root)] == [10]
    assert storage.list_checkpoints(join(root, "nothing-here")) == []


def test_a_read_error_is_no_verdict_on_the_manifest(root, monkeypatch):
    """EIO while reading a manifest raises; only bytes that are not a manifest make it
    "unreadable" (a verified problem)."""
    url = fake_checkpoint(root, 5, FILES)
    fs, _ = fsspec.core.url_to_fs(url)

    def eio(*args, **kwargs):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(type(fs), "cat_file", eio)
    with pytest.raises(OSError):
        storage.read_manifest(url)
    monkeypatch.undo()
    with fsspec.open(join(url, storage.MANIFEST), "wb") as f:
        f.write(b"{not json")
    assert "unreadable" in storage.verify(url, checksums=False)[0]
    with fsspec.open(join(url, storage.MANIFEST), "wb") as f:
        f.write(b"[]")  # JSON, but no manifest: retention's listing read it as one
    assert storage.read_manifest(url) == {"unreadable": True}


def info(step: int, committed: bool = True) -> CheckpointInfo:
    return CheckpointInfo(step=step, url=f"x/{step}", committed=committed)


def test_retention_keeps_last_k_every_mth_and_in_flight_ones():
    ckpts = [info(s) for s in (100, 200, 300, 400, 500)] + [info(450, False), info(600, False)]
    ckpts.sort(key=lambda c: c.step)
    victims = {c.step for c in retention_victims(ckpts, keep_last=2, keep_every=200)}
    # kept: 400 500 (last 2), 200 (every 200th); 600 may still be writing
    assert victims == {100, 300, 450}
    assert retention_victims([info(100, False), info(200, False)], 1, 0) == []
    assert {c.step for c in retention_victims([info(1), info(2)], 1, 0)} == {1}


def test_cli_verify_exit_code(tmp_path):
    root = str(tmp_path / "ckpts")
    fake_checkpoint(root, 1, FILES)
    cli = [sys.executable, "-m", "llmtrain", "ckpt"]
    ok = subprocess.run([*cli, "verify", root], capture_output=True, text=True)
    assert ok.returncode == 0 and "step-00000001: ok" in ok.stdout
    (tmp_path / "ckpts" / "step-00000001" / "__0_0.distcp").write_bytes(b"z" * 1000)
    bad = subprocess.run([*cli, "verify", root], capture_output=True, text=True)
    assert bad.returncode == 1 and "sha256 differs" in bad.stdout
    listing = subprocess.run([*cli, "list", root], capture_output=True, text=True)
    assert "committed" in listing.stdout and listing.returncode == 0


def test_write_atomic_replaces_whole_files(tmp_path):
    url = str(tmp_path / "d" / "f.json")
    write_atomic(url, b"one")
    write_atomic(url, b"two")
    assert (tmp_path / "d" / "f.json").read_bytes() == b"two"
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["f.json"]  # no temp left over


FULL_DISK = """
import resource, signal, sys
import torch, torch.distributed.checkpoint as dcp
from llmtrain.checkpoint.storage import CommitWriter
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
try:
    dcp.save({"w": torch.zeros(1 << 18)}, storage_writer=CommitWriter(sys.argv[1], {"step": 1}),
             no_dist=True)
except BaseException as e:
    print(f"{type(e).__name__}: {e}")
"""


def test_a_failed_tensor_write_names_the_storage_error(tmp_path):
    """The save's error must say what the storage said (here EFBIG from a file-size
    limit, ENOSPC or EIO on a real disk)."""
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "step-1")],
                         capture_output=True, text=True, timeout=120)
    assert "File too large" in out.stdout, out.stdout + out.stderr[-2000:]


def test_retention_keeps_the_newest_checkpoint_that_passed_integrity_checks():
    checked = CheckpointInfo(step=100, url="x/100", committed=True,
                             manifest={"integrity_checked": True})
    later = [info(s) for s in (200, 300, 400)]
    assert {c.step for c in retention_victims([checked, *later], 2, 0)} == {200}


def test_a_commit_makes_the_step_directory_name_durable(tmp_path, monkeypatch):
    """The manifest's rename is fsync'ed in the step directory, and the step directory's
    own entry in the checkpoint root too: without the root's fsync a crash can lose a
    whole committed checkpoint whose every file was synced."""
    import os

    import torch
    import torch.distributed.checkpoint as dcp
    synced, fsync = [], os.fsync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)
    monkeypatch.setattr(os, "fsync", recording)
    root = tmp_path / "ckpts"
    dcp.save({"w": torch.zeros(16)}, no_dist=True,
             storage_writer=storage.CommitWriter(storage.step_dir(str(root), 1), {"step": 1}))
    assert str(root) in synced, synced
    assert synced.index(str(root)) > synced.index(storage.step_dir(str(root), 1))


def test_a_stale_commit_cannot_land_over_a_newer_one(tmp_path):
    """A coordinator passes the fence, then stalls before its manifest (an NFS hard mount,
    S3 retries); meanwhile the job's new membership saves the same step and commits it.
    The stale manifest, late, is refused (create-if-absent), where it replaced the new one
    and named sums of files that are no longer there."""
    import threading

    import torch
    import torch.distributed.checkpoint as dcp
    url = storage.step_dir(str(tmp_path / "ckpts"), 4)
    at_commit, release = threading.Event(), threading.Event()

    def stalls_at_commit(what: str) -> None:
        if what.startswith("the commit"):
            at_commit.set()
            release.wait(60)
    outcome = []

    def stale_save():
        try:
            dcp.save({"w": torch.ones(64)}, no_dist=True, storage_writer=storage.CommitWriter(
                url, {"step": 4}, fence=stalls_at_commit))
            outcome.append("committed")
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException
            outcome.append(repr(e))
    stale = threading.Thread(target=stale_save)
    stale.start()
    assert at_commit.wait(60)
    dcp.save({"w": torch.zeros(64)}, no_dist=True,
             storage_writer=storage.CommitWriter(url, {"step": 4}))
    release.set()
    stale.join(60)
    assert "FileExistsError" in outcome[0], outcome
    assert storage.verify(url, checksums=True) == []  # the new membership's, whole


def test_removal_and_quarantine_are_fenced(tmp_path):
    """A rank cut off from the job (a returning old coordinator) may not run retention
    or move checkpoints aside: the fence refuses before anything is touched."""
    root = str(tmp_path / "ckpts")
    fake_checkpoint(root, 5, FILES)

    def refused(what: str) -> None:
        raise RuntimeError(f"{what} refused: the job re-formed without this rank")
    with pytest.raises(RuntimeError, match="removing .*step-00000005 refused"):
        storage.remove(storage.step_dir(root, 5), refused)
    with pytest.raises(RuntimeError, match="quarantining .*step-00000005 refused"):
        storage.quarantine(storage.step_dir(root, 5), ["x"], refused)
    assert [(c.step, c.committed) for c in storage.list_checkpoints(root)] == [(5, True)]
    assert storage.verify(storage.step_dir(root, 5), checksums=True) == []


def test_retention_never_deletes_a_checkpoint_whose_manifest_it_could_not_read():
    """Committed or not is unknown: it stays, and blocks nothing around it."""
    unreadable = CheckpointInfo(step=100, url="x/100", committed=False,
                                error="OSError: [Errno 5] Input/output error")
    ckpts = [unreadable] + [info(s) for s in (200, 300, 400)]
    assert {c.step for c in retention_victims(ckpts, keep_last=1, keep_every=0)} == {200, 300}
