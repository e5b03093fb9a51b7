"""hang: one rank is SIGSTOPped; it stops inside a collective, watchdog thread and all.
The others' watchdog must name it; on the warm path its agent kills it once the report
names it, and a spare takes its place."""

from __future__ import annotations

import contextlib
import os
import signal

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict


@fault_kind("hang")
def hang(job: Job) -> Verdict:
    """Stops a rank; judges the watchdog's report and the recovery."""
    rank, info = job.pick_rank()
    v = job.verdict("hang", f"rank {rank} ({info['host']})")
    os.kill(info["pid"], signal.SIGSTOP)
    try:
        seen = job.wait(lambda: job.latest("hang", v.injected_at), "hang report", 120)
    finally:  # a stopped process ignores SIGTERM; on the warm path its agent kills it
        with contextlib.suppress(ProcessLookupError):
            os.kill(info["pid"], signal.SIGKILL)
    v.judge_report(seen, rank)
    job.recovered(v, v.injected_at, info["host"])
    return v
