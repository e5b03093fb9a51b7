"""How a fault of the rendezvous store (store_stall, store_restart) is judged: by what it
must not cause, from its injection to the next fault (or the end), judged again at the
end since a launcher may fail a while after."""

from __future__ import annotations

from llmtrain.chaos.job import Job
from llmtrain.chaos.verdict import Verdict, recovery_path

# what a store fault causes may show only once the store answers again (a watchdog reading
# old heartbeats, a hang timeout of 5 s): its verdict waits this long after it
AFTERMATH_S = 10.0
# what a store fault must not cause (while it lasts, and until the next fault or the end):
# a rank fenced for good, a watchdog taking the silence for a hang, a collective failing,
# a restart, a preemption the scheduler never sent
STORE_TROUBLE = ("fenced", "hang", "failure", "collective_error", "attempt_start",
                 "preempted")


def store_trouble(job: Job, v: Verdict) -> tuple[list[str], list[str]]:
    """What store fault ``v`` caused in its window: STORE_TROUBLE events ("event
    (rank r)") and tracebacks."""
    until, since_logs, until_logs = job.window(v)
    events = [f"{e['event']}" + (f" (rank {e['rank']})" if "rank" in e else "")
              for e in job.events(None, v.injected_at)
              if e["event"] in STORE_TROUBLE and e["ts"] < until]
    return events, job.tracebacks(since_logs, until_logs)


def _needless_recovery(job: Job, v: Verdict) -> None:
    """The recovery store fault ``v`` caused in its window, if any: its path and cost
    (the steps from the one it failed at to the restored one)."""
    until = job.window(v)[0]
    rec = [e for e in job.events(None, v.injected_at) if e["ts"] < until
           and e["event"] in ("warm_recovery", "recovery")][:1]
    v.path = recovery_path(rec[0]) if rec else ""
    if rec:
        failed = max((e["step"] for e in job.events("step", v.injected_at)
                      if e["ts"] < rec[0]["ts"]), default=v.at_step)
        loaded = job.latest_before("checkpoint_loaded", v.injected_at, until)
        v.restored = (rec[0]["step"] if v.path != "cold" else
                      loaded["step"] if loaded else 0)
        v.steps_lost = max(0, failed - v.restored)


def judge_store_fault(job: Job, v: Verdict, action: str, ok: bool, hosts: set[str]) -> None:
    """A store fault's verdict: right if ``ok`` (detected, and whatever the kind
    checks) and nothing in its window was trouble (STORE_TROUBLE, a traceback).
    ``hosts``: the nodes that ran ranks before it; those a needless recovery left out
    are started again as spares, as after any recovery.
    Judged now, and again at the end: a launcher may fail a while after (the issue
    that made store_restart a kind: nodes exited 75 half a minute after a restart)."""
    def judge() -> None:
        trouble, tracebacks = store_trouble(job, v)
        _needless_recovery(job, v)
        seen = sorted(set(trouble))
        v.correct = ok and not trouble and not tracebacks
        v.action = action + (f"; then {', '.join(seen)}" if seen else "") + (
            f"; tracebacks: {'; '.join(tracebacks[:3])}" if tracebacks else "")
    judge()
    job.rejudge[job.index(v)] = judge
    if v.path in ("warm", "shrink"):  # a needless recovery: the nodes it left out
        for node in sorted(hosts - job.hosts()):  # come back as spares
            job.end_node(node)
            job.back(v, node)
