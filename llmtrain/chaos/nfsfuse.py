#!/usr/bin/env python3
"""nfsfuse: mounts an NFSv4 export through FUSE, with a user-space NFS client (nfs4fs).

    python -m llmtrain.chaos.nfsfuse HOST:PORT /PSEUDO/PATH MOUNTPOINT [--foreground]

Where no kernel NFS client exists (containers, CI machines), this is how a job's files
reach an NFS server through the kernel's file API, as they would on a cluster's NFS mount:
every open, write, rename and unlink on MOUNTPOINT becomes the NFSv4 operation on the
server (OPEN, WRITE, RENAME, REMOVE...); only writes not sent yet are kept on this side.

How it compares with a kernel NFS client (see ``llmtrain.fsio`` for what the commit
protocol needs of one):
  * Writes are gathered per open file into WRITEs of up to 8 MiB, as a kernel client
    gathers dirty pages; close(2) and fsync(2) send what is left. So, as on NFS, a write
    error (ENOSPC, EDQUOT, EIO) may come back from close or fsync instead of write.
  * Each WRITE is ``stable = FILE_SYNC4`` (the client library sends no UNSTABLE ones):
    once it is answered the data is on the server's stable storage, so fsync has nothing
    to COMMIT beyond sending the gathered writes.
  * No attribute, name or data caching here (FUSE timeouts 0, page cache dropped on
    open): stricter than a kernel client's close-to-open consistency, never looser.
  * An unlinked file that is still open is renamed to ``.fuse_hidden*`` until closed
    (libfuse's default), as a kernel NFS client renames it to ``.nfs*`` ("silly
    rename"): a directory holding one cannot be removed meanwhile.
  * One thread serves every request, over one NFS connection.
  * Not supported: symlinks, hard links, chown, setting times, rename flags
    (RENAME_NOREPLACE/EXCHANGE), statfs figures.
"""
from __future__ import annotations

import argparse
import errno
import os
import posixpath
import stat

import mfusepy as fuse
from nfs4fs import _native as nfs

_MAX_ERRNO = 4095
GATHER = 8 << 20  # bytes of contiguous writes sent as one WRITE


