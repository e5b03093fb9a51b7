"""nan: one rank's loss turns NaN for a step (a run-time fault at the trainer's "loss"
fault point: llmtrain's trainer only). The step's update must be skipped on every rank,
the rank named, and training go on."""

from __future__ import annotations

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.arming import arm_ahead, struck
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict


@fault_kind("nan", keeps_ranks=True,
            trainer_only="it makes the loss NaN at the 'loss' fault point, which only "
                         "llmtrain's trainer calls")
def nan(job: Job) -> Verdict:
    """Arms a NaN loss 10 steps ahead; judges the skipped step and the rank named."""
    rank, v, fault_id = arm_ahead(job, "nan", "nan@loss")
    seen = job.wait(lambda: job.latest("step_skipped", v.injected_at), "step_skipped", 120)
    struck(job, v, fault_id, rank)
    v.seen(seen["ts"])
    v.at_step = seen["step"]
    v.diagnosis = (f"step {seen['step']} not applied ({seen['reason']}): non-finite loss "
                   f"on rank(s) {seen['ranks']}")
    v.correct = seen["reason"] == "nonfinite" and seen["ranks"] == [rank]
    v.action = "the step's update skipped on the device; training went on"
    v.recover_s, v.steps_lost = 0.0, 1
    return v
