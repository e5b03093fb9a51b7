"""What the session and the recovery ask of the run's checkpoints (:class:`Checkpointing`),
and the answer when they are off (``checkpoint.enable = false``): :class:`NoCheckpoints`,
with which nothing is ever due, saved or resumed, so that the loop has one shape either
way. :func:`llmtrain.checkpoint.manager.checkpoints_for` picks one; the one that saves is
:class:`llmtrain.checkpoint.manager.CheckpointManager`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch.distributed as dist

    from llmtrain.checkpoint.state import TrainState


class Checkpointing(Protocol):
    """The run's checkpoints as the session and the recovery use them, on
    (:class:`CheckpointManager`) or off (:class:`NoCheckpoints`): see
    :func:`checkpoints_for`."""

    def due(self, step: int, *, by_time: bool = False, final: bool = False) -> bool: ...

    def time_due(self, step: int) -> bool: ...

    def adopt_interval(self, seconds: float, advice: dict) -> None: ...

    def bind_groups(self, control_group: dist.ProcessGroup) -> None: ...

    def prepare(self, state: TrainState, step: int) -> None: ...

    def save(self, step: int, state: TrainState, *, final: bool = False,
             checked: bool = False) -> None: ...

    def writing(self) -> bool:
        """A save's write is in flight."""

    def staged(self) -> bool:
        """The save in flight (if any) has its copy of the state: the update may run."""

    def wait_staged(self) -> None: ...

    def wait(self, timeout: float | None = None) -> None: ...

    def leave(self, timeout: float, stuck_s: float) -> None:
        """Waits for the write in flight as a recovery leaves (see CheckpointManager)."""

    def resume(self, state: TrainState) -> int:
        """The state from the newest checkpoint that verifies; its step (0: none)."""

    def close(self, timeout_s: float | None = None) -> None: ...


class NoCheckpoints:
    """``checkpoint.enable = false``: nothing is ever due, saved or resumed."""

    def due(self, step: int, *, by_time: bool = False, final: bool = False) -> bool:
        return False

    def time_due(self, step: int) -> bool:
        return False

    def adopt_interval(self, seconds: float, advice: dict) -> None:
        pass

    def bind_groups(self, control_group) -> None:
        pass

    def prepare(self, state, step: int) -> None:
        pass

    def save(self, step: int, state, *, final: bool = False, checked: bool = False) -> None:
        pass

    def writing(self) -> bool:
        return False

    def staged(self) -> bool:
        return True

    def wait_staged(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> None:
        pass

    def leave(self, timeout: float, stuck_s: float) -> None:
        pass

    def resume(self, state) -> int:
        return 0

    def close(self, timeout_s: float | None = None) -> None:
        pass