class NfsFuse(fuse.Operations):
    use_ns = True

    def __init__(self, server: str, export: str):
        self.client = nfs.NfsClient(server, auth="auth_sys")
        self.export = "/" + export.strip("/")
        self.uid, self.gid = os.getuid(), os.getgid()  # NFSv4 owners are not id-mapped
        self._paths: dict[int, str] = {}  # open handle -> its path (following renames)
        self._unsent: dict[int, tuple[int, bytearray]] = {}  # handle -> (offset, bytes)

    def _send(self, fh: int) -> None:
        """Sends the handle's gathered writes; an error here is the write's error."""
        offset, data = self._unsent.pop(fh, (0, b""))
        view = memoryview(data)
        while view:
            n = self.client.pwrite(fh, bytes(view), offset)
            offset, view = offset + n, view[n:]

    def _send_path(self, path: str) -> None:
        for fh in [fh for fh in self._unsent if self._paths.get(fh) == path]:
            self._send(fh)

    def _opened(self, fh: int, path: str) -> int:
        self._paths[fh] = path
        return fh

    def _remote(self, path: str) -> str:
        return self.export if path == "/" else self.export + path

    def _attrs(self, st: dict) -> dict:
        kind = {"directory": stat.S_IFDIR, "file": stat.S_IFREG}.get(st["type"])
        if kind is None or st.get("islink"):
            raise fuse.FuseOSError(errno.EOPNOTSUPP)
        return {"st_mode": kind | (st["mode"] & 0o7777), "st_ino": st["fileid"],
                "st_nlink": st["nlink"], "st_size": st["size"], "st_blocks": st["blocks"],
                "st_uid": self.uid, "st_gid": self.gid, "st_atime": st["accessed_ns"],
                "st_mtime": st["modified_ns"], "st_ctime": st["change"]}

    def destroy(self, path):
        self.client.shutdown()

    # ------------------------------------------------------------------ metadata
    def getattr(self, path, fh=None):
        if fh:
            self._send(fh)
            return self._attrs(self.client.fstat(fh))
        self._send_path(path)  # the size must count what was written
        return self._attrs(self.client.stat(self._remote(path)))

    def readdir(self, path, fh):
        entries = [".", ".."]
        for st in self.client.listdir(self._remote(path)):
            entries.append((posixpath.basename(st["name"]), self._attrs(st), 0))
        return entries

    def mkdir(self, path, mode):
        self.client.mkdir(self._remote(path), mode & 0o7777)
        return 0

    def rmdir(self, path):
        try:
            self.client.rm([self._remote(path)], False)
        except IsADirectoryError:  # what the client says of a directory that is not empty
            raise fuse.FuseOSError(errno.ENOTEMPTY) from None
        return 0

    def unlink(self, path):
        self.client.remove_many([self._remote(path)])
        return 0

    def rename(self, old, new):
        self.client.rename_many([(self._remote(old), self._remote(new))])
        for fh, p in self._paths.items():
            if p == old or p.startswith(old + "/"):
                self._paths[fh] = new + p[len(old):]
        return 0

    def chmod(self, path, mode):
        self.client.chmod(self._remote(path), mode & 0o7777)
        return 0

    def truncate(self, path, length, fh=None):
        self._send_path(path)
        self.client.truncate(self._remote(path), length)
        return 0

    # ------------------------------------------------------------------ file I/O
    def create(self, path, mode, flags):
        how = "x+" if flags & os.O_EXCL else "w+"
        return self._opened(self.client.open(self._remote(path), how,
                                             permissions=mode & 0o7777), path)

    def open(self, path, flags):
        # O_TRUNC arrives as a separate truncate; O_APPEND writes arrive at the file's end
        how = "r" if flags & os.O_ACCMODE == os.O_RDONLY else "r+"
        return self._opened(self.client.open(self._remote(path), how), path)

    def read(self, path, size, offset, fh):
        self._send(fh)
        return self.client.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        start, unsent = self._unsent.get(fh, (offset, None))
        if unsent is None or start + len(unsent) != offset:
            self._send(fh)
            start, unsent = self._unsent.setdefault(fh, (offset, bytearray()))
        unsent += data
        if len(unsent) >= GATHER:
            self._send(fh)
        return len(data)

    def flush(self, path, fh):  # close(2): its result is this one's
        self._send(fh)
        return 0

    def release(self, path, fh):
        try:
            self._send(fh)
        finally:
            self._paths.pop(fh, None)
            self.client.close(fh)
        return 0

    def fsync(self, path, datasync, fh):
        self._send(fh)  # each WRITE is FILE_SYNC4: nothing more to COMMIT
        return 0

    def fsyncdir(self, path, datasync, fh):
        return 0  # NFS servers commit CREATE/RENAME/REMOVE before replying


class _FUSE(fuse.FUSE):
    """The kernel refuses a reply with an error number past 4095, and the request would
    wait forever: NFS status codes the client passes on unmapped become EIO."""

    def _wrapper(self, func, *args, **kwargs):
        ret = super()._wrapper(func, *args, **kwargs)
        return -errno.EIO if isinstance(ret, int) and ret < -_MAX_ERRNO else ret


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("server", help="HOST:PORT of the NFSv4 server")
    ap.add_argument("export", help="the export's pseudo path, e.g. /export")
    ap.add_argument("mountpoint")
    ap.add_argument("--foreground", action="store_true", help="do not daemonize")
    a = ap.parse_args(argv)
    _FUSE(NfsFuse(a.server, a.export), a.mountpoint, foreground=a.foreground,
              nothreads=True, fsname=f"{a.server}:{a.export}", subtype="nfsfuse",
              attr_timeout=0, entry_timeout=0, negative_timeout=0, use_ino=True)


if __name__ == "__main__":
    main()
