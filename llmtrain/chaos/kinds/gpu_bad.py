"""gpu_bad: a node's scripted GPU reports uncorrectable ECC errors. Its health check must
name the check and the node, the node exit 76 (excluded) and the job go on without it;
then the GPU is replaced, the exclusion lifted, and the node comes back as a spare."""

from __future__ import annotations

import json

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import WENT_ON, Verdict
from llmtrain.reliability.health.exclusion import EXCLUDED_HOSTS, excluded_hosts


def _repair(job: Job, node: str) -> None:
    """The GPU replaced and ``node``'s exclusion lifted."""
    job.set_gpu(node, healthy=True)
    hosts = excluded_hosts(str(job.run))
    hosts.pop(node, None)
    (job.run / EXCLUDED_HOSTS).write_text(json.dumps(hosts))


@fault_kind("gpu_bad")
def gpu_bad(job: Job) -> Verdict:
    """Fails a rank's node's GPU; judges the health finding, the exit and the recovery."""
    _, info = job.pick_rank()
    node = info["host"]
    v = job.verdict("gpu_bad", f"{node} GPU 0")
    job.set_gpu(node, healthy=False)
    seen = job.wait(lambda: [e for e in job.events("health", v.injected_at)
                             if e["severity"] == "fatal"], "fatal health event", 60)[0]
    v.seen(seen["ts"])
    v.diagnosis = f"{seen['check']} on {seen['host']} GPU {seen['gpu']}"
    v.correct = seen["check"] == "ecc_volatile" and seen["host"] == node
    proc = job.cluster.nodes[node]
    job.wait(lambda: proc.poll() is not None, f"{node} to exit", 120)
    v.correct &= proc.returncode == 76
    job.recovered(v, v.injected_at)
    v.action = (f"{node} exited {proc.returncode} (76 = excluded); "
                + WENT_ON.get(v.path, "spare admitted, restart from the last checkpoint"))
    _repair(job, node)
    job.back(v, node)
    return v
