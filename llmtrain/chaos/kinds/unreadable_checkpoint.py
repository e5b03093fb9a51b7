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
    """Makes the oldest committed manifest unreadable; judges retention's answer."""
    since = time.time()
    committed = job.wait(lambda: [c for c in storage.list_checkpoints(str(job.mount.root))
                                  if c.committed][:-1] or None,
                         "two committed checkpoints", 180)
    oldest = committed[0].step
    name = Path(storage.step_dir("", oldest)).name
    v = job.verdict("unreadable_checkpoint", f"step {oldest} (its manifest)")
    job.mount.set_rules([{"ops": ["open"], "path": f"/{name}/{storage.MANIFEST}",
                          "errno": "EIO", "name": "unreadable_checkpoint"}])
    try:
        seen = job.wait(lambda: [e for e in job.events("checkpoint_passed_over", since)
                                 if e["step"] == oldest][:1], "checkpoint_passed_over",
                        180)[0]
        after = job.wait(lambda: job.latest("checkpoint_committed", seen["ts"]),
                         "the next commit", 180)
        time.sleep(1)  # its retention pass
    finally:
        job.mount.clear()
    v.seen(seen["ts"])
    v.diagnosis = f"step {seen['step']} passed over by {seen['by']}: {seen['reason'][:80]}"
    failed = job.events("checkpoint_retention_failed", v.injected_at)
    kept = [c.step for c in storage.list_checkpoints(str(job.mount.root))]
    v.correct = not failed and oldest in kept
    v.went_on(f"left in place; retention went on (next commit at step {after['step']})"
              + (f"; {len(failed)} retention pass(es) failed" if failed else ""))
    return v
