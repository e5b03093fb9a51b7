"""What the session asks of this rank's recovery (:class:`Recovery`), and the answer when
the warm path is off: :class:`NoWarmRecovery`, with which every failure goes cold (a
restart under torchrun), so that the loop has one shape either way. The warm recovery
(:class:`llmtrain.recovery.coordinator.WarmRecovery`) may end the trainer's loop with
:exc:`Resized`: the job goes on at another world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist

from llmtrain.checkpoint.snapshots import Snapshot
from llmtrain.recovery.warm import ColdPath, Plan


class Resized(Exception):
    """The job goes on at another world size (the survivors without the lost nodes, or
    all with the spares that joined): this process trains on as rank
    ``assignment["rank"]`` of ``assignment["world_size"]``, from the snapshots it
    ``held`` (old rank -> snapshot). Raised out of the trainer's loop to the worker, which
    builds the trainer anew."""

    def __init__(self, assignment: dict, held: dict[int, Snapshot]):
        super().__init__(f"{assignment['kind']} to {assignment['world_size']} ranks")
        self.assignment, self.held = assignment, held


def membership(round_id: str, gen: int) -> str:
    """The fence's name for the job's membership in generation ``gen``."""
    return f"{round_id}/g{gen}"


# How a hang's stuck ranks are made to leave for spares (WarmRecovery.evict): ``(ranks,
# via)`` -> the ranks cut off from the store, with their connection ends.
Evict = Callable[[list[int], dist.Store], dict[int, list[str]]]


class Recovery(Protocol):
    """What the session asks of this rank's recovery, warm
    (:class:`llmtrain.recovery.coordinator.WarmRecovery`) or cold only
    (:class:`NoWarmRecovery`): see :func:`llmtrain.recovery.coordinator.warm_recovery`."""

    def membership(self) -> str:
        """The fence's name for the job's membership this rank joins now."""

    def namespace(self) -> str | None:
        """The store namespace of the watchdog's keys (None: the torchrun attempt's)."""

    def evictor(self) -> Evict | None:
        """How the watchdog has a hang's stuck ranks leave for spares (None: every hang
        goes cold)."""

    def spare_store(self, plan: Plan) -> dist.Store:
        """A spare's (or a resized rank's) way into the running job, its place in
        ``plan``."""

    def join_as_spare(self, plan: Plan) -> int:
        """A spare's (or a resized rank's) state, restored; returns its step."""

    def start(self, step: int, control: dist.ProcessGroup) -> None: ...

    def maybe_snapshot(self, step: int) -> None: ...

    def forget_snapshots(self) -> None: ...

    def group_formed(self) -> None: ...

    def recover(self, error: BaseException, step: int) -> int | None:
        """A failed collective: the restored step, or None (the cold path takes over);
        may raise :class:`Resized`."""

    def leave(self) -> bool:
        """This rank leaves on purpose (its GPU failed): True when the others go on."""

    def leave_early(self) -> None:
        """From another thread (the health monitor's), as this rank's GPU fails: it says
        it is gone now, before its training thread gets to :meth:`leave`."""

    def can_grow(self) -> bool: ...

    def grow(self, step: int) -> None: ...

    def let_go(self, step: int, signalled: bool, group: dist.ProcessGroup) -> None: ...

    def give_up(self) -> None: ...

    def first_step_done(self) -> str | None: ...

    def close(self, timeout_s: float) -> None: ...


class NoWarmRecovery:
    """The warm path off: every failure goes cold (a restart under torchrun)."""

    def __init__(self, round_id: str):
        self.round_id = round_id

    def membership(self) -> str:
        return membership(self.round_id, 0)

    def namespace(self) -> str | None:
        return None  # the watchdog's keys: the torchrun attempt's

    def evictor(self) -> Evict | None:
        return None  # a hang's ranks are not evicted for spares: it goes cold

    def spare_store(self, plan: Plan) -> dist.Store:
        raise ColdPath("a warm spare (or a resized rank) needs the warm path: warm.enable "
                       "and a store outside the workers (llmtrain launch)")

    def join_as_spare(self, plan: Plan) -> int:
        raise ColdPath("a warm spare (or a resized rank) needs the warm path: warm.enable "
                       "and a store outside the workers (llmtrain launch)")

    def start(self, step: int, control: dist.ProcessGroup) -> None:
        pass

    def maybe_snapshot(self, step: int) -> None:
        pass

    def forget_snapshots(self) -> None:
        pass

    def group_formed(self) -> None:
        pass

    def recover(self, error: BaseException, step: int) -> int | None:
        return None

    def leave(self) -> bool:
        return False

    def leave_early(self) -> None:
        pass

    def can_grow(self) -> bool:
        return False

    def grow(self, step: int) -> None:
        pass

    def let_go(self, step: int, signalled: bool, group: dist.ProcessGroup) -> None:
        pass

    def give_up(self) -> None:
        pass

    def first_step_done(self) -> str | None:
        return None

    def close(self, timeout_s: float) -> None:
        pass
