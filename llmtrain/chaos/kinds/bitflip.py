"""bitflip: one rank flips a bit of its replica of the parameters (the chaos job runs
HSDP, each node a replica, so that corruption has a witness). The replicas' check must
see it, the replay name the rank, and the job roll back."""

from __future__ import annotations

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.arming import arm_ahead, struck
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict


@fault_kind("bitflip", keeps_ranks=True)
def bitflip(job: Job) -> Verdict:
    """Arms a bit flip 10 steps ahead; judges the check, the rank named and the rollback."""
    rank, v, fault_id = arm_ahead(job, "bitflip", "bitflip@step", keys="bit=12,")
    seen = job.wait(lambda: job.latest("state_check_failed", v.injected_at),
                    "state_check_failed", 120)
    struck(job, v, fault_id, rank)
    v.seen(seen["ts"])
    named = job.wait(lambda: job.latest("replica_diverged", v.injected_at),
                     "replica_diverged", 180)
    rolled = job.latest("rollback", v.injected_at)
    v.diagnosis = (f"replicas differ at step {seen['step']}; the replay names rank(s) "
                   f"{named['ranks']}")
    v.correct = named["ranks"] == [rank]
    v.action = f"rolled back to step {rolled['to_step']} and replayed"
    v.recover_s = named["ts"] - seen["ts"]
    v.steps_lost = seen["step"] - rolled["to_step"]
    return v
