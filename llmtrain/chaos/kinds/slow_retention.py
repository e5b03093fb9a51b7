"""slow_retention: every manifest read takes 1.5 s (an object store at scale): rank 0's
write ends seconds after the others', after its retention pass, and saves fall due
meanwhile. With ``if_busy = skip`` every rank must skip them together (one skipping alone
deadlocks the job), and training must not stall."""

from __future__ import annotations

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict
from llmtrain.checkpoint import storage


@fault_kind("slow_retention", keeps_ranks=True)
def slow_retention(job: Job) -> Verdict:
    """Slows every manifest read until a save is skipped; judges that nothing else broke."""
    v = job.verdict("slow_retention", "checkpoint manifests (reads 1.5 s slower)")
    job.mount.set_rules([{"ops": ["open"], "path": f"/*/{storage.MANIFEST}",
                          "delay": 1.5, "name": "slow_retention"}])
    try:
        seen = job.wait(lambda: [e for e in job.events("checkpoint_skipped", v.injected_at)
                                 if e["reason"].startswith("previous still writing")][:1],
                        "a save skipped while the previous one still writes", 180)[0]
    finally:
        job.mount.clear()
    after = job.wait(lambda: job.latest("checkpoint_committed", seen["ts"]),
                     "the next commit", 180)
    v.at_step = seen["step"]
    v.seen(seen["ts"])
    v.diagnosis = f"save of step {seen['step']} skipped by all ranks: {seen['reason']}"
    trouble = [e["event"] for e in job.events(None, v.injected_at)
               if e["event"] in ("hang", "failure", "collective_error")]
    v.correct = not trouble
    v.went_on(f"skipped, training went on; next commit at step {after['step']}"
              + (f"; then {', '.join(trouble)}" if trouble else ""))
    return v
