"""slow_rank: one rank stopped 2/3 of the time for a while, a straggler. The job must
name it (a ``straggler`` event) and train on."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict


def _throttle(target: dict[str, int], stop: threading.Event) -> None:
    """About 3x slower: the process holding the rank (``target["pid"]``, which the wait
    keeps current: a restart gives the rank a new process) stopped 2/3 of every 150 ms,
    until ``stop``."""
    while not stop.is_set():
        pid = target["pid"]
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.1)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # gone: its rank's next process takes its place
            time.sleep(0.1)
            continue
        time.sleep(0.05)


@fault_kind("slow_rank", keeps_ranks=True)
def slow_rank(job: Job) -> Verdict:
    """Throttles a rank until the job names a straggler; judges the rank it names. The
    throttle follows the rank to its next process when the job restarts meanwhile (it
    once throttled a process a restart had ended, and the straggler the job named 79 s
    later was noise)."""
    rank, info = job.pick_rank()
    v = job.verdict("slow_rank", f"rank {rank} ({info['host']})")
    stop, target = threading.Event(), {"pid": info["pid"]}
    thread = threading.Thread(target=_throttle, args=(target, stop), daemon=True)
    thread.start()

    def named() -> dict | None:
        now = job.ranks().get(rank)
        if now is not None:
            target["pid"] = now["pid"]
        return job.latest("straggler", v.injected_at)
    try:
        seen = job.wait(named, "straggler", 90)
    finally:  # never left stopped, whatever ends the wait
        stop.set()
        thread.join()
        for pid in {info["pid"], target["pid"]}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    v.seen(seen["ts"])
    v.diagnosis = f"rank {seen['straggler_rank']} {seen['slowdown']}x slower"
    v.correct = seen["straggler_rank"] == rank
    v.went_on("straggler event and metric; training goes on")
    return v
