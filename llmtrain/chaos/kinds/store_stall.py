"""store_stall: the rendezvous store's process is stopped (SIGSTOP: its connections stay
up, nothing answers) for ``store_stall_s`` (30 s: fifteen fence timeouts, twice torchrun's
keep-alive window), then goes on. Saves meanwhile are refused (the ranks cannot prove they
are members); once it answers, saves commit again and nobody was fenced for good, nor
restarted, and nothing printed a traceback."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.kinds.store_verdict import AFTERMATH_S, judge_store_fault
from llmtrain.chaos.verdict import Verdict


def _stall(job: Job, v: Verdict, stall_s: float) -> dict | None:
    """Stops the store for ``stall_s`` from ``v``'s injection (never leaving it stopped);
    the first refusal the job logged meanwhile, if any."""
    os.kill(job.cluster.store.pid, signal.SIGSTOP)
    seen = None
    try:
        with contextlib.suppress(TimeoutError):  # (then a verdict of "not detected")
            seen = job.wait(lambda: job.latest("fence_unreachable", v.injected_at),
                            "fence_unreachable", stall_s)
        time.sleep(max(0.0, v.injected_at + stall_s - time.time()))
    finally:
        os.kill(job.cluster.store.pid, signal.SIGCONT)
    return seen


@fault_kind("store_stall", keeps_ranks=True)
def store_stall(job: Job) -> Verdict:
    """Stalls the store; judges the refusals, the commit after, and what else it caused."""
    stall_s = job.cfg.store_stall_s
    hosts = job.hosts()
    v = job.verdict("store_stall", f"the rendezvous store, {stall_s:.0f} s")
    seen = _stall(job, v, stall_s)
    resumed = time.time()
    after = job.wait(lambda: job.latest("checkpoint_committed", resumed),
                     "a commit after the stall", 180)
    time.sleep(max(0.0, resumed + AFTERMATH_S - time.time()))
    if seen:
        v.seen(seen["ts"])
        v.at_step = job.latest("step", seen["ts"] - 5)["step"]
        v.diagnosis = f"rank {seen['rank']}: {seen['what']} refused ({seen['error'][:60]})"
    v.recover_s, v.steps_lost = after["ts"] - resumed, 0
    judge_store_fault(job, v, f"writes refused while it lasted; commit at step "
                              f"{after['step']} {after['ts'] - resumed:.1f}s after",
                      bool(seen), hosts)
    return v
