"""kill_rank: one rank is SIGKILLed mid-step. Right only if the job names the rank that
died (the one that went silent); a spare takes its place warm, or the job restarts."""

from __future__ import annotations

import os
import signal

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import WENT_ON, Verdict


@fault_kind("kill_rank")
def kill_rank(job: Job) -> Verdict:
    """SIGKILLs a rank; judges the failure seen, the rank named and the recovery."""
    rank, info = job.pick_rank()
    v = job.verdict("kill_rank", f"rank {rank} ({info['host']})")
    os.kill(info["pid"], signal.SIGKILL)
    seen = job.wait(lambda: job.latest("failure", v.injected_at), "failure", 120)
    v.seen(seen["ts"])
    v.diagnosis = f"rank {seen['rank']}'s collective failed: {seen['error'][:80]}"
    rec = job.recovered(v, v.injected_at, info["host"])
    v.action = WENT_ON.get(v.path, "restart from the last checkpoint")
    # right only if the job named the dead rank: the one that went silent
    v.correct = job.lost_ranks(rec) == [rank]
    v.diagnosis = f"rank(s) {job.lost_ranks(rec)} died silently; " + v.diagnosis
    return v
