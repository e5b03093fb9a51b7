"""desync: one rank calls a different collective (a run-time fault). The watchdog (or
the collective's own error) must name the rank; the job restarts."""

from __future__ import annotations

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.arming import arm_ahead, struck
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict


@fault_kind("desync")
def desync(job: Job) -> Verdict:
    """Arms a desync 10 steps ahead; judges the report and the recovery."""
    rank, v, fault_id = arm_ahead(job, "desync", "desync@step")
    node = job.ranks()[rank]["host"]
    seen = job.wait(lambda: job.latest("hang", v.injected_at)
                    or job.latest("collective_error", v.injected_at), "verdict", 180)
    struck(job, v, fault_id, rank)
    v.judge_report(seen, rank)
    job.recovered(v, v.injected_at, node)
    return v
