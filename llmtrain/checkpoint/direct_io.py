"""Checkpoint files written around the page cache (``O_DIRECT``), on local disks.

A buffered write copies every byte of a save into the page cache, which the kernel then
tracks dirty, writes back and reclaims: kernel CPU taken from training on the same cores,
and a save's worth of cache evicted (the data loader's pages among it). Measured on a
2-core VM (1 rank, 286 MB a save, ext4 on a virtio disk): 0.1-0.7 s of kernel time a
save, more as the cache filled, against 0.02 s written direct, plus one user-space copy
of 0.06 s wherever a byte is copied into an aligned buffer. Direct I/O needs the
memory's address, the file offset and the length aligned to the device's logical block.
A staged save's buffers each start a page (:mod:`.staging`) and a file holds its tensors
of whole pages first (:func:`.shard_write.write_shards`), so those go to the device straight
from the staging buffers, with no copy; the rest of a file goes through one page-aligned
buffer, in whole chunks, and its tail is written padded and cut back to its size with
``ftruncate``. The caller still fsyncs (the device's cache, the file's size).

``checkpoint.direct_io``: ``auto`` writes direct on local block filesystems only (ext4,
xfs, btrfs, f2fs), where it is well defined; NFS (each direct write a synchronous RPC),
FUSE and tmpfs keep the page cache. ``on`` tries it on any local path (Lustre and GPFS
take it) and falls back to buffered writes where the filesystem refuses it. ``off``
never. Object stores are not files: always their own writes.
"""

from __future__ import annotations

import errno
import mmap
import os
import re

import numpy as np

ALIGN = 4096  # a multiple of every logical block size (512 or 4096)
CHUNK = 4 << 20  # bytes per write: a few syscalls a save, well inside the CPU's caches
BLOCK_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs"})


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` (existing, or to be made in an existing
    directory) is on, from ``/proc/self/mountinfo``; None where that is not readable."""
    target = os.path.realpath(path if os.path.isdir(path) else os.path.dirname(path) or ".")
    best, kind = "", None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields, _, tail = line.partition(" - ")
                point = _unescape(fields.split()[4])
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):  # a later mount over it wins too
                    best, kind = point, tail.split()[0]
    except (OSError, IndexError):
        return None
    return kind


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes come as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def wanted(path: str, setting: str) -> bool:
    """Whether a file at local ``path`` is to be written direct, by ``setting``."""
    if setting == "off":
        return False
    return setting == "on" or filesystem_type(path) in BLOCK_FILESYSTEMS


class DirectFile:
    """A new file written with ``O_DIRECT``, straight from the caller's memory where a
    write starts a page at a block boundary of the file, else through an aligned buffer:
    the ``write`` of a stream, then ``finish`` (the padded tail, the size cut back), the
    caller's fsync, and ``close``. :func:`open_direct` makes one, or says the filesystem
    refuses."""

    def __init__(self, fd: int):
        self._fd = fd
        self._buffer = mmap.mmap(-1, CHUNK)  # anonymous memory starts on a page
        self._view = memoryview(self._buffer)
        self._filled = 0
        self.size = 0

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        at = 0
        if not self._filled and len(view) >= ALIGN and address(view) % ALIGN == 0:
            at = len(view) - len(view) % ALIGN  # whole blocks that start a page: as they
            self._write_out(view[:at])          # lie, no copy (a staged save's buffers)
        while at < len(view):
            n = min(len(view) - at, CHUNK - self._filled)
            self._view[self._filled:self._filled + n] = view[at:at + n]
            self._filled += n
            at += n
            if self._filled == CHUNK:
                self._drain(CHUNK)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        """Nothing: the buffer goes out whole, or at ``finish``."""

    def finish(self) -> None:
        """Writes what is buffered, padded with zeros to a whole block, and cuts the file
        back to the bytes written."""
        if self._filled:
            padded = -(-self._filled // ALIGN) * ALIGN
            self._view[self._filled:padded] = bytes(padded - self._filled)
            self._drain(padded)
            os.ftruncate(self._fd, self.size)

    def _drain(self, length: int) -> None:
        self._write_out(self._view[:length])
        self._filled = 0

    def _write_out(self, view: memoryview) -> None:
        done = 0
        while done < len(view):  # a short write (a file-size limit reached) leaves a
            done += os.write(self._fd, view[done:])  # block boundary: go on from it

    def close(self) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        # the buffer goes with its last view: a failed write's traceback may hold one
        self._view = self._buffer = None

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def address(buffer) -> int:
    """Where a buffer's bytes are in memory, writable or not (0 when empty)."""
    return np.frombuffer(buffer, np.uint8).ctypes.data if len(buffer) else 0


def open_direct(path: str, mode: int) -> DirectFile | None:
    """``path`` made anew (``mode``) for direct writes; None where its filesystem does not
    take ``O_DIRECT`` (EINVAL at open), so the caller writes through the page cache."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT,
                     mode)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    return DirectFile(fd)
