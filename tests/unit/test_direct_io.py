"""Checkpoint files written around the page cache: the bytes are the file's, exactly; the
file is really opened O_DIRECT; a save leaves none of its pages cached where it writes
direct, and does where it does not; the filesystem is told apart as findmnt does."""

import ctypes
import mmap
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp

from llmtrain.checkpoint import direct_io, storage


def block_fs_dir(tmp_path):
    """``tmp_path``, where it is on a filesystem that ``auto`` writes direct."""
    kind = direct_io.filesystem_type(str(tmp_path))
    if kind not in direct_io.BLOCK_FILESYSTEMS:
        pytest.skip(f"the test directory is on {kind}, not a local block filesystem")
    return tmp_path


def test_filesystem_type_is_the_one_findmnt_names(tmp_path):
    if not shutil.which("findmnt"):
        pytest.skip("no findmnt (util-linux)")
    for path in (str(tmp_path), "/proc/self", "/dev/shm", str(tmp_path / "not-yet" / "file")):
        target = path if os.path.exists(path) else str(tmp_path)
        # the filesystem the path's lookup ends on: the last line of a stack of mounts
        expected = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", target],
                                  capture_output=True, text=True).stdout.split()[-1]
        assert direct_io.filesystem_type(path) == expected, path


def test_the_setting_picks_direct_writes(tmp_path):
    local = str(block_fs_dir(tmp_path) / "f")
    assert direct_io.wanted(local, "auto") and direct_io.wanted(local, "on")
    assert not direct_io.wanted(local, "off")
    if direct_io.filesystem_type("/dev/shm") == "tmpfs":
        assert not direct_io.wanted("/dev/shm/f", "auto")
        assert direct_io.wanted("/dev/shm/f", "on")


@pytest.mark.parametrize("pieces", [
    [], [1], [4095], [4096], [direct_io.CHUNK], [direct_io.CHUNK - 1, 2],
    [3, direct_io.CHUNK * 2 + 123, 4096, 7],
])
def test_a_direct_file_holds_exactly_the_bytes_written(tmp_path, pieces):
    path = str(block_fs_dir(tmp_path) / "f")
    data = [os.urandom(n) for n in pieces]
    with direct_io.open_direct(path, 0o644) as f:
        with open(f"/proc/self/fdinfo/{f.fileno()}") as info:
            flags = int(next(line for line in info if line.startswith("flags:")).split()[1], 8)
        assert flags & os.O_DIRECT
        for d in data:
            assert f.write(d) == len(d)
        f.finish()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        assert f.read() == b"".join(data)


def test_whole_pages_that_start_a_page_are_written_as_they_lie(tmp_path):
    """A staged save's buffers start pages: their whole blocks go to the file straight
    from them, and only the odd tail through the file's own buffer."""
    path = str(block_fs_dir(tmp_path) / "f")
    block = torch.empty(5 * direct_io.ALIGN, dtype=torch.uint8)
    start = -block.data_ptr() % direct_io.ALIGN
    aligned = block[start:start + 2 * direct_io.ALIGN + 5].random_(0, 256)
    with direct_io.open_direct(path, 0o644) as f:
        f.write(aligned.numpy())
        assert f._filled == 5 and bytes(f._view[:5]) == aligned[-5:].numpy().tobytes()
        f.write(b"xyz")  # the buffer holds part of a block: through it from here on
        assert f._filled == 8
        f.finish()
    with open(path, "rb") as f:
        assert f.read() == aligned.numpy().tobytes() + b"xyz"


def resident_pages(path: str) -> int:
    """How many of ``path``'s pages are in the page cache (mincore(2) on a mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(address, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_a_save_written_direct_leaves_its_pages_out_of_the_cache(tmp_path, setting):
    """The point of direct writes: a save's bytes do not pass through the page cache (its
    kernel copy, dirty tracking, writeback and reclaim are what training lost). Written
    through the cache instead, the same save's pages are found there."""
    url = str(block_fs_dir(tmp_path) / "step-1")
    state = {"w": torch.randn(3 << 20), "b": torch.arange(1000)}
    dcp.save(state, no_dist=True,
             storage_writer=storage.CommitWriter(url, {"step": 1}, thread_count=2,
                                                 direct_io=setting))
    shards = sorted(p for p in os.listdir(url) if p.endswith(".distcp"))
    resident = sum(resident_pages(os.path.join(url, p)) for p in shards)
    if setting == "auto":
        assert resident == 0
    else:
        assert resident > 0
    assert storage.verify(url, checksums=True) == []
    loaded = {"w": torch.zeros(3 << 20), "b": torch.zeros(1000, dtype=torch.long)}
    dcp.load(loaded, checkpoint_id=url, storage_reader=storage.shard_read.ShardReader(url),
             no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
