"""What a training loop and its session hand each other: where ``build`` builds
(:class:`World`), what it returns (:class:`Parts`, whose state items go into the run's
state registry), what a step ended in (:class:`Action`) and how the run ended
(:class:`Summary`). ``llmtrain.api`` exports them."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.state_registry import SchedulerState

_RESERVED = ("rng", "integrity")  # the session's own items in the state registry


@dataclass(frozen=True)
class World:
    """Where ``build`` builds: this process's rank of ``world_size`` (``local_rank`` on
    node ``host``), its device, and the device mesh of ``settings.parallelism`` (1-D
    ``dp_shard`` for FSDP, 2-D ``(dp_replicate, dp_shard)`` for HSDP, each with a last
    ``tp`` dim when ``parallelism.tp`` is above 1) on the process group the session
    formed. ``first``: the process's first build (not a re-formed group's);
    ``timed(part)``: a context manager that counts its block in the start-up timeline."""
    rank: int
    world_size: int
    local_rank: int
    host: str
    device: torch.device
    mesh: DeviceMesh
    first: bool
    timed: Callable[[str], contextlib.AbstractContextManager]


@dataclass
class Parts:
    """What ``build`` returns: the model (any ``nn.Module``, usually FSDP2-sharded over
    ``world.mesh``), its optimizer (any ``torch.optim.Optimizer``), and the other state
    built with them that a failure must not lose, by name: ``state`` is the same on
    every rank (an LR scheduler), ``per_rank`` each rank's own (a data loader's position
    in its share of the data). Each item has ``state_dict()`` and
    ``load_state_dict(state)``; plain values (and bytes in ``per_rank``) only, since they
    are saved as JSON."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    state: Mapping[str, Any] = field(default_factory=dict)
    per_rank: Mapping[str, Any] = field(default_factory=dict)


class Action(enum.Enum):
    """What the last step ended in."""
    GO_ON = "go_on"        # trained; the next step follows
    STOP = "stop"          # the run ends here (its last step, a stop request, a failed GPU)
    RESTORED = "restored"  # the state is an earlier step's (a warm recovery, a rollback)
    RESIZED = "resized"    # the job goes on at another world size: parts were rebuilt


@dataclass
class Summary:
    """How a run ended: its steps and tokens, its time and throughput, its first and last
    reported losses and its peak memory per rank, over every phase of this process's
    run (before and after a shrink or a grow alike)."""
    steps: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    first_loss: float
    final_loss: float
    memory_gb: float
    trained: int = 0  # steps trained by this start (0: it began at the last step)
    stopped: bool = False  # ended early on a stop request (llmtrain stop)
    complete: bool = False  # ended at the run's last step: a later start extends the run


class _Item:
    """A user's state item as the registry holds it: its name and whether it is per rank."""

    def __init__(self, name: str, obj: Any, per_rank: bool):
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"state item {name!r} ({type(obj).__name__}) needs state_dict() "
                            f"and load_state_dict(): wrap it in an object that has them")
        self.name, self.obj, self.per_rank = name, obj, per_rank

    def state_dict(self) -> dict:
        return self.obj.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.obj.load_state_dict(state)


def state_items(parts: Parts) -> list:
    """``parts``' state items as registry items: an LR scheduler also sets the rate it
    restores on the optimizer (a warm restore has no optimizer hyperparameters to load)."""
    items = []
    for per_rank, named in ((False, parts.state), (True, parts.per_rank)):
        for name, obj in named.items():
            if name in _RESERVED:
                raise ValueError(f"state item name {name!r} is reserved: rename it")
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                item = SchedulerState(obj)
                item.name = name
            else:
                item = _Item(name, obj, per_rank)
            items.append(item)
    return items
