"""TrainState: everything a resumed run needs to continue exactly where it stopped.

Model and optimizer are sharded DTensor state (DCP reshards them to any world size).
The rest is small and goes as bytes: the step, the LR schedule, the data sampler's
position (global, so it means the same at any world size) and, per rank, every RNG.
"""

from __future__ import annotations

import io
import json
import random

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from llmtrain.checkpoint.shards import ShardReader
from llmtrain.checkpoint.snapshots import state_tensors


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainState:
    def __init__(self, model, optimizer, scheduler, data, rank: int):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.data, self.rank = data, rank

    def _trainer_bytes(self, step: int) -> io.BytesIO:
        blob = {"step": step, "scheduler": self.scheduler.state_dict(),
                "data": self.data.state_dict()}
        return io.BytesIO(json.dumps(blob).encode())

    def state_dict(self, step: int) -> dict:
        """What DCP saves; the same keys on every rank but the RNG, which is per rank."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        rng = io.BytesIO()
        torch.save(_rng_state(), rng)
        return {"model": model_sd, "optim": optim_sd, "trainer": self._trainer_bytes(step),
                f"rng.{self.rank}": rng}

    def load(self, url: str, *, threads: int = 4) -> tuple[int, bool]:
        """Loads the checkpoint at ``url`` (already verified) into the live objects,
        ``threads`` parallel reads at a time.

        Each rank plans and reads its share alone (DCP's ``no_dist``): a load needs no
        agreement between ranks, so DCP's exchange of pickled plans is skipped, and the
        caller agrees on the outcome. Tensors are read straight into the live parameters and
        optimizer state, which the state dict shares (``set_state_dict``, which would copy
        each onto itself, runs only where it does not).

        Returns the step it was saved at, and whether this rank's RNG state was in it
        (a rank that did not exist at save time keeps its seeded RNG).
        """
        reader = ShardReader(url, threads=threads)
        saved_keys = reader.read_metadata().state_dict_metadata
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        in_place = _shares_storage([model_sd, optim_sd["state"]], self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd, "trainer": io.BytesIO()}
        rng_key = f"rng.{self.rank}"
        if rng_key in saved_keys:
            state[rng_key] = io.BytesIO()
        _load_state_dict(state, storage_reader=reader, no_dist=True)  # dcp.load, no warning
        if in_place:  # only the hyperparameters are left to set
            for group, saved in zip(self.optimizer.param_groups, state["optim"]["param_groups"],
                                    strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        trainer = json.loads(state["trainer"].getvalue())
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.data.load_state_dict(trainer["data"])
        if rng_key in state:
            state[rng_key].seek(0)
            _set_rng_state(torch.load(state[rng_key], weights_only=True))
        return trainer["step"], rng_key in state


def _address(t: torch.Tensor) -> int | None:
    """The address of the memory behind ``t`` (a DTensor's local shard); None where it
    has none to compare (a tensor subclass without a storage of its own)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _shares_storage(state, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """True when every tensor in ``state`` is backed by the memory of a live parameter,
    buffer or optimizer state tensor: then loading into ``state`` loads into them."""
    with torch.no_grad():  # DTensor.to_local is then the shard itself, not an autograd view
        live = {_address(t) for t in [*state_tensors(model, optimizer, []), *model.buffers()]}
        found = [_address(t) for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
    return bool(found) and None not in found and all(a in live for a in found)
