"""One fault's verdict: what chaos injected, whether and how fast the job saw it, whether
it named the right culprit, what it did about it and what that cost."""

from __future__ import annotations

from dataclasses import dataclass

# what the job did about a lost node, by recovery path (a verdict's action)
WENT_ON = {"warm": "a spare took its place, state from memory",
           "shrink": "the others went on without it, state from memory"}


def recovery_path(rec: dict) -> str:
    """How a recovery event (``warm_recovery`` or ``recovery``) says the job went on:
    "warm" (a spare), "shrink" (in memory, without the lost node) or "cold" (a restart)."""
    if rec["event"] == "recovery":
        return "cold"
    return "shrink" if rec["kind"] == "shrink" else "warm"


@dataclass
class Verdict:
    """A fault's verdict, one row of the chaos table (and of ``verdict.json``)."""
    kind: str
    target: str
    at_step: int
    injected_at: float
    detected: bool = False
    detect_s: float | None = None
    diagnosis: str = ""
    correct: bool = False
    action: str = ""
    recover_s: float | None = None
    steps_lost: int | None = None
    path: str = ""                 # how the job recovered: "warm" (a spare), "shrink" (in
                                   # memory, without the lost node), "cold", "" (no restart)
    restored: int | None = None    # the step it went on from
    returned: str = ""             # no spares: how the repaired node came back ("grow": in
                                   # memory, at a step boundary; "cold": by a restart)
    return_s: float | None = None  # what its return cost the others

    def seen(self, ts: float) -> None:
        """The job noticed the fault at time ``ts``."""
        self.detected, self.detect_s = True, ts - self.injected_at

    def went_on(self, action: str) -> None:
        """The job went on without a recovery (``action``: what it did): nothing lost."""
        self.action = action
        self.recover_s, self.steps_lost = 0.0, 0

    def judge_report(self, report: dict, rank: int) -> None:
        """A watchdog's report (a ``hang`` or ``collective_error`` event): detected when
        the watchdog decided (before the dumps and the report), right if it names
        ``rank`` as the one the others wait for."""
        self.seen(report["ts"] - report.get("reported_after_s", 0)
                  + report.get("detected_after_s", 0))
        self.diagnosis = report.get("verdict") or report["reason"]
        self.correct = rank in report.get("culprits", [])
        self.action = f"flight-recorder report {report['id']}"
