"""truncated_shard: a shard of the newest committed checkpoint is cut short (behind the
filesystem's back, as bit rot would be), then every rank is killed so that the restart
must notice and fall back to an older checkpoint."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict
from llmtrain.checkpoint import storage


def _truncate_newest(job: Job) -> tuple[int, Path]:
    """Cuts the largest shard of the next commit in half: its step, and the shard."""
    since = time.time()
    newest = job.wait(lambda: job.latest("checkpoint_committed", since), "a commit",
                      180)["step"]
    shard = max((job.mount.root / Path(storage.step_dir(str(job.mount.mount), newest)).name)
                .glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    job.truncated.add(newest)
    return newest, shard


@fault_kind("truncated_shard")
def truncated_shard(job: Job) -> Verdict:
    """Truncates the newest checkpoint and kills every rank; judges the rejection and
    the fallback."""
    newest, shard = _truncate_newest(job)
    v = job.verdict("truncated_shard", f"step {newest} ({shard.name})")
    for info in job.ranks().values():  # all at once: nobody is left to recover warm
        os.kill(info["pid"], signal.SIGKILL)  # before the next commit makes it not the newest
    seen = job.wait(lambda: job.latest("checkpoint_rejected", v.injected_at),
                    "checkpoint_rejected", 180)
    v.seen(seen["ts"])
    v.diagnosis = f"step {seen['step']} rejected: {seen['problems'][0][:80]}"
    job.recovered(v, v.injected_at)
    loaded = job.latest("checkpoint_loaded", v.injected_at)
    v.correct = seen["step"] == newest and (loaded is None or loaded["step"] < newest)
    v.action = (f"fell back to step {loaded['step']}" if loaded else
                "no older checkpoint: started over")
    return v
