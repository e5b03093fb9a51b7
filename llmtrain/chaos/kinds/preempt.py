"""preempt: a node's launcher gets SIGTERM, as Slurm sends it before taking the node. The
job saves at an agreed step, exits RETRYABLE (75) and restarts cold from that save (no
step lost); the requeue brings the node back as a spare (a waiting spare may have taken
its place in the restart); with no spares, the others go on without it in memory from
that save."""

from __future__ import annotations

import signal

from llmtrain.chaos.job import Job
from llmtrain.chaos.kinds.registry import fault_kind
from llmtrain.chaos.verdict import Verdict


@fault_kind("preempt", takes_node=True)
def preempt(job: Job) -> Verdict:
    """SIGTERMs a rank's node's launcher; judges the agreed save, the exit and the resume."""
    _, info = job.pick_rank()
    node = info["host"]
    v = job.verdict("preempt", node)
    job.cluster.nodes[node].send_signal(signal.SIGTERM)  # Slurm's, to the launcher
    seen = job.wait(lambda: job.latest("preempted", v.injected_at), "preempted", 60)
    v.seen(seen["ts"])
    v.at_step = seen["step"]
    ends = ("checkpoint_committed", "checkpoint_failed")
    saved = job.wait(lambda: [e for e in job.events(None, v.injected_at)
                              if e["event"] in ends and e["step"] == v.at_step][:1],
                     "the preemption's save", 120)[0]
    job.wait(lambda: job.cluster.nodes[node].poll() is not None, f"{node} to exit", 120)
    code = job.cluster.nodes[node].returncode
    # The requeue brings the node back as a spare: the restart's round is short of its
    # place for a few seconds, and a waiting spare may take it first. Brought back as a
    # plain node, it then waited in the rendezvous, and no warm spare was left. With no
    # spares the job restarts without it, which takes it back after its maintenance.
    if job.spare_nodes:
        job.back(v, node)
    job.recovered(v, v.injected_at)
    if not job.spare_nodes:
        job.back(v, node)
    v.diagnosis = (f"signal {seen['signal']} at step {seen['step']}: saved step "
                   f"{saved['step']} ({saved['event']}), {node} exited {code}; resumed "
                   f"from step {v.restored}")
    v.correct = (saved["event"] == "checkpoint_committed" and saved["step"] == v.at_step
                 and v.restored == v.at_step and code == 75)
    v.action = "agreed save, exit 75 (requeue), " + (
        "the others went on without it, state from memory" if v.path == "shrink" else
        "restart from that save")
    return v
