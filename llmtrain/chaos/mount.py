"""Mounting the fault-injecting filesystem (``llmtrain.chaos.faultfs``) and FUSE
mounts in general: start it over a backing directory, change its rules while a job writes
through it, and take it down cleanly. Chaos runs put checkpoints on it; the storage tests
use it through their fixtures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MOUNT_TIMEOUT = 15.0


def _unescape(field: str) -> str:  # /proc/self/mounts escapes space, tab, newline, backslash
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))


def fuse_mounts() -> dict[str, str]:
    """{mount point: fs type} of every FUSE mount ("fuse", "fuse.bindfs", "fuse.faultfs", ...)."""
    out = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            _dev, mnt, fstype, *_ = line.split()
            if fstype == "fuse" or fstype.startswith("fuse."):
                out[_unescape(mnt)] = fstype
    return out


def is_mounted(path: os.PathLike | str) -> bool:
    """Whether ``path`` is a FUSE mount point (also true for a dead one: ENOTCONN)."""
    return os.path.realpath(path) in fuse_mounts()


def fuse_problem(*tools: str) -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel/container)"
    for tool in ("fusermount3", *tools):
        if shutil.which(tool) is None:
            return f"{tool} not found: apt-get install fuse3 bindfs (see .ci/run)"
    return None


def wait_mounted(mnt: Path, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while not is_mounted(mnt):
        if proc is not None and proc.poll() is not None:
            text = log.read_text() if log and log.exists() else ""
            raise RuntimeError(f"FUSE process exited with {proc.returncode} before mounting "
                               f"{mnt}:\n{text[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mnt} not mounted after {MOUNT_TIMEOUT}s")
        time.sleep(0.02)


def unmount(mnt: os.PathLike | str, proc: subprocess.Popen | None = None,
            busy_timeout: float = 3.0) -> None:
    """fusermount3 -u, retried while busy (say, a child process still exiting), then a lazy
    unmount; then stop the filesystem process ``proc`` (SIGTERM, then SIGKILL)."""
    mnt = str(mnt)
    deadline = time.monotonic() + busy_timeout
    lazy = False
    while is_mounted(mnt):
        r = subprocess.run(["fusermount3", "-u", mnt], capture_output=True, text=True)
        if r.returncode == 0 or not is_mounted(mnt):
            break
        if time.monotonic() > deadline:
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
            lazy = True
            break
        time.sleep(0.1)
    if proc is not None:
        # after a lazy unmount the process would serve the open files until they close: stop it
        for stop, wait in ((None, 0.2 if lazy else 3.0), (proc.terminate, 2.0), (proc.kill, 5.0)):
            if stop is not None:
                stop()
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        if is_mounted(mnt):  # the process died without unmounting: "transport endpoint not connected"
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)


class BindfsMount:
    """bindfs: a plain passthrough FUSE mount of ``.root`` on ``.mount``."""

    def __init__(self, base: Path):
        self.root = base / "root"      # backing directory
        self.mount = base / "mnt"      # the FUSE mount: do I/O here

    def start(self) -> "BindfsMount":
        for d in (self.root, self.mount):
            d.mkdir(parents=True, exist_ok=True)
        # bindfs daemonizes once the mount is up; --no-allow-other works for non-root users too.
        r = subprocess.run(["bindfs", "--no-allow-other", str(self.root), str(self.mount)],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"bindfs failed (exit {r.returncode}): {r.stderr.strip()}")
        wait_mounted(self.mount)
        return self

    def stop(self) -> None:
        unmount(self.mount)


class FaultMount:
    """A running faultfs mount. See ``llmtrain.chaos.faultfs`` for the rule format."""

    def __init__(self, base: Path):
        self.base = base
        self.root = base / "root"          # backing directory
        self.mount = base / "mnt"          # the FUSE mount: do I/O here
        self.rules_file = base / "rules.json"
        self.fired_file = base / "fired.jsonl"
        self.log_file = base / "faultfs.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "FaultMount":
        for d in (self.root, self.mount):
            d.mkdir(parents=True, exist_ok=True)
        self.set_rules([])
        cmd = [sys.executable, "-m", "llmtrain.chaos.faultfs", str(self.root), str(self.mount),
               "--control", str(self.rules_file), "--fired", str(self.fired_file), "--foreground"]
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        try:
            wait_mounted(self.mount, self.proc, self.log_file)
        except BaseException:  # not mounted in time, or interrupted: no filesystem left
            self.stop()
            raise
        return self

    def set_rules(self, rules: list[dict]) -> None:
        """Replace the rules (atomically); they apply from the filesystem's next operation."""
        tmp = self.rules_file.with_name(f".{self.rules_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(list(rules)))
        os.replace(tmp, self.rules_file)

    def clear(self) -> None:
        """Back to plain passthrough; also ends delays in progress."""
        self.set_rules([])

    def fired(self, op: str | None = None) -> list[dict]:
        """Records of the faults fired since mount (or since reset_fired()), oldest first."""
        try:
            lines = self.fired_file.read_text().splitlines()
        except FileNotFoundError:
            return []
        recs = [json.loads(line) for line in lines if line.strip()]
        return [r for r in recs if op is None or r["op"] == op]

    def reset_fired(self) -> None:
        self.fired_file.unlink(missing_ok=True)

    def wait_fired(self, n: int = 1, timeout: float = 10.0, op: str | None = None) -> list[dict]:
        """Block until at least ``n`` faults (of ``op``) fired; returns them."""
        deadline = time.monotonic() + timeout
        while len(recs := self.fired(op)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(recs)}/{n} faults fired after {timeout}s: {recs}")
            time.sleep(0.02)
        return recs

    def log(self) -> str:
        """The filesystem's stderr: one line per fired fault, rule reloads, tracebacks."""
        return self.log_file.read_text() if self.log_file.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        self.clear()
        unmount(self.mount, self.proc)
        self.proc = None
