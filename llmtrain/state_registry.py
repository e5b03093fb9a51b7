"""The one list of what a run carries across a failure.

Every component whose state a restart must bring back registers it here once, under a
name. Checkpoints (:mod:`llmtrain.checkpoint.state`), in-memory snapshots and their
restore (:mod:`llmtrain.recovery.coordinator`) all serialize this one registry, so a
resume from storage and a warm restore from memory restore the same things: adding an
item here adds it to both.

Two kinds of state. The model's parameters and the optimizer's moments are sharded
tensors, large, held by ``model`` and ``optimizer`` (DCP saves and reshards them; a
snapshot copies this rank's shards). Everything else is a small :class:`Stateful` item of
plain values: the LR schedule, the data position, the integrity window, the RNGs. An item
is either the same on every rank (saved once, as JSON) or ``per_rank`` (saved by each rank
for itself, and allowed to hold bytes).
"""

from __future__ import annotations

import random
import struct
from typing import Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor


@runtime_checkable
class Stateful(Protocol):
    """A component's restorable state: plain values (JSON types; bytes when per rank)."""
    name: str
    per_rank: bool

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class StateRegistry:
    """The model, the optimizer and the registered items, in registration order."""

    def __init__(self):
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.items: dict[str, Stateful] = {}

    def bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             *rebuilt: Stateful) -> None:
        """The sharded state, and the items built with it (its LR schedule): at start,
        and again for each new generation of the process group (warm recovery)."""
        self.model, self.optimizer = model, optimizer
        for item in rebuilt:
            self.items.pop(item.name, None)
            self.register(item)

    def register(self, item: Stateful) -> None:
        if not isinstance(item, Stateful):
            raise TypeError(f"{item!r} is no training state item: it needs name, per_rank, "
                            f"state_dict() and load_state_dict()")
        if item.name in self.items or item.name in ("model", "optim", "step", "trainer"):
            raise ValueError(f"a training state item named {item.name!r} is registered "
                             f"already (or the name is reserved)")
        self.items[item.name] = item

    def tensors(self) -> list[torch.Tensor]:
        """This rank's share of every tensor a checkpoint saves: the parameters, then each
        parameter's optimizer state (its moments: two thirds of the state) by key, in
        parameter order, the same on every rank."""
        out = [local_shard(p.detach()) for p in self.model.parameters()]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                out += [local_shard(state[k]) for k in sorted(state)
                        if isinstance(state[k], torch.Tensor)]
        return out

    def shared(self) -> dict:
        """Every item that is the same on all ranks: {name: its state}."""
        return {n: i.state_dict() for n, i in self.items.items() if not i.per_rank}

    def own(self) -> dict:
        """This rank's items: {name: its state}."""
        return {n: i.state_dict() for n, i in self.items.items() if i.per_rank}

    def load(self, states: dict) -> list[str]:
        """Loads every item found in ``states`` ({name: state}); returns the names of
        those it lacked (a checkpoint written before the item existed, or a rank that did
        not exist at save time): they keep the state they were built with."""
        missing = []
        for name, item in self.items.items():
            if name in states:
                item.load_state_dict(states[name])
            else:
                missing.append(name)
        return missing


class SchedulerState:
    """The LR schedule, and the rate it last set: a warm restore has no optimizer
    hyperparameters from storage to take it from."""
    name, per_rank = "scheduler", False

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr


class RngState:
    """This rank's random generators: Python's, the CPU's and its own GPU's only (every
    rank sees all the node's GPUs but draws only on its own; a list of all of them would
    not restore on a node showing fewer). Generator states are bytes, so the item is
    plain values that a load decodes without torch.load; Python's 625 state words too,
    packed, where a tuple of ints took ``torch.save`` a Python call each (0.2 ms of
    every save's blocking time, of 0.06 for the whole item packed)."""
    name, per_rank = "rng", True

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        version, words, gauss = random.getstate()
        state = {"python": (version, struct.pack(f"<{len(words)}I", *words), gauss),
                 "torch": _as_bytes(torch.get_rng_state())}
        if self.device.type == "cuda":
            state["cuda"] = _as_bytes(torch.cuda.get_rng_state(self.device))
        return state

    def load_state_dict(self, state: dict) -> None:
        version, words, gauss = state["python"]  # ints in checkpoints written before
        random.setstate((version, struct.unpack(f"<{len(words) // 4}I", words)
                         if isinstance(words, bytes) else tuple(words), gauss))
        torch.set_rng_state(_as_tensor(state["torch"]))
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(_as_tensor(_own_gpu_rng(state["cuda"], self.device.index)),
                                     self.device)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _as_bytes(generator_state: torch.Tensor) -> bytes:
    return generator_state.numpy().tobytes()


def _as_tensor(saved: bytes | torch.Tensor) -> torch.Tensor:
    """A generator state as torch takes it; checkpoints written before hold tensors."""
    if isinstance(saved, torch.Tensor):
        return saved
    return torch.frombuffer(bytearray(saved), dtype=torch.uint8)


def _own_gpu_rng(saved, index: int):
    """This rank's GPU RNG state as saved: checkpoints written before it was saved alone
    hold a list of every visible GPU's, of which the rank's device ``index`` is its own."""
    return saved[index] if isinstance(saved, list) else saved
