"""partition: a node's link goes down while its processes live (nodes in network
namespaces only). The others must name its rank, go on without the node, and fence it
out; once the job has re-formed the link comes back, and the node, repaired, becomes the
next spare."""

from __future__ import annotations

import contextlib
import time

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict


@fault_kind("partition", needs_netns=True, takes_node=True)
def partition(job: Job) -> Verdict:
    """Cuts a rank's node off; judges the report, the recovery and the fence."""
    rank, info = job.pick_rank()
    node = info["host"]
    v = job.verdict("partition", f"rank {rank} ({node})")
    job.network.cut(node)
    try:
        seen = job.wait(lambda: job.latest("hang", v.injected_at), "hang report", 120)
        v.judge_report(seen, rank)
        job.recovered(v, v.injected_at)
        job.wait(lambda: node not in job.hosts(), f"a world without {node}", 60)
    finally:
        job.network.heal(node)
    healed = time.time()
    # Back on the network, the node's processes meet a job that re-formed without them
    # (they notice when TCP next resends: seconds later, or more after a long cut):
    # whatever they try to write into it is refused. A few seconds later the node is
    # repaired and becomes the next spare (tests/system/test_partition.py makes the
    # late write happen, every time).
    fenced = []
    with contextlib.suppress(TimeoutError):
        fenced = job.wait(lambda: [e for e in job.events("fenced", healed)
                                   if e.get("host") == node], "fenced", 5)
    job.end_node(node)
    job.back(v, node)
    v.diagnosis = (f"world re-formed without {node}; on its return "
                   + (f"refused: {fenced[0]['what']}" if fenced else "it tried nothing")
                   + "; " + v.diagnosis)
    v.action = f"{v.action}; fenced on its return" if fenced else v.action
    return v
