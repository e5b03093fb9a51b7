"""Run-time faults (``llmtrain.chaos.faults``) armed through the job's faults file: a rank
reads the file and strikes at the fault point the line names, leaving a marker when it
does, so that a verdict's clock starts when the fault struck, not when it was armed."""

from __future__ import annotations

from pathlib import Path

from llmtrain.chaos.job import Job
from llmtrain.chaos.verdict import Verdict


def arm(job: Job, v: Verdict, fault: str, rank: int, *, step: int | None = None,
        keys: str = "", prefix: str = "") -> str:
    """Arms ``fault`` (ACTION@POINT) at ``rank`` (at ``step``; ``keys``: more ``key=value,``
    settings) for verdict ``v``; returns the fault's id (``prefix``, or the kind, and the
    verdict's number)."""
    fault_id = f"{prefix or v.kind}{job.index(v) + 1}"
    at = "" if step is None else f"step={step},"
    with open(job.faults_file, "a") as f:
        f.write(f"{fault}:rank={rank},{at}{keys}id={fault_id}\n")
    return fault_id


def arm_ahead(job: Job, kind: str, fault: str, keys: str = "") -> tuple[int, Verdict, str]:
    """Arms ``fault`` at a rank 10 steps ahead of the last logged step (step events come
    every 5 steps: safely in the future): the rank, the verdict and the fault's id."""
    rank, info = job.pick_rank()
    at = job.step() + 10
    v = job.verdict(kind, f"rank {rank} ({info['host']})", at)
    return rank, v, arm(job, v, fault, rank, step=at, keys=keys)


def struck(job: Job, v: Verdict, fault_id: str, rank: int) -> None:
    """Starts ``v``'s clock when the armed fault struck: the rank that struck left a
    marker then."""
    marker = Path(f"{job.faults_file}.fired") / f"{fault_id}.{rank}"
    if marker.exists():
        v.injected_at = marker.stat().st_mtime
