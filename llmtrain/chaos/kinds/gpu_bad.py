"""gpu_bad: a rank's scripted GPU reports uncorrectable ECC errors. Its health check must
name the check, the node and the GPU, the node exit 76 (excluded) and the job go on without it;
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


@fault_kind("gpu_bad", takes_node=True)
def gpu_bad(job: Job) -> Verdict:
    """Fails a rank's GPU (its local rank's on its node); judges the health finding, the
    exit and the recovery."""
    _, info = job.pick_rank()
    node, gpu = info["host"], info.get("local_rank", 0)
    v = job.verdict("gpu_bad", f"{node} GPU {gpu}")
    job.set_gpu(node, healthy=False, gpu=gpu)
    seen = job.wait(lambda: [e for e in job.events("health", v.injected_at)
                             if e["severity"] == "fatal"], "fatal health event", 60)[0]
    v.seen(seen["ts"])
    v.diagnosis = f"{seen['check']} on {seen['host']} GPU {seen['gpu']}"
    v.correct = (seen["check"], seen["host"], seen["gpu"]) == ("ecc_volatile", node, gpu)
    proc = job.cluster.nodes[node]
    job.wait(lambda: proc.poll() is not None, f"{node} to exit", 120)
    v.correct &= proc.returncode == 76
    job.recovered(v, v.injected_at)
    v.action = (f"{node} exited {proc.returncode} (76 = excluded); "
                + WENT_ON.get(v.path, "spare admitted, restart from the last checkpoint"))
    _repair(job, node)
    job.back(v, node)
    return v
