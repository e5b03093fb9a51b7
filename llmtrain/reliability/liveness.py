"""Whether a rank that stopped beating still runs: a process stopped whole, or one starved.

A rank's watchdog thread beats every heartbeat interval, so a silent rank is either
stopped (SIGSTOP, a tracer, stuck in the kernel with nothing else of it running) or
starved: it runs, but its watchdog thread did not get to (a machine with more work than
cores, a long call that keeps the interpreter's lock). Peers waiting for a stopped rank
wait for ever, and naming it at once is right; a starved one catches up, and evicting it
costs a recovery for nothing. (A rank starved for 3.6 s on a loaded 2-core machine was
named "stopped or frozen", evicted, and its replica's survivor went cold.)

A peer on the same host tells them apart from ``/proc/<pid>/stat``: a process that is not
stopped and has used CPU within the last ``window_s`` runs. Each heartbeat carries what
this needs (:func:`beat_fields`): the host, the pid, the process's start time (a pid
reused by another process is not taken for it) and its CPU time then. A rank on another
host, or a system without ``/proc``, cannot be checked: its silence is judged as before.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

HOST = socket.gethostname()
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_STOPPED = frozenset("tTZX")  # stopped, traced, zombie, dead


@dataclass(frozen=True)
class ProcessClock:
    """One look at a process: its state letter, its CPU seconds (user + system, in clock
    ticks' resolution) and its start time (clock ticks after boot)."""
    state: str
    cpu_s: float
    start: int


def process_clock(pid: int) -> ProcessClock | None:
    """``pid``'s state, CPU time and start time from ``/proc``; None where it has no entry
    (gone, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # (the command name may hold spaces)
    return ProcessClock(fields[0].decode(), (int(fields[11]) + int(fields[12])) * _TICK_S,
                        int(fields[19]))


def beat_fields() -> dict:
    """What a heartbeat carries for a peer on this host to check this process."""
    own = process_clock(os.getpid())
    return {"host": HOST, "pid": os.getpid(),
            **({"start": own.start, "cpu": own.cpu_s} if own is not None else {})}


class Liveness:
    """One observer's judgement of silent ranks on its host (:meth:`running`): it keeps,
    per rank, the CPU time it last saw and when that last grew."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._seen: dict[int, tuple[float, float, float]] = {}  # rank -> (beat wall, cpu_s,
        #                                                            when cpu_s last grew)

    def running(self, rank: int, beat: dict, now: float) -> bool:
        """Whether silent ``rank`` (its last ``beat``) runs: on this host, not stopped, and
        its CPU time grew within ``window_s`` (first seen silent: since its beat, or the
        beat itself is that recent). False where it cannot be told."""
        if beat.get("host") != HOST or "start" not in beat:
            self._seen.pop(rank, None)
            return False
        clock = process_clock(beat["pid"])
        if clock is None or clock.start != beat["start"] or clock.state in _STOPPED:
            return False
        wall, cpu_s, grew = self._seen.get(rank, (None, 0.0, 0.0))
        if wall != beat["wall"]:  # a silence seen for the first time
            grew = now if clock.cpu_s > beat["cpu"] else beat["wall"]
        elif clock.cpu_s > cpu_s:
            grew = now
        self._seen[rank] = (beat["wall"], clock.cpu_s, grew)
        return now - grew <= self.window_s
