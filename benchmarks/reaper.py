"""Every process a benchmark started ends with it, whichever way it ends.

``with reaping(): main()`` around a benchmark's work: the benchmark's process adopts its
orphans (a child subreaper: a rank whose torchrun agent died, a worker that left its
session, comes back to it rather than to init), SIGTERM unwinds it as Ctrl-C does (its
``finally`` blocks run: mounts come down, clusters close), and on the way out, normal or
not, every process still below it is continued (SIGCONT, for a rank a fault stopped) and
killed (SIGKILL), then reaped. torchrun starts its workers in sessions of their own, so
killing a process group misses them; the process tree does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def processes_below(pid: int) -> list[int]:
    """The live (not zombie) processes below ``pid``, parents before their children."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]  # the name may hold ")"
        if state != "Z" and not _tracker(entry):
            children[int(ppid)].append(int(entry))
    found, queue = [], list(children[pid])
    while queue:
        p = queue.pop(0)
        found.append(p)
        queue += children[p]
    return found


def _tracker(pid: str) -> bool:
    """multiprocessing's resource tracker: it ends by itself once the benchmark's process
    is gone, after removing what was left in /dev/shm, so it is left to do that."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def end_processes_below(pid: int, rounds: int = 50) -> None:
    """SIGCONTs and SIGKILLs every process below ``pid``, again until none is left (one
    may have started another meanwhile), and reaps those that are this process's."""
    for _ in range(rounds):
        below = processes_below(pid)
        if not below:
            break
        for p in below:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, sig)
        time.sleep(0.05)
        _reap()
    _reap()


def end_tree(proc: subprocess.Popen) -> None:
    """Ends ``proc`` and every process below it, and waits for it. (Once ``proc`` has
    ended, what it left came back to this process, which ends it on its way out.)"""
    if proc.poll() is None:  # not reaped: its pid is still its own
        end_processes_below(proc.pid)
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
    proc.wait()


def _reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


@contextlib.contextmanager
def reaping() -> Iterator[None]:
    """Around a benchmark's work, in its main thread (see the module's docstring)."""
    me = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")

    def terminated(signum: int, frame) -> None:
        if os.getpid() != me:  # a forked child: SIGTERM's usual end
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        interrupts = {sig: signal.signal(sig, signal.SIG_IGN)  # the clean-up runs to its end
                      for sig in (signal.SIGINT, signal.SIGTERM)}
        end_processes_below(me)
        signal.signal(signal.SIGINT, interrupts[signal.SIGINT])
        signal.signal(signal.SIGTERM, previous)
