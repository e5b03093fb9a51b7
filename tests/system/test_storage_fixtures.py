"""The real-storage fixtures (tests/storage_fixtures.py) do what they claim: bindfs and faultfs
are real FUSE mounts that torch.distributed.checkpoint works through, faultfs injects the
faults its rules ask for, nfs_dirs is an NFS export of nfs-ganesha mounted through a FUSE
NFS client and taken down completely, and s3_url is a moto bucket that fsspec/s3fs reach."""
import contextlib
import ctypes
import errno
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from needs import unavailable
from ranks import spawn
from storage_fixtures import fuse_mounts, is_mounted
from llmtrain.chaos.nfs import NfsMount, nfs_problem


def _roundtrip(d):
    """write + fsync + rename over an existing file + read back + directory fsync."""
    (d / "sub").mkdir()
    (d / "sub" / "final.bin").write_bytes(b"old")
    payload = os.urandom(300_000)
    with open(d / "sub" / "tmp.bin", "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.rename(d / "sub" / "tmp.bin", d / "sub" / "final.bin")  # atomic replace
    dfd = os.open(d / "sub", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    assert sorted(os.listdir(d / "sub")) == ["final.bin"]
    assert (d / "sub" / "final.bin").read_bytes() == payload
    return payload


# --------------------------------------------------------------------------- bindfs
def test_bindfs_is_a_fuse_mount_with_local_semantics(bindfs_dirs):
    mnt, root = bindfs_dirs
    assert fuse_mounts()[str(mnt)].startswith("fuse")
    assert subprocess.run(["mountpoint", "-q", str(mnt)]).returncode == 0
    payload = _roundtrip(mnt)
    assert (root / "sub" / "final.bin").read_bytes() == payload  # really went to the backing dir
    (mnt / "sub" / "final.bin").unlink()
    (mnt / "sub").rmdir()
    assert list(root.iterdir()) == []


# --------------------------------------------------------------------------- NFS
def test_nfs_mount_reaches_ganesha_with_an_nfs_clients_semantics(nfs_dirs):
    mnt, root = nfs_dirs
    assert fuse_mounts()[str(mnt)] == "fuse.nfsfuse"
    payload = _roundtrip(mnt)
    assert (root / "sub" / "final.bin").read_bytes() == payload  # on the server's export
    with pytest.raises(FileExistsError):  # O_EXCL reaches the server (OPEN4_CREATE GUARDED)
        os.open(mnt / "sub" / "final.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    # An unlinked file that is still open is renamed aside until closed, as an NFS client
    # does ("silly rename"): meanwhile its directory cannot be removed.
    with open(mnt / "sub" / "final.bin", "rb") as f:
        (mnt / "sub" / "final.bin").unlink()
        (hidden,) = os.listdir(mnt / "sub")
        assert hidden.startswith(".fuse_hidden")
        with pytest.raises(OSError) as exc:
            (mnt / "sub").rmdir()
        assert exc.value.errno == errno.ENOTEMPTY
        assert f.read() == payload
    deadline = time.monotonic() + 5  # the hidden name goes once the kernel releases the file
    while os.listdir(mnt / "sub") and time.monotonic() < deadline:
        time.sleep(0.02)
    (mnt / "sub").rmdir()
    assert list(root.iterdir()) == []


def test_nfs_mount_stops_completely_even_when_busy(tmp_path):
    problem = nfs_problem()
    if problem:
        unavailable(problem)
    nfs = NfsMount(tmp_path / "nfs").start()
    server, client, port = nfs.server, nfs.client, nfs.port
    held = open(nfs.mount / "held-open", "wb")  # a rank that never closed its file
    nfs.stop()
    with contextlib.suppress(OSError):  # ENOTCONN: its filesystem is gone
        held.close()
    assert not is_mounted(nfs.mount)
    assert server.poll() is not None and client.poll() is not None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
    assert (nfs.root / "held-open").exists()


# --------------------------------------------------------------------------- faultfs
def test_faultfs_passes_through(faultfs):
    mnt, root = faultfs.mount, faultfs.root
    assert fuse_mounts()[str(mnt)] == "fuse.faultfs"
    payload = _roundtrip(mnt)
    assert (root / "sub" / "final.bin").read_bytes() == payload
    f = mnt / "sub" / "final.bin"
    os.truncate(f, 10)
    os.chmod(f, 0o600)
    os.utime(f, ns=(1_000_000_000, 2_000_000_000))
    st = f.stat()
    assert (st.st_size, st.st_mode & 0o777, st.st_mtime_ns) == (10, 0o600, 2_000_000_000)
    with open(f, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        fh.write(b"tail")
    with open(f, "ab") as fh:
        fh.write(b"!")
    assert f.read_bytes() == payload[:10] + b"tail!"
    assert os.statvfs(mnt).f_blocks > 0
    os.symlink("sub/final.bin", mnt / "link")
    assert (mnt / "link").read_bytes() == f.read_bytes()
    # rename(2) flags reach the backing fs: RENAME_NOREPLACE refuses to clobber
    (mnt / "other").write_bytes(b"x")
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.renameat2(-100, os.fsencode(mnt / "other"), -100, os.fsencode(f), ctypes.c_uint(1))
    assert rc == -1 and ctypes.get_errno() == errno.EEXIST
    for p in (mnt / "link", mnt / "other", f):
        p.unlink()
    (mnt / "sub").rmdir()
    assert list(root.iterdir()) == [] and os.listdir(mnt) == []
    assert faultfs.fired() == []


def test_faultfs_enospc_on_write_and_fsync(faultfs):
    mnt = faultfs.mount
    faultfs.set_rules([{"ops": ["write"], "path": "*.bin", "errno": "ENOSPC", "after_bytes": 64 << 10}])
    with pytest.raises(OSError) as exc:
        with open(mnt / "full.bin", "wb") as f:
            for _ in range(64):
                f.write(b"x" * 4096)
    assert exc.value.errno == errno.ENOSPC
    assert (mnt / "full.bin").stat().st_size == 64 << 10  # what fit before the "disk" filled up
    (mnt / "fine.txt").write_bytes(b"x" * (256 << 10))  # other paths are not affected
    recs = faultfs.fired()
    assert recs and {(r["op"], r["path"], r["errno"]) for r in recs} == {("write", "/full.bin", "ENOSPC")}

    faultfs.set_rules([{"ops": ["fsync"], "errno": "ENOSPC", "count": 1, "name": "sync-fails"}])
    with open(mnt / "synced.bin", "wb") as f:
        f.write(b"data")
        f.flush()
        with pytest.raises(OSError) as exc:
            os.fsync(f.fileno())
        assert exc.value.errno == errno.ENOSPC
        os.fsync(f.fileno())  # count=1: the second fsync goes through
    rec = faultfs.fired("fsync")
    assert [(r["path"], r["name"]) for r in rec] == [("/synced.bin", "sync-fails")]


def test_faultfs_eio_on_a_path_pattern(faultfs):
    mnt = faultfs.mount
    (mnt / "ck").mkdir()
    (mnt / "ck" / "old.distcp").write_bytes(b"shard")
    faultfs.set_rules([{"ops": ["create", "open", "read"], "path": "/ck/*.distcp", "errno": "EIO"}])
    with pytest.raises(OSError) as exc:
        open(mnt / "ck" / "new.distcp", "wb")
    assert exc.value.errno == errno.EIO
    with pytest.raises(OSError) as exc:
        (mnt / "ck" / "old.distcp").read_bytes()
    assert exc.value.errno == errno.EIO
    (mnt / "ck" / ".metadata").write_bytes(b"meta")  # not matched
    assert [(r["op"], r["path"]) for r in faultfs.fired()] == [
        ("create", "/ck/new.distcp"), ("open", "/ck/old.distcp")]
    faultfs.clear()
    assert (mnt / "ck" / "old.distcp").read_bytes() == b"shard"
    assert sorted(os.listdir(mnt / "ck")) == [".metadata", "old.distcp"]


def test_faultfs_delay_slows_create_and_clear_ends_it(faultfs):
    mnt = faultfs.mount
    t0 = time.monotonic()
    (mnt / "fast").write_bytes(b"")
    fast = time.monotonic() - t0
    faultfs.set_rules([{"ops": ["create"], "path": "/slow*", "delay": 0.5}])
    t0 = time.monotonic()
    (mnt / "slow").write_bytes(b"1")
    slow = time.monotonic() - t0
    assert 0.45 <= slow < fast + 2.0, (fast, slow)
    assert faultfs.fired("create")[0]["delay"] == 0.5

    # a stuck fsync: the record shows up while it hangs, clear() releases it
    faultfs.set_rules([{"ops": ["fsync"], "delay": 60}])
    f = open(mnt / "stuck", "wb")
    done = threading.Event()
    t = threading.Thread(target=lambda: (os.fsync(f.fileno()), done.set()), daemon=True)
    t0 = time.monotonic()
    t.start()
    faultfs.wait_fired(1, op="fsync")
    assert not done.is_set()
    faultfs.clear()
    assert done.wait(5) and time.monotonic() - t0 < 10
    f.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_reports_enospc_from_faultfs(faultfs):
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    dcp.save(state, checkpoint_id=str(faultfs.mount / "ok"))
    faultfs.set_rules([{"ops": ["write"], "path": "*.distcp", "errno": "ENOSPC"}])
    # CheckpointException derives from BaseException, not Exception
    with pytest.raises(BaseException) as exc:
        dcp.save(state, checkpoint_id=str(faultfs.mount / "full"))
    assert "No space left on device" in str(exc.value) or "ENOSPC" in str(exc.value), exc.value
    assert not (faultfs.root / "full" / ".metadata").exists()
    faultfs.clear()
    target = {"w": torch.zeros(100_000)}
    dcp.load(target, checkpoint_id=str(faultfs.mount / "ok"))
    assert torch.equal(target["w"], state["w"])


# --------------------------------------------------------------------------- S3
def test_s3_roundtrip_through_fsspec(s3_url):
    import fsspec

    fs, root = fsspec.core.url_to_fs(s3_url)
    assert type(fs).__name__ == "S3FileSystem"
    with fsspec.open(f"{s3_url}/run/a.bin", "wb") as f:
        f.write(b"hello" * 1000)
    fs.pipe(f"{root}/run/b.txt", b"b")
    with fsspec.open(f"{s3_url}/run/a.bin", "rb") as f:
        assert f.read() == b"hello" * 1000
    assert sorted(fs.ls(f"{root}/run", detail=False)) == [f"{root}/run/a.bin", f"{root}/run/b.txt"]
    fs.rm(f"{root}/run/a.bin")
    fs.invalidate_cache()
    assert fs.ls(f"{root}/run", detail=False) == [f"{root}/run/b.txt"]
    assert fs.exists(f"{root}/run/b.txt") and not fs.exists(f"{root}/run/a.bin")


@pytest.mark.slow
def test_s3_env_reaches_subprocesses(s3_url):
    code = textwrap.dedent("""
        import sys, fsspec
        url = sys.argv[1] + "/from-child"
        with fsspec.open(url, "wb") as f:
            f.write(b"child")
        print(fsspec.open(url).open().read().decode())
    """)
    r = subprocess.run([sys.executable, "-c", code, s3_url], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "child"
    import fsspec

    assert fsspec.open(f"{s3_url}/from-child").open().read() == b"child"


# --------------------------------------------------------------------------- DCP on 2 ranks
def dcp_roundtrip_rank(rank: int, ckpt: str, store: str) -> None:
    """Saves a "replicated" state (the same on every rank) plus an entry of this rank's
    through DCP to ``ckpt``, and loads it back."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    state = {"w": torch.randn(256, 64), "step": torch.tensor(7),
             f"rank{rank}": torch.full((10,), float(rank))}
    dcp.save(state, checkpoint_id=ckpt)
    target = {"w": torch.zeros(256, 64), "step": torch.tensor(0),
              f"rank{rank}": torch.zeros(10)}
    dcp.load(target, checkpoint_id=ckpt)
    assert all(torch.equal(target[k], v) for k, v in state.items()), rank
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_dcp_two_rank_roundtrip_through_bindfs(bindfs_dirs, tmp_path):
    mnt, root = bindfs_dirs
    spawn(dcp_roundtrip_rank, args=(str(mnt / "ckpt"), str(tmp_path / "store")), nprocs=2)
    files = sorted(os.listdir(root / "ckpt"))
    assert ".metadata" in files and {"__0_0.distcp", "__1_0.distcp"} <= set(files), files
    assert is_mounted(mnt)
