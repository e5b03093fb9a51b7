"""Small-file helpers over fsspec, shared by the data pipeline and checkpoints.

What ``write_atomic`` relies on, per kind of storage:

- local disks, NFS and FUSE mounts (fsspec ``file``): ``rename(2)`` within one directory
  replaces the target atomically, and NFS's close-to-open consistency makes the renamed
  file whole for any client that opens it afterwards. The data is fsync'ed before the
  rename and the directory after it, so a crash cannot leave the new name on empty data.
- object stores (s3, gcs, azure): a single PUT of an object is atomic, and since 2020
  S3 gives strong read-after-write consistency, so the object is written directly.
- anything else fsspec offers (``memory://`` and others): write a temporary name, then
  ``mv`` it into place.

Local files and directories get explicit modes, ``FILE_MODE`` and ``DIR_MODE``, whatever
the umask: a permissive one (``umask 0``) must not leave a run dir that anyone can write,
where a manifest, an exclusion record or a shard could be swapped.
"""

from __future__ import annotations

import errno
import os
import posixpath
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}
FILE_MODE, DIR_MODE = 0o644, 0o755


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def set_mode(target: str | int, mode: int) -> None:
    """``chmod`` of a local path or descriptor, so its mode does not depend on the umask;
    storage without modes of its own (some FUSE mounts of object stores) is left as is."""
    try:
        os.chmod(target, mode)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.ENOSYS):
            raise


def makedirs(path: str, fs: fsspec.AbstractFileSystem | None = None) -> None:
    """``fs.makedirs(path, exist_ok=True)`` (``fs`` None: local), and every local directory
    it creates gets ``DIR_MODE`` (``os.makedirs`` applies the umask, and its mode argument
    only to the last directory)."""
    if fs is not None and not is_local(fs):
        fs.makedirs(path, exist_ok=True)
        return
    missing = []
    path = path.rstrip("/")
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:  # another writer made it: its mode is that one's
            continue
        set_mode(d, DIR_MODE)


def write_atomic(url: str, data: bytes) -> None:
    """Writes ``data`` so that readers see either the old file or all of the new one."""
    fs, path = fsspec.core.url_to_fs(url)
    if is_local(fs):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        makedirs(os.path.dirname(path))
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as f:
            set_mode(f.fileno(), FILE_MODE)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & OBJECT_STORES:
        fs.pipe_file(path, data)
        return
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)


def probe_writable(url: str, name: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Creates the directory ``url`` if needed and writes, then removes, a small file
    ``name`` in it: raises whatever the storage raises when it cannot take files."""
    fs, path = fsspec.core.url_to_fs(url)
    makedirs(path, fs)
    probe = join(url, name)
    write_atomic(probe, b"ok")
    fs.rm_file(fsspec.core.url_to_fs(probe)[1])
    return fs, path
