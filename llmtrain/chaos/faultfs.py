#!/usr/bin/env python3
"""faultfs: a passthrough FUSE filesystem that injects storage faults on demand.

    python -m llmtrain.chaos.faultfs ROOT MOUNTPOINT --control RULES.json [--fired FIRED.jsonl]
                                    [--foreground] [--allow-other]

Every operation on MOUNTPOINT is forwarded to the same path under ROOT, unless a rule in
RULES.json says otherwise. RULES.json is re-read whenever it changes (its inode, size or
mtime); write it atomically (temp file + rename) so the filesystem never sees half a file.
A missing, empty or ``[]`` file means plain passthrough.

RULES.json is a JSON list of rules (or ``{"rules": [...]}``); the first matching rule wins:

    {"ops": ["create", "fsync"],  # operations it applies to; omitted or "*" = all (see OPS)
     "path": "*.distcp",          # fnmatch pattern on the path inside the fs, always starting
                                  # with "/" ("*" also matches "/"); rename/link/symlink match
                                  # the source or the destination. Default "*".
     "errno": "ENOSPC",           # fail the op with this errno (name or number); omitted = no error
     "delay": 0.5,                # sleep this many seconds before the op (or before failing)
     "count": 1,                  # fire at most this many times (default unlimited)
     "after_bytes": 1048576,      # fire only once this many bytes went through `write` on paths
                                  # matching "path" since the rules were loaded; a write fires if
                                  # it would take the total past after_bytes (disk-full model)
     "prob": 1.0,                 # fire with this probability (default 1)
     "name": "disk-full"}         # free-form label, copied into the fired records

Each fired rule writes one line to stderr and appends one JSON object to FIRED.jsonl
(default: ``fired.jsonl`` next to RULES.json):
    {"t": 1700000000.1, "seq": 3, "op": "fsync", "path": "/ck/__0_0.distcp", "new_path": null,
     "nbytes": 0, "errno": "ENOSPC", "delay": 0, "rule": 0, "name": null, "generation": 2}
"seq" counts fired faults since mount, "rule" is the rule's index, "generation" counts rule
reloads, "nbytes" is the size of a write. The record is written when the rule fires, before
any delay, so a test can see that an op is stuck in a delay. A rule with neither "errno" nor
"delay" only records: a cheap way to watch which ops a piece of code makes.

Semantics worth knowing (Linux FUSE, libfuse3 high-level API):
  * open(..., "w") of a *new* file is `create`; of an existing file it is `open` (plus
    `truncate`). Put both in "ops" to catch every open-for-write.
  * close() returns the result of `flush`; `release` runs after close() already returned,
    so its errors are lost and its delays do not slow the caller.
  * write() reaches the fs in pieces (4 KiB to 128 KiB): put delays on create/fsync/flush,
    not on write, or one file takes forever.
  * A delay in progress ends early when the rules are cleared (file becomes empty/``[]``).
Kernel attribute/entry caching is disabled (timeouts 0) so getattr faults fire reliably.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import fnmatch
import json
import logging
import os
import random
import stat
import threading
import time

import mfusepy as fuse

from llmtrain.log import log_to_stderr

# by name: run as ``python -m llmtrain.chaos.faultfs``, __name__ is "__main__"
log = logging.getLogger("llmtrain.chaos.faultfs")

OPS = ("getattr", "access", "readlink", "opendir", "readdir", "mkdir", "rmdir", "unlink", "rename",
       "link", "symlink", "chmod", "chown", "utimens", "truncate", "open", "create", "read",
       "write", "flush", "release", "fsync", "fsyncdir", "statfs")

_UTIME_NOW = (1 << 30) - 1
_UTIME_OMIT = (1 << 30) - 2
_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100


def _errno_of(value) -> int:
    if isinstance(value, int):
        return value
    code = getattr(errno, str(value), None)
    if not isinstance(code, int):
        raise ValueError(f"unknown errno {value!r}")
    return code


def _log(msg: str) -> None:
    log.info("faultfs[%d]: %s", os.getpid(), msg)


class Rule:
    def __init__(self, index: int, spec: dict):
        unknown = set(spec) - {"ops", "path", "errno", "delay", "count", "after_bytes", "prob", "name"}
        if unknown:
            raise ValueError(f"rule {index}: unknown keys {sorted(unknown)}")
        ops = spec.get("ops", "*")
        ops = [ops] if isinstance(ops, str) else list(ops)
        bad = [o for o in ops if o != "*" and o not in OPS]
        if bad:
            raise ValueError(f"rule {index}: unknown ops {bad}; known: {', '.join(OPS)}")
        self.index = index
        self.ops = None if "*" in ops else frozenset(ops)
        self.path = spec.get("path", "*")
        self.errno_name = spec.get("errno")
        self.errno = None if self.errno_name is None else _errno_of(self.errno_name)
        if isinstance(self.errno_name, int):
            self.errno_name = errno.errorcode.get(self.errno_name, str(self.errno_name))
        self.delay = float(spec.get("delay", 0) or 0)
        self.count = spec.get("count")
        self.after_bytes = spec.get("after_bytes")
        self.prob = float(spec.get("prob", 1.0))
        self.name = spec.get("name")
        self.fired = 0
        self.bytes_seen = 0

    def matches_path(self, paths) -> bool:
        return any(p is not None and fnmatch.fnmatchcase(p, self.path) for p in paths)


class FaultFS(fuse.Operations):
    use_ns = True
    # libfuse then passes no path to ops on an open handle (read, write, flush, fsync, readdir...):
    # we remember each handle's path ourselves (following renames), so rules match the name the
    # file was opened under.
    flag_nopath = True
    flag_nullpath_ok = True

    def __init__(self, root: str, control: str, fired_log: str):
        self.root = os.path.realpath(root)
        self.control = control
        self.fired_log = fired_log
        self.rules: list[Rule] = []
        self.generation = 0
        self.seq = 0
        self._stamp = None
        self._lock = threading.Lock()
        self._closing = False
        self._handles: dict[int, str] = {}  # open fd -> path inside the fs (kept across renames)

    # ------------------------------------------------------------------ rules
    def _reload(self) -> None:
        """Re-read the rules if the control file changed. Caller holds the lock."""
        try:
            st = os.stat(self.control)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        self._stamp = stamp
        specs = []
        if stamp is not None:
            try:
                with open(self.control) as f:
                    text = f.read().strip()
                specs = json.loads(text) if text else []
                if isinstance(specs, dict):
                    specs = specs.get("rules", [])
                rules = [Rule(i, s) for i, s in enumerate(specs)]
            except (OSError, ValueError) as e:  # keep the old rules on a bad file
                _log(f"ignoring unreadable rules file {self.control}: {e}")
                return
        else:
            rules = []
        self.rules = rules
        self.generation += 1
        _log(f"rules generation {self.generation}: {len(rules)} rule(s)")

    def _fault(self, op: str, path, new_path=None, nbytes: int = 0) -> None:
        """Apply the first matching rule for this op: record it, sleep, raise."""
        paths = (path, new_path)
        with self._lock:
            self._reload()
            hit = None
            for rule in self.rules:
                if rule.ops is not None and op not in rule.ops:
                    continue
                if not rule.matches_path(paths):
                    continue
                if rule.after_bytes is not None and (
                        rule.bytes_seen + nbytes <= rule.after_bytes if op == "write"
                        else rule.bytes_seen < rule.after_bytes):
                    continue
                if rule.count is not None and rule.fired >= rule.count:
                    continue
                if rule.prob < 1.0 and random.random() >= rule.prob:
                    continue
                rule.fired += 1
                hit = rule
                break
            if op == "write" and (hit is None or hit.errno is None):  # this write goes through
                for rule in self.rules:
                    if rule.after_bytes is not None and rule.matches_path(paths):
                        rule.bytes_seen += nbytes
            if hit is None:
                return
            self.seq += 1
            record = {"t": time.time(), "seq": self.seq, "op": op, "path": path, "new_path": new_path,
                      "nbytes": nbytes, "errno": hit.errno_name, "delay": hit.delay, "rule": hit.index,
                      "name": hit.name, "generation": self.generation}
            line = json.dumps(record) + "\n"
            with open(self.fired_log, "a") as f:
                f.write(line)
            generation = self.generation
        where = path if new_path is None else f"{path} -> {new_path}"
        _log(f"fired rule {hit.index}{'' if hit.name is None else ' ' + repr(hit.name)}: {op} {where}"
             f"{f' delay={hit.delay}s' if hit.delay else ''}{f' -> {hit.errno_name}' if hit.errno else ''}")
        if hit.delay:
            self._sleep(hit.delay, generation)
        if hit.errno is not None:
            raise fuse.FuseOSError(hit.errno)

    def _sleep(self, seconds: float, generation: int) -> None:
        end = time.monotonic() + seconds
        while not self._closing:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))
            with self._lock:
                self._reload()
                if self.generation != generation and not self.rules:
                    _log("rules cleared: delay cut short")
                    return

    # ------------------------------------------------------------------ helpers
    def _path(self, path, fh):
        return path if path is not None else self._handles.get(fh)

    def _remember(self, fh: int, path: str) -> int:
        with self._lock:
            self._handles[fh] = path
        return fh

    def _forget(self, fh: int) -> None:
        with self._lock:
            self._handles.pop(fh, None)

    def _real(self, path) -> str:
        if path is None:  # no name known for this handle
            raise fuse.FuseOSError(errno.ENOENT)
        return os.path.join(self.root, path.lstrip("/"))

    @staticmethod
    def _stat_dict(st: os.stat_result) -> dict:
        d = {k: getattr(st, k) for k in ("st_mode", "st_ino", "st_dev", "st_nlink", "st_uid", "st_gid",
                                          "st_size", "st_blocks", "st_blksize", "st_rdev")}
        d.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return d

    # ------------------------------------------------------------------ lifecycle
    def destroy(self, path):
        self._closing = True

    # ------------------------------------------------------------------ metadata
    def getattr(self, path, fh=None):
        self._fault("getattr", self._path(path, fh))
        return self._stat_dict(os.fstat(fh) if fh is not None else os.lstat(self._real(path)))

    def access(self, path, amode):
        self._fault("access", path)
        if not os.access(self._real(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def readlink(self, path):
        self._fault("readlink", path)
        return os.readlink(self._real(path))

    def opendir(self, path):
        self._fault("opendir", path)
        return self._remember(os.open(self._real(path), os.O_RDONLY | os.O_DIRECTORY), path)

    def readdir(self, path, fh):
        self._fault("readdir", self._path(path, fh))
        # Give inode numbers: with use_ino an entry with inode 0 is dropped by readdir(3).
        entries = [(".", {"st_mode": stat.S_IFDIR, "st_ino": os.fstat(fh).st_ino}, 0),
                   ("..", {"st_mode": stat.S_IFDIR, "st_ino": os.stat("..", dir_fd=fh).st_ino}, 0)]
        with os.scandir(fh) as it:
            for e in it:
                try:
                    mode = e.stat(follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                entries.append((e.name, {"st_mode": mode, "st_ino": e.inode()}, 0))
        return entries

    def releasedir(self, path, fh):
        self._forget(fh)
        os.close(fh)
        return 0

    def statfs(self, path):
        self._fault("statfs", path)
        sv = os.statvfs(self._real(path))
        return {k: getattr(sv, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                             "f_files", "f_ffree", "f_favail", "f_flag", "f_namemax")}

    def mkdir(self, path, mode):
        self._fault("mkdir", path)
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path):
        self._fault("rmdir", path)
        os.rmdir(self._real(path))
        return 0

    def unlink(self, path):
        self._fault("unlink", path)
        os.unlink(self._real(path))
        return 0

    def rename(self, old, new):
        return self.rename_with_flags(old, new, 0)

    def rename_with_flags(self, old, new, flags):
        self._fault("rename", old, new)
        if flags:  # RENAME_NOREPLACE / RENAME_EXCHANGE: needs renameat2
            src, dst = os.fsencode(self._real(old)), os.fsencode(self._real(new))
            if _libc.renameat2(_AT_FDCWD, src, _AT_FDCWD, dst, ctypes.c_uint(flags)) != 0:
                raise fuse.FuseOSError(ctypes.get_errno())
        else:
            os.rename(self._real(old), self._real(new))
        with self._lock:  # open handles follow the rename
            for fh, p in self._handles.items():
                if p == old or p.startswith(old.rstrip("/") + "/"):
                    self._handles[fh] = new + p[len(old):]
        return 0

    def link(self, target, source):  # creates `target` as a hard link to `source`
        self._fault("link", source, target)
        os.link(self._real(source), self._real(target))
        return 0

    def symlink(self, target, source):  # creates `target` pointing at the string `source`
        self._fault("symlink", target)
        os.symlink(source, self._real(target))
        return 0

    def chmod(self, path, mode):
        self._fault("chmod", path)
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path, uid, gid):
        self._fault("chown", path)
        os.lchown(self._real(path), uid, gid)
        return 0

    def utimens(self, path, times=None):
        self._fault("utimens", path)
        real = self._real(path)
        if times is None:
            os.utime(real, follow_symlinks=False)
            return 0
        st = os.lstat(real)
        now = time.time_ns()
        atime, mtime = times
        atime = now if atime == _UTIME_NOW else st.st_atime_ns if atime == _UTIME_OMIT else atime
        mtime = now if mtime == _UTIME_NOW else st.st_mtime_ns if mtime == _UTIME_OMIT else mtime
        os.utime(real, ns=(atime, mtime), follow_symlinks=False)
        return 0

    def truncate(self, path, length, fh=None):
        self._fault("truncate", self._path(path, fh))
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._real(path), length)
        return 0

    # ------------------------------------------------------------------ file I/O
    def create(self, path, mode, flags):
        self._fault("create", path)
        return self._remember(os.open(self._real(path), flags | os.O_CREAT, mode), path)

    def open(self, path, flags):
        self._fault("open", path)
        return self._remember(os.open(self._real(path), flags), path)

    def read(self, path, size, offset, fh):
        self._fault("read", self._path(path, fh))
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        self._fault("write", self._path(path, fh), nbytes=len(data))
        return os.pwrite(fh, data, offset)

    def flush(self, path, fh):
        self._fault("flush", self._path(path, fh))
        os.close(os.dup(fh))  # surfaces the backing fs's deferred write errors, like close(2)
        return 0

    def release(self, path, fh):
        try:
            self._fault("release", self._path(path, fh))
        finally:
            self._forget(fh)
            os.close(fh)
        return 0

    def fsync(self, path, datasync, fh):
        self._fault("fsync", self._path(path, fh))
        (os.fdatasync if datasync else os.fsync)(fh)
        return 0

    def fsyncdir(self, path, datasync, fh):
        self._fault("fsyncdir", self._path(path, fh))
        os.fsync(fh)
        return 0


class _FUSE(fuse.FUSE):
    """mfusepy drops the rename(2) flags (RENAME_NOREPLACE...) and truncate's file handle under
    libfuse3; pass them on."""

    def truncate_fuse_3(self, path, length, fip):  # ftruncate / open(O_TRUNC): pass the handle
        return self.operations.truncate(None if path is None else path.decode(self.encoding, self.errors),
                                        length, fip.contents.fh if fip else None)

    def rename_fuse_3(self, old, new, flags):
        return self.operations.rename_with_flags(old.decode(self.encoding, self.errors),
                                                 new.decode(self.encoding, self.errors), flags)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="backing directory")
    ap.add_argument("mountpoint")
    ap.add_argument("--control", required=True, help="JSON rules file (need not exist yet)")
    ap.add_argument("--fired", default=None, help="JSON-lines log of fired faults "
                                                  "(default: fired.jsonl next to --control)")
    ap.add_argument("--foreground", action="store_true", help="do not daemonize")
    ap.add_argument("--allow-other", action="store_true", help="let other users see the mount")
    ap.add_argument("--debug", action="store_true", help="libfuse debug trace")
    a = ap.parse_args(argv)
    log_to_stderr()
    control = os.path.realpath(a.control)
    fired = os.path.realpath(a.fired or os.path.join(os.path.dirname(control), "fired.jsonl"))
    if not os.path.isdir(a.root):
        ap.error(f"root {a.root} is not a directory")
    _log(f"{os.path.realpath(a.root)} -> {os.path.realpath(a.mountpoint)} control={control} fired={fired}")
    ops = FaultFS(a.root, control, fired)
    with ops._lock:
        ops._reload()
    _FUSE(ops, a.mountpoint, foreground=a.foreground, debug=a.debug, nothreads=False,
          allow_other=a.allow_other, fsname="faultfs", subtype="faultfs",
          attr_timeout=0, entry_timeout=0, negative_timeout=0,
          use_ino=True)


if __name__ == "__main__":
    main()
