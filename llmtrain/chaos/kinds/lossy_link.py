"""lossy_link: a node's link drops what does not fit a small queue at 100 Mbit/s (``tc
tbf``; nodes in network namespaces only). The node whose link it is must be named by its
health check; training goes on, slower."""

from __future__ import annotations

import time

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict


@fault_kind("lossy_link", needs_netns=True, keeps_ranks=True)
def lossy_link(job: Job) -> Verdict:
    """Shapes a rank's node's link; judges the node the link warnings name worst."""
    _, info = job.pick_rank()
    node = info["host"]
    v = job.verdict("lossy_link", node)
    job.network.degrade(node, "100mbit")

    def warnings() -> list[dict]:
        return [e for e in job.events("health", v.injected_at)
                if e["check"] == "link" and e["severity"] == "warn"]
    try:
        first = job.wait(warnings, "link warning", 60)[0]
        time.sleep(8)  # more than a link window: a peer's link may be reported too
        reports = warnings()
    finally:
        job.network.restore(node)
    worst = max(reports, key=lambda e: e["value"])
    v.seen(first["ts"])
    v.diagnosis = "; ".join(f"{e['host']} resent {e['value']:.0%}" for e in reports)[:120]
    v.correct = worst["host"] == node
    v.went_on("link health warning (event, metric); training goes on, slower")
    return v
