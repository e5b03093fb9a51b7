"""node_loss: a whole node (launcher, agent, workers) dies; a spare takes over (or, with
none, the others go on without it). Right if the world re-forms without it, at full size
(one short without spares); the node, repaired, comes back as a spare."""

from __future__ import annotations

import contextlib

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import WENT_ON, Verdict


@fault_kind("node_loss", takes_node=True)
def node_loss(job: Job) -> Verdict:
    """Kills a rank's node whole; judges the world re-formed without it."""
    _, info = job.pick_rank()
    node = info["host"]
    v = job.verdict("node_loss", node)
    job.cluster.kill(node)
    seen = job.wait(lambda: job.latest("failure", v.injected_at), "failure", 120)
    v.seen(seen["ts"])
    job.recovered(v, v.injected_at)
    # at full size with spares; without, one node's ranks (a data-parallel replica) short
    size = job.cfg.world_size - job.cfg.tp * (not job.spare_nodes)
    # each rank's startup event follows its first step, and the ranks of the new world
    # log theirs at their own pace: the verdict waits for all of them (not seen in time:
    # judged below)
    with contextlib.suppress(TimeoutError):
        job.wait(lambda: node not in job.hosts() and len(job.ranks()) == size,
                 f"a world of {size} ranks without {node}", 60)
    hosts, ranks = job.hosts(), len(job.ranks())
    v.diagnosis = f"world re-formed on {sorted(hosts)} with {ranks} rank(s)"
    v.correct = node not in hosts and ranks == size
    v.action = WENT_ON.get(v.path, "restart from the last checkpoint")
    job.back(v, node)  # repaired
    return v
