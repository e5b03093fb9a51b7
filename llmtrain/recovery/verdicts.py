"""What a supervisor of workers learns when one dies: whether the warm path replaced its
rank, or the job goes cold."""

from __future__ import annotations

import time

from llmtrain.distributed.signed_store import SignedStore
from llmtrain.recovery.roll_call import mark_holder_gone

# Survivors of a dead peer enter the agreement at their next collective, which fails as
# soon as the peer's connections close: far sooner than this on any job.
_NOBODY_AGREES_S = 5.0


def agreements(store: SignedStore) -> tuple[int, int]:
    """How many agreements survivors have entered and left, job-wide. An agent compares
    them with their values when it started its workers: more entered than left since is
    someone agreeing now (a warm recovery that ended earlier does not count)."""
    return store.add("agreeing", 0), store.add("agreed", 0)


class Verdicts:
    """What a supervisor of workers (an agent, a standby launcher whose spare holds a
    rank) waits for when one dies: whether the warm path replaced its rank (the job goes
    on without it), or the job goes cold (the supervisor restarts it, or joins the
    restart). Counts from when the workers started, so an earlier recovery's verdict
    does not count."""

    def __init__(self, store: SignedStore, holders: list[str], budget_s: float):
        self.store, self.budget_s = store, budget_s
        self._seen = {h: store.add(f"replaced/{h}", 0) for h in holders}
        self._cold = store.add("cold", 0)
        self._agreements = agreements(store)

    def replaced(self, holder: str) -> bool:
        """Waits (up to the warm budget) for the verdict on ``holder``'s rank; says first
        that it is gone, so that the survivors need not wait for its report. False at
        once when no survivor has begun to agree within a few seconds (every rank died):
        nobody is left to recover warm."""
        mark_holder_gone(self.store, holder)
        start = time.monotonic()
        while time.monotonic() < start + self.budget_s:
            if self.store.add(f"replaced/{holder}", 0) > self._seen[holder]:
                return True
            if self.store.add("cold", 0) > self._cold:
                return False
            if time.monotonic() > start + min(_NOBODY_AGREES_S, self.budget_s):
                entered, left = agreements(self.store)
                if entered - self._agreements[0] == left - self._agreements[1]:
                    return False  # nobody survived to agree
            time.sleep(0.1)
        return False
