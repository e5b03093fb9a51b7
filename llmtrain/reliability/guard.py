"""The integrity guard: what the loop does with :mod:`llmtrain.reliability.integrity`'s
verdicts. Bad steps become events and, where the policy says so, a rollback to the newest
committed checkpoint (each was checked before it was saved) that skips the bad batches;
a corrupted replica or faulty arithmetic names the rank, whose node is then excluded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.reliability.integrity import Integrity, TrainingDiverged

if TYPE_CHECKING:
    from llmtrain.checkpoint.interface import Checkpointing
    from llmtrain.recovery.interface import Recovery
    from llmtrain.reliability.watchdog import WatchdogLike

# Rollbacks from the same stretch of steps before the fault counts as persistent.
MAX_ROLLBACKS = 3


class IntegrityGuard:
    def __init__(self, integrity: Integrity, *, checkpoints: Checkpointing,
                 recovery: Recovery, control, reporter, watchdog: WatchdogLike, ledger,
                 events):
        self.integrity, self.checkpoints, self.recovery = integrity, checkpoints, recovery
        self.control, self.reporter, self.watchdog, self.ledger = control, reporter, watchdog, ledger
        self.events = events
        self.checked_step = -1  # the last step whose state was checked
        self.rollbacks: list[int] = []  # steps rolled back from, since the run got past them

    def restored(self, step: int) -> int:
        """The state is that of ``step`` now, as it was checked then (a warm restore)."""
        self.checked_step = step
        return step

    def review(self, step: int, grad_norm, state, *, save: bool = False) -> int | None:
        """Reads the verdicts and, when due (always before a save), checks the state;
        rolls back when the policy says so. Returns the step rolled back to, else None."""
        if save and not self.integrity.enabled():
            return None
        bad = self.integrity.read()
        if bad and self.integrity.review(bad, step):
            return self.roll_back(step, f"{bad[0].reason} at step {bad[0].step}", bad[-1].step,
                                  state)
        if not (save or self.integrity.check_due(step)) or self.checked_step == step:
            return None
        self.checked_step = step
        check = self.integrity.check_state(step, state.registry.tensors(), grad_norm)
        if check.diverged:
            self.reporter.line(f"integrity: rank(s) {check.diverged} held a corrupted replica "
                               f"at step {step} (the replay after the rollback says so)")
            if self.integrity.excludes_corrupt():
                self.control.name_corrupt(check.diverged, "its replica of the model diverged "
                                          "from the others'", step)
        if check.ok:
            return None
        what = (f"non-finite parameters on rank(s) {check.nonfinite_ranks}"
                if check.nonfinite_ranks else
                f"replicas differ: rank(s) {check.suspects or check.split}")
        return self.roll_back(step, f"{what} at step {step}", None, state)

    def compare_recompute(self, step: int, own, peer) -> None:
        """This rank's and its neighbour's loss of the neighbour's first micro-batch: a
        rank whose arithmetic is wrong disagrees with both neighbours."""
        named = self.integrity.compare_recompute(step, own, peer)
        if named:
            self.reporter.line(f"integrity: rank(s) {named} computed step {step}'s losses "
                               f"differently from their neighbours (faulty arithmetic)")
        if named and self.integrity.excludes_corrupt():
            self.control.name_corrupt(named, "its arithmetic disagreed with both "
                                      "neighbours'", step)

    def roll_back(self, step: int, reason: str, bad_step: int | None, state) -> int | None:
        """Back to the newest committed checkpoint, skipping the bad step's batches;
        returns its step. Without a checkpoint, a bad step (never applied) is only
        skipped (None); a bad state stops the run."""
        skipped = self.integrity.learn_skips(bad_step) if bad_step else []
        self.rollbacks = [s for s in self.rollbacks if s >= step] + [step]
        if len(self.rollbacks) > MAX_ROLLBACKS:
            raise TrainingDiverged(
                f"{reason}, again after {MAX_ROLLBACKS} rollbacks without getting past "
                f"step {step}: the fault is not transient; check the named ranks' GPUs "
                f"(llmtrain health) and exclude their nodes")
        self.checkpoints.wait()
        self.watchdog.beat(step, "resume", long=True)
        with self.ledger.span("checkpoint_load", "rollback"):
            to = self.checkpoints.resume(state)
        self.events.emit_once("rollback", step=step, to_step=to or None, reason=reason,
                              skip=skipped)
        self.reporter.line(f"integrity: {reason}; " + (
            f"rolled back to the checkpoint of step {to}" if to else
            "no checkpoint to roll back to") + (f", skipping step(s) {skipped}" if skipped else ""))
        if not to and bad_step is None:
            raise TrainingDiverged(f"the training state is bad ({reason}) and there is no "
                                   f"checkpoint to roll back to; restart the run")
        if not to:
            return None
        self.checked_step = -1
        self.recovery.forget_snapshots()  # newer than the state now: never restored
        return to
