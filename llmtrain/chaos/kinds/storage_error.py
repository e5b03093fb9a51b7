"""enospc, eio: the checkpoint filesystem fails the next save's shard writes with ENOSPC
/ EIO. The save must fail with that error named, training go on, and the next save
commit."""

from __future__ import annotations

import os

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict


def storage_error(job: Job, kind: str, errno_name: str) -> Verdict:
    """Fails the shard writes with ``errno_name`` until a save fails; judges the error
    the job names and the next commit."""
    v = job.verdict(kind, "checkpoint filesystem")
    job.mount.set_rules([{"ops": ["write", "create", "fsync"], "errno": errno_name,
                          "path": "*.distcp", "name": kind}])
    try:
        seen = job.wait(lambda: job.latest("checkpoint_failed", v.injected_at),
                        "checkpoint_failed", 180)
    finally:
        job.mount.clear()
    v.at_step = seen["step"]
    v.seen(seen["ts"])
    v.diagnosis = seen["error"][:120]
    v.correct = errno_name in seen["error"] or os.strerror(
        {"ENOSPC": 28, "EIO": 5}[errno_name]) in seen["error"]
    after = job.wait(lambda: job.latest("checkpoint_committed", seen["ts"]),
                     "the next commit", 180)
    v.went_on(f"save failed, training went on; next commit at step {after['step']}")
    return v


@fault_kind("enospc", keeps_ranks=True)
def enospc(job: Job) -> Verdict:
    """The checkpoint filesystem is full."""
    return storage_error(job, "enospc", "ENOSPC")


@fault_kind("eio", keeps_ranks=True)
def eio(job: Job) -> Verdict:
    """The checkpoint filesystem fails writes with I/O errors."""
    return storage_error(job, "eio", "EIO")
