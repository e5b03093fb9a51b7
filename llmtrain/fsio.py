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
"""

from __future__ import annotations

import os
import posixpath
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def write_atomic(url: str, data: bytes) -> None:
    """Writes ``data`` so that readers see either the old file or all of the new one."""
    fs, path = fsspec.core.url_to_fs(url)
    if is_local(fs):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
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
    fs.makedirs(path, exist_ok=True)
    probe = join(url, name)
    write_atomic(probe, b"ok")
    fs.rm_file(fsspec.core.url_to_fs(probe)[1])
    return fs, path
