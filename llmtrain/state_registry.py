"""The one list of what a run carries across a failure.

Every component whose state a restart must bring back registers it here once, under a
name. Checkpoints (:mod:`llmtrain.checkpoint.state`), in-memory snapshots and their
restore (:mod:`llmtrain.recovery.registry_snapshots`) all serialize this one registry, so a
resume from storage and a warm restore from memory restore the same things: adding an
item here adds it to both.

Two kinds of state. The model's parameters and the optimizer's state (any optimizer's:
moments, momentum, step counts) are sharded tensors, large, held by ``model`` and
``optimizer``, listed once, by :func:`state_entries` (DCP saves and reshards them; a
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

    def entries(self) -> list[torch.Tensor]:
        """Every tensor a failure must not lose, as the model and optimizer hold them
        (:func:`state_entries`): what a snapshot copies and restores, a reshard moves, and
        the check before a save fingerprints."""
        return state_entries(self.model, self.optimizer)

    def tensors(self) -> list[torch.Tensor]:
        """This rank's share of :meth:`entries` (:func:`state_tensors`)."""
        return state_tensors(self.model, self.optimizer)

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


def state_entries(model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The training state's tensors, the one list of them: the parameters (DTensors where
    sharded), then each parameter's optimizer state tensors by key (AdamW's: exp_avg,
    exp_avg_sq, step; SGD's momentum_buffer; Adafactor's col_var, row_var, step or
    variance), in parameter order, the same on every rank and every rebuild. State that
    is no tensor (a None momentum buffer) is left out. An optimizer that has not stepped
    yet has its state created first (:func:`materialize`), to be restored or read into:
    a snapshot, a reshard and a load need the tensors to exist."""
    params, states = _params_and_states(model, optimizer)
    return [p.detach() for p in params] + states


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  extra: list[torch.Tensor] = ()) -> list[torch.Tensor]:
    """This rank's share of the training state (:func:`state_entries`' local shards:
    what a snapshot's buffer holds, in order), then ``extra``. Each parameter's shard is
    detached as a plain tensor: a DTensor's own ``detach`` dispatches through DTensor's
    sharding propagation, which costs a snapshot more than its copy."""
    params, states = _params_and_states(model, optimizer)
    return ([local_shard(p).detach() for p in params] + [local_shard(t) for t in states]
            + list(extra))


def _params_and_states(model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer) -> tuple[list, list]:
    materialize(optimizer)
    states = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            states += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return list(model.parameters()), states


def materialize(optimizer: torch.optim.Optimizer) -> None:
    """Creates the state of every parameter ``optimizer`` has not stepped yet (a freshly
    built one's: all of them) as the optimizer itself creates it, whatever the optimizer:
    one step of those parameters alone, with zero gradients, learning rate and weight
    decay 0, after which their values are put back bit for bit and each ``step`` count
    set to 0 again (an optimizer may move them even at lr 0). Parameters with state, and
    those that take no gradient, are left alone; the gradients and hyperparameters are
    put back.

    torch's ``_init_optim_state`` (what ``get_state_dict`` calls) is the same step, but
    for the whole optimizer only, and it leaves state that training would go on from
    wrongly: every step count at 1 (Adam's bias correction then runs a step ahead), and
    with weight decay that adds to the gradient (Adam's, SGD's) moments of ``wd * p``;
    and it creates nothing where any parameter has a gradient. Here the state is the
    optimizer's own first: zeros for Adam's, AdamW's and Adafactor's moments and SGD's
    momentum, Adagrad's initial sum; so training on from it is training from scratch, bit
    for bit (tests/unit/test_any_optimizer.py; RAdam, Adamax, RMSprop and Adadelta too).
    An optimizer whose state after one zero step is not its initial one (NAdam's
    mu_product, ASGD's eta, Rprop's step sizes; SGD with dampening, whose first step takes
    a momentum buffer that exists for a later one's) gets tensors of the right layout to
    be restored or loaded into, which is what they are made for. A
    parameter the optimizer keeps no state for (SGD without momentum) is recorded with
    an empty one, so that it is not stepped again. The step reads neither ``found_inf``
    nor ``grad_scale``: a verdict left on the optimizer would leave fused SGD's momentum
    uninitialized."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [p for p in params if p.requires_grad and p not in optimizer.state]
    if not missing:
        return
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        _adam_first_state(optimizer, set(missing))
        return
    grads = [p.grad for p in params]
    with torch.no_grad():
        values = [p.detach().clone() for p in missing]
    hyper = [(g, {k: g[k] for k in ("lr", "weight_decay") if k in g})
             for g in optimizer.param_groups]
    verdicts = {a: optimizer.__dict__.pop(a) for a in ("found_inf", "grad_scale")
                if a in optimizer.__dict__}
    try:
        for p in params:
            p.grad = None
        for p in missing:
            p.grad = torch.zeros_like(p)
        for group, saved in hyper:
            group.update({k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0
                          for k, v in saved.items()})
        optimizer.step()
        for p in missing:
            state = optimizer.state[p]  # created empty where the optimizer keeps none
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                state["step"] = type(step)(0)
    except BaseException:
        for p in missing:  # half made: made again by the next call, if it can be
            optimizer.state.pop(p, None)
        raise
    finally:
        for group, saved in hyper:
            group.update(saved)
        optimizer.__dict__.update(verdicts)
        for p, grad in zip(params, grads):
            p.grad = grad
        with torch.no_grad():
            for p, value in zip(missing, values):
                p.detach().copy_(value)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, the local tensor itself; a plain tensor as it is.
    Not ``to_local()``: with grad mode on, that wraps the shard anew at each call, in an
    autograd view, so that neither identity (what staging and the in-place load key
    their caches on) nor the cost of a plain attribute read would hold."""
    return t._local_tensor if isinstance(t, DTensor) else t


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


def _adam_first_state(optimizer: torch.optim.Adam, missing: set[torch.Tensor]) -> None:
    """Adam's and AdamW's first state of the ``missing`` parameters, made as their
    ``_init_group`` makes it (torch/optim/adam.py), without a step: the zero step cost
    every warm restore a step over the whole shard and a copy of every parameter (0.02 s
    of a 0.23 s recovery here, and more with a larger model)."""
    from torch.optim.optimizer import _get_scalar_dtype
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in missing:
                continue
            state = optimizer.state[p]
            state["step"] = (
                torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]),
                            device=p.device)
                if group["capturable"] or group["fused"]
                else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
