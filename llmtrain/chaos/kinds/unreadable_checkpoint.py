"""unreadable_checkpoint: an old committed checkpoint's manifest fails every read (EIO: a
bad sector, an object gone to an archive tier). Retention must pass it over, leave it, and
go on retiring the others; then the storage heals."""

from __future__ import annotations

import time
from pathlib import Path

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict
from llmtrain.checkpoint import storage


@fault_kind("unreadable_checkpoint", keeps_ranks=True)
def unreadable_checkpoint(job: Job) -> Verdict:
    """Makes the oldest committed manifest unreadable; judges retention's answer. The
    oldest is retention's next victim: where retention retires it before the rule is in
    place (its pass had read the manifest already), the next oldest is struck instead."""
    since = time.time()
    v = None
    for _ in range(TRIES):
        committed = job.wait(lambda: [c for c in storage.list_checkpoints(str(job.mount.root))
                                      if c.committed][:-1] or None,
                             "two committed checkpoints", 180)
        oldest = committed[0].step
        name = Path(storage.step_dir("", oldest)).name
        target = f"step {oldest} (its manifest)"
        if v is None:
            v = job.verdict("unreadable_checkpoint", target)
        else:
            v.target, v.at_step, v.injected_at = target, job.step(), time.time()
        job.mount.set_rules([{"ops": ["open"], "path": f"/{name}/{storage.MANIFEST}",
                              "errno": "EIO", "name": "unreadable_checkpoint"}])
        try:
            seen = job.wait(lambda: _answer(job, oldest, since), "checkpoint_passed_over",
                            180)[0]
            if seen["event"] == "checkpoint_passed_over":
                after = job.wait(lambda: job.latest("checkpoint_committed", seen["ts"]),
                                 "the next commit", 180)
                time.sleep(1)  # its retention pass
                break
        finally:
            job.mount.clear()
    else:
        raise TimeoutError(f"chaos: retention retired every checkpoint struck unreadable "
                           f"before it could read its manifest ({TRIES} tries)")
    v.seen(seen["ts"])
    v.diagnosis = f"step {seen['step']} passed over by {seen['by']}: {seen['reason'][:80]}"
    failed = job.events("checkpoint_retention_failed", v.injected_at)
    kept = [c.step for c in storage.list_checkpoints(str(job.mount.root))]
    v.correct = not failed and oldest in kept
    v.went_on(f"left in place; retention went on (next commit at step {after['step']})"
              + (f"; {len(failed)} retention pass(es) failed" if failed else ""))
    return v


TRIES = 3  # strikes at the oldest checkpoint, each of which retention may retire first


def _answer(job: Job, step: int, since: float) -> list[dict]:
    """Retention's word on ``step`` since ``since``: passed over, or removed (its pass had
    read the manifest before the rule was in place)."""
    return [e for e in job.events("checkpoint_passed_over", since) if e["step"] == step][:1] \
        or [e for e in job.events("checkpoint_removed", since)
            if e["step"] == step and e.get("committed")][:1]
