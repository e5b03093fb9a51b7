"""kill_in_save: a rank dies inside its checkpoint shard write (a run-time fault). Right
if that save is left uncommitted; the job goes on from the snapshot (warm) or the
previous committed checkpoint."""

from __future__ import annotations

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.arming import arm, struck
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import WENT_ON, Verdict
from llmtrain.checkpoint import storage


@fault_kind("kill_in_save")
def kill_in_save(job: Job) -> Verdict:
    """Arms a kill in a rank's next shard write; judges the save left and the recovery."""
    rank, info = job.pick_rank()
    v = job.verdict("kill_in_save", f"rank {rank} ({info['host']})")
    fault_id = arm(job, v, "kill@checkpoint_write", rank, prefix="save")
    seen = job.wait(lambda: job.latest("failure", v.injected_at), "failure", 180)
    struck(job, v, fault_id, rank)
    v.at_step = seen["step"]
    v.seen(seen["ts"])
    job.recovered(v, v.injected_at, info["host"])
    saved = v.at_step // job.cfg.checkpoint_every * job.cfg.checkpoint_every
    committed = storage.read_manifest(storage.step_dir(str(job.mount.mount), saved))
    v.diagnosis = (f"save of step {saved} left "
                   f"{'committed' if committed is not None else 'uncommitted'}; resumed "
                   f"from {'the snapshot of ' if v.path == 'warm' else ''}step {v.restored}")
    v.correct = committed is None
    v.action = WENT_ON.get(v.path, "restart from the previous committed checkpoint")
    return v
