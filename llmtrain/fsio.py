"""Small-file helpers over fsspec, shared by the data pipeline and checkpoints.

What ``write_atomic`` relies on, per kind of storage:

- local disks and FUSE mounts (fsspec ``file``): ``rename(2)`` within one directory
  replaces the target atomically. The data is fsync'ed before the rename and the
  directory after it, so a crash cannot leave the new name on empty data.
- NFS mounts (fsspec ``file`` too), what a checkpoint's commit needs of them:

  * RENAME within one directory is one operation the server applies atomically: a
    client sees the old manifest or the new one, never a mix. (A RENAME retransmitted
    after a lost reply can fail with ENOENT although it was applied, if the server's
    duplicate-request cache missed it: the save is then reported failed while committed,
    which loses nothing.)
  * Close-to-open consistency: close(2) sends the file's remaining writes and open(2)
    fetches fresh attributes, so whoever opens a file after its writer closed it reads
    all of it. Every shard is written, fsync'ed and closed before its rank reports to
    rank 0, and the manifest before its rename, so once ``MANIFEST.json`` has its name
    every byte it lists is on the server.
  * fsync and COMMIT: a client sends UNSTABLE WRITEs and makes them durable with a
    COMMIT at fsync or close; write errors (ENOSPC, EDQUOT, EIO) often come back only
    there, not from write(2). The fsync of each shard and of ``.metadata`` (done by
    ``checkpoint/storage.py`` for every ``file`` path) and of the manifest is what
    surfaces them, and any error fails the save. Servers commit CREATE,
    RENAME and REMOVE before they reply, so the directory fsync is a no-op on NFS.
  * Attribute and name caching: another node may see a stale size from stat(2), and a
    stale listing or "no such file" for a new name, for up to ``acdirmax``/``acregmax``
    (30-60 s by default), though open(2) revalidates. The protocol stays safe under
    that: the commit is a name appearing, so a node that does not see a manifest yet
    takes the checkpoint for incomplete (it resumes from an older one, never from a
    partial one, and retention never deletes an incomplete checkpoint newer than the
    newest committed); and committed files are never changed in place (a step saved
    again is deleted and written as new files), so no cached size can be stale for them.
  * Silly rename: a file unlinked while still open on the client becomes ``.nfsXXXX``
    until closed, and its directory cannot be removed meanwhile. llmtrain holds no
    checkpoint file open once it is committed; a stray one held by another process makes
    that retention pass fail, and the next one tries again.

  The tests run this on nfs-ganesha through ``llmtrain.chaos.nfsfuse``, a client with no
  caching and FILE_SYNC writes: they show the protocol over NFSv4 and a real server;
  the caching above is argued, not tested.
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

from llmtrain.config import ConfigError

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


def sync_dir(url: str) -> None:
    """Makes the names in a local directory durable (a new entry, a rename): without it a
    crash can lose a file whose data was fsync'ed. Other storage has no directory to sync
    (object stores), or syncs it with the operation (NFS)."""
    fs, path = fsspec.core.url_to_fs(url)
    if not is_local(fs):
        return
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _synced_temp(path: str, data: bytes) -> str:
    """``data`` in a new temporary file beside local ``path``, fsync'ed; returns its name."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    makedirs(os.path.dirname(path))
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as f:
        set_mode(f.fileno(), FILE_MODE)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def write_atomic(url: str, data: bytes) -> None:
    """Writes ``data`` so that readers see either the old file or all of the new one."""
    fs, path = fsspec.core.url_to_fs(url)
    if is_local(fs):
        os.replace(_synced_temp(path, data), path)
        sync_dir(os.path.dirname(path))
        return
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & OBJECT_STORES:
        fs.pipe_file(path, data)
        return
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)


def create_atomic(url: str, data: bytes) -> None:
    """Writes ``data`` as a new file, whole, or raises FileExistsError when ``url`` exists:
    a commit that must not land over another's (a stale writer's manifest, late, over the
    one the job's membership now committed). Local and NFS/FUSE mounts: a hard link of the
    fsync'ed temporary file (``link(2)`` never replaces its target; where the mount has no
    hard links, a check, then the rename); object stores: a conditional put (S3's
    ``If-None-Match``, where the store honours it); elsewhere fsspec's check, then write."""
    fs, path = fsspec.core.url_to_fs(url)
    if not is_local(fs):
        fs.pipe_file(path, data, mode="create")
        return
    tmp = _synced_temp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        os.unlink(tmp)
        raise
    except OSError:  # no hard links here (some FUSE mounts): a narrow window stays open
        if os.path.lexists(path):
            os.unlink(tmp)
            raise FileExistsError(errno.EEXIST, "exists already", path) from None
        os.rename(tmp, path)
    else:
        os.unlink(tmp)
    sync_dir(os.path.dirname(path))


def probe_writable(url: str, name: str,
                   create: bool = True) -> tuple[fsspec.AbstractFileSystem, str]:
    """Writes, then removes, a small file ``name`` in the directory ``url``, created if
    needed: raises whatever the storage raises when it cannot take files. Returns the
    filesystem and the path probed. ``create=False``: a local directory that does not
    exist yet is left uncreated, and the nearest one above it that does is probed (where
    the run would create it), so that a check leaves nothing behind."""
    fs, path = fsspec.core.url_to_fs(url)
    if not create and is_local(fs):
        while not fs.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        url = path
    else:
        makedirs(path, fs)
    probe = join(url, name)
    write_atomic(probe, b"ok")
    fs.rm_file(fsspec.core.url_to_fs(probe)[1])
    return fs, path


def require_writable(field: str, url: str) -> None:
    """Fails before any process group starts if ``url`` (config field ``field``) cannot
    take files, naming the field and what to give instead."""
    try:
        probe_writable(url, f".llmtrain-write-test-{os.getpid()}")
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"{field}={url!r} is not writable ({type(e).__name__}: {e}); "
                          f"give a writable local path or fsspec URL") from None
