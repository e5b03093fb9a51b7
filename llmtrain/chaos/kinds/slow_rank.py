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


def _throttle(pid: int, stop: threading.Event) -> None:
    """About 3x slower: ``pid`` stopped 2/3 of every 150 ms, until ``stop``."""
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.1)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@fault_kind("slow_rank", keeps_ranks=True)
def slow_rank(job: Job) -> Verdict:
    """Throttles a rank until the job names a straggler; judges the rank it names."""
    rank, info = job.pick_rank()
    v = job.verdict("slow_rank", f"rank {rank} ({info['host']})")
    stop = threading.Event()
    thread = threading.Thread(target=_throttle, args=(info["pid"], stop), daemon=True)
    thread.start()
    try:
        seen = job.wait(lambda: job.latest("straggler", v.injected_at), "straggler", 90)
    finally:  # never left stopped, whatever ends the wait
        stop.set()
        thread.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(info["pid"], signal.SIGCONT)
    v.seen(seen["ts"])
    v.diagnosis = f"rank {seen['straggler_rank']} {seen['slowdown']}x slower"
    v.correct = seen["straggler_rank"] == rank
    v.went_on("straggler event and metric; training goes on")
    return v
