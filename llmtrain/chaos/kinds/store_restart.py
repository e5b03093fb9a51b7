"""store_restart: the rendezvous store's process is killed (SIGKILL) and started again
``STORE_DOWN_S`` later, empty, on the same address and port: the fence's token, the spare
pool, torchrun's rendezvous state and every failure watch's key are gone, and every
connection to it was reset. Detected when a rank finds the fence's token gone and puts its
own back (``fence_restored``); right if a save commits after that, nobody restarts, is
fenced, or takes the reset connections for a preemption, no launcher, agent or worker
prints a traceback (until the next fault, or the end), and the standby launchers are back
in the (new) spare pool."""

from __future__ import annotations

import contextlib
import time

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.kinds.store_verdict import AFTERMATH_S, judge_store_fault
from llmtrain.chaos.verdict import Verdict
from llmtrain.recovery.pool import spares_waiting
from llmtrain.recovery.warm import job_namespace

STORE_DOWN_S = 3.0  # a restarted store is back this long after its process died


def _pool_back(job: Job, v: Verdict) -> bool:
    """Whether a spare is back in the new pool within a minute (or the job ended, which
    released them)."""
    try:
        job.wait(lambda: spares_waiting(job.spares) > 0
                 or job.latest("run_end", v.injected_at), "a spare back in the pool", 60)
    except TimeoutError:
        return False
    return True


@fault_kind("store_restart", keeps_ranks=True)
def store_restart(job: Job) -> Verdict:
    """Restarts the store empty; judges the fence's repair, the commit after, the spare
    pool and what else it caused."""
    hosts = job.hosts()
    # the pool must come back only if a spare was in it (a needless recovery before may
    # have used them all)
    waiting = job.cfg.warm and job.spare_nodes and spares_waiting(job.spares) > 0
    v = job.verdict("store_restart", f"the rendezvous store, down {STORE_DOWN_S:.0f} s")
    job.cluster.restart_store(STORE_DOWN_S)
    # the harness's own connection died with the old store
    job.spares = job_namespace(job.cluster.store_client(), "local", job.cluster.env)
    seen = None
    with contextlib.suppress(TimeoutError):  # (then a verdict of "not detected")
        seen = job.wait(lambda: job.latest("fence_restored", v.injected_at),
                        "fence_restored", 120)
    since = seen["ts"] if seen else time.time()
    after = job.wait(lambda: job.latest("checkpoint_committed", since),
                     "a commit after the restart", 180)
    pool_back = _pool_back(job, v) if waiting else True  # the next fault may need a spare
    time.sleep(max(0.0, v.injected_at + STORE_DOWN_S + AFTERMATH_S - time.time()))
    if seen:
        v.seen(seen["ts"])
        v.at_step = job.latest("step", seen["ts"] - 5)["step"]
        v.diagnosis = (f"rank {seen['rank']} ({seen.get('host', '?')}): the fence's "
                       f"token was gone; put back")
    # from the kill: the store was out STORE_DOWN_S of it
    v.recover_s, v.steps_lost = after["ts"] - v.injected_at, 0
    action = (f"control state restored; commit at step {after['step']} "
              f"{v.recover_s:.1f}s after the kill"
              + ("" if pool_back else "; no spare back in the pool within 60 s"))
    judge_store_fault(job, v, action, bool(seen) and pool_back, hosts)
    return v
