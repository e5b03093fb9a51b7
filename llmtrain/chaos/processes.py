"""Ending the processes a chaos tool started, all of them: a process tree walked and
killed, a server stopped (gently, then not), and the strays found by a marker in their
environment, however far they wandered from the tree that started them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from llmtrain.launch.children import child_pids


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``, children first."""
    children = child_pids(pid)
    return children + [d for c in children for d in descendants(c)]


def kill_tree(pid: int) -> None:
    """SIGKILLs ``pid`` and everything under it. torchrun and torchx start workers in
    sessions of their own, so the tree is walked: killing the group would miss them."""
    for p in descendants(pid) + [pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def stop(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """Ends ``proc``: SIGTERM (and SIGCONT, should it be stopped: a stopped process keeps
    a SIGTERM pending), then SIGKILL if it has not exited within ``grace_s``."""
    if proc is None:
        return
    for end, wait in ((proc.terminate, grace_s), (proc.kill, grace_s)):
        if proc.poll() is None:
            end()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def marked(name: str, value: str) -> list[int]:
    """The processes whose environment holds ``name=value`` (as it was when they started:
    every process a tool started with that marker, and all they started in turn)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_marked(name: str, value: str) -> list[int]:
    """SIGKILLs every process :func:`marked` finds; returns their ids."""
    pids = marked(name, value)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
