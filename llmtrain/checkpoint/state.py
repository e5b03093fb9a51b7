"""TrainState: the run's state registry as DCP saves and loads it.

Model and optimizer are sharded DTensor state (DCP reshards them to any world size).
The registry's other items are small and go as bytes: those the same on every rank as
one JSON object with the step (``trainer``: the LR schedule, the data sampler's global
position, the integrity window), and each rank's own under ``<name>.<rank>`` (its RNGs).
"""

from __future__ import annotations

import io
import json
import operator
from typing import NamedTuple

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from llmtrain import collector
from llmtrain.checkpoint.in_place import (InPlace, LiveShards, plan_in_place, read_in_place,
                                         read_objects)
from llmtrain.checkpoint.safe_unpickle import PlainObjectsPlanner, stored_object
from llmtrain.checkpoint.shard_read import DamagedCheckpoint, ShardReader
from llmtrain.model import global_offset, unwrapped_name
from llmtrain.state_registry import StateRegistry, local_shard, materialize, state_tensors


class TrainState:
    def __init__(self, registry: StateRegistry, rank: int, world: int = 1):
        self.registry, self.rank, self.world = registry, rank, world
        self._kept: _Kept | None = None  # see _tensor_state
        self._opened: tuple[str, ShardReader] | None = None  # see _reader
        self._mapped: tuple[list, LiveShards | None] | None = None  # see _shards

    @property
    def model(self) -> torch.nn.Module:
        return self.registry.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.registry.optimizer

    def state_dict(self, step: int) -> dict:
        """What DCP saves; the same keys on every rank but the per-rank items'."""
        model_sd, optim_sd = self._tensor_state()
        shared = {"step": step, **self.registry.shared()}
        own = {}
        for name, state in self.registry.own().items():
            own[f"{name}.{self.rank}"] = buffer = io.BytesIO()
            torch.save(state, buffer)
        return {"model": model_sd, "optim": optim_sd,
                "trainer": io.BytesIO(json.dumps(shared).encode()), **own}

    def _tensor_state(self) -> tuple[dict, dict]:
        """``get_state_dict``'s model and optimizer dicts. Their tensors are views of the
        live ones, which training updates in place, so they are kept from one save to
        the next for as long as the same live tensors exist (a planned load or a rebuild
        replaces them), and only the hyperparameters are read again: the walk over every
        module and parameter was most of an async save's blocking time (about 8 of 11 ms
        for about 300 tensors here). Whether they still exist is asked of the optimizer,
        which holds every parameter, and of the modules holding the state dict's buffers,
        not of every module again (0.5 ms of a 2-rank save's call here, now 0.1)."""
        kept = self._kept
        if kept is None or kept.model is not self.model or not _same_objects(
                kept.live, _live_objects(self.optimizer, kept.buffers)):
            self._kept = None
            model_sd, optim_sd = _get_state_dict(self.model, self.optimizer)
            if not _shares_storage([model_sd, optim_sd["state"]], self.model, self.optimizer):
                return model_sd, optim_sd  # copies of the state: they would go stale
            buffers = _state_buffers(self.model)
            kept = self._kept = _Kept(self.model, buffers,
                                      _live_objects(self.optimizer, buffers), model_sd, optim_sd)
        model_sd, optim_sd = kept.model_sd, kept.optim_sd
        groups = [{**saved, **{k: v for k, v in group.items() if k != "params"}}
                  for saved, group in zip(optim_sd["param_groups"], self.optimizer.param_groups,
                                          strict=True)]
        return model_sd, {**optim_sd, "param_groups": groups}

    def fits_in_place(self, url: str, *, checked: bool) -> bool:
        """Whether :meth:`load` reads ``url`` in place (``checked``: checking every item's
        sum as it reads it). ``url``'s files must be verified already."""
        reader = self._reader(url)
        plan = self._in_place(reader, self._objects(reader))
        return plan is not None and (plan.checked or not checked)

    def index_problems(self, url: str) -> list[str]:
        """Why DCP cannot plan a load of ``url`` (empty when it can): its ``.metadata``, read
        here through llmtrain's unpickler of DCP's index, is not one (a pickle that would
        build or call anything else). The load takes it from the same reader, read once."""
        try:
            self._reader(url).read_metadata()
        except DamagedCheckpoint as e:
            return e.problems
        return []

    def has_own_section(self, url: str) -> bool:
        """Whether this rank finds its own items of ``url`` in its section of INDEX2.bin (a
        restart at the saved world size); raises DamagedCheckpoint when that section
        differs from its digest."""
        return self._reader(url).has_own_section()

    def load(self, url: str, *, threads: int = 4,
             check: bool = False) -> tuple[int, list[str], bool]:
        """Loads the checkpoint at ``url`` (already verified, but for what ``check``
        leaves to this load) into the live objects, ``threads`` parallel reads at a time.

        When every saved shard of this rank's state has the place and shape of a live one
        (a restart at the world size it was saved at), the shards are read straight into
        the live parameters and optimizer state with no planning at all; ``check`` (only
        where :meth:`fits_in_place` said so) compares every item with its sum as it is
        read (no object is unpickled before its own sum matched), and raises
        DamagedCheckpoint before any object's state is set. Otherwise (a
        resharding load, a checkpoint in the dcp format or the format before raw shards)
        DCP plans it: each rank alone (``no_dist``: a load needs no agreement between
        ranks, so DCP's exchange of pickled plans is skipped, and the caller agrees on the
        outcome); check its index first (:meth:`index_problems`).

        Returns the step it was saved at, the registered items it lacked (a rank that
        did not exist at save time keeps its seeded RNG; a checkpoint older than an item
        leaves it as built), and whether DCP planned the load.
        """
        with collector.paused():
            return self._load(url, threads, check)

    def _load(self, url: str, threads: int, check: bool) -> tuple[int, list[str], bool]:
        self._kept = None  # a planned load replaces the optimizer's state tensors
        reader = self._reader(url)
        reader.threads, self._opened = threads, None
        objects = self._objects(reader)
        plan = self._in_place(reader, objects)
        if plan is None:
            states = self._states(self._load_planned(reader, objects))
        else:
            # the objects first: a damaged one is found before any tensor is overwritten;
            # nothing is set before every item is in (and, with check, checked)
            values, groups = self._objects_in_place(reader, plan, check)
            states = self._states(values)
            read_in_place(reader, plan, check=check)
            for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
                group.update(saved)
        return states["step"], self.registry.load(states), plan is None

    def _states(self, values: dict[str, bytes]) -> dict:
        """The registry's states from the stored objects' bytes: the shared JSON record
        (with the step), and this rank's own items."""
        states = json.loads(values["trainer"])
        suffix = f".{self.rank}"
        states.update({k.removesuffix(suffix): stored_object(v) for k, v in values.items()
                       if k.endswith(suffix)})
        return states

    def _reader(self, url: str) -> ShardReader:
        """A reader of ``url``, kept from :meth:`fits_in_place` for the :meth:`load` that
        follows it, so that a resume reads the checkpoint's index once, not twice (at
        thousands of ranks it lists every rank's chunk of every tensor)."""
        if self._opened is None or self._opened[0] != url:
            self._opened = (url, ShardReader(url, rank=self.rank, world=self.world))
        return self._opened[1]

    def _objects(self, reader: ShardReader) -> list[str]:
        """The non-tensor items this rank loads: the shared ones, and its own if saved."""
        stored = reader.own_section().rows
        own = [f"{name}.{self.rank}" for name, item in self.registry.items.items()
               if item.per_rank]
        return ["trainer", *(key for key in own if (key, None) in stored)]

    def _in_place(self, reader: ShardReader, objects: list[str]) -> InPlace | None:
        """Where to read the live shards and the items to read with them (``objects``
        and the optimizer's hyperparameters) from, when the checkpoint's model and
        optimizer keys match the live state's one for one; None when not."""
        live = self._shards()
        if live is None:
            return None
        groups = [f"optim.param_groups.{i}.{k}"
                  for i, g in enumerate(self.optimizer.param_groups) for k in g if k != "params"]
        section = reader.own_section()
        saved = {k for k, _ in section.rows
                 if k.startswith(("model.", "optim.")) and not k.endswith(".params")}
        # tensor chunks in columns are matched one for one by plan_in_place; in rows
        # (an index before columns, every rank's items) they are compared by name here
        expected = set(groups) if len(section.file) else {fqn for fqn, _ in live.keys} | set(groups)
        if saved != expected:
            return None
        return plan_in_place(reader, live, [*objects, *groups])

    def _shards(self) -> LiveShards | None:
        """:func:`_live_shards` as :class:`LiveShards`, kept for as long as the optimizer's
        parameters and state are the same tensors over the same local shards (an in-place
        load writes into them; a planned load, a rebuild, or FSDP resetting a parameter's
        shard replaces them), as :meth:`_tensor_state` keeps its dicts: a resume's check
        that its checkpoint fits in place and the load after it map the tensors once, not
        twice, and loads after them keep the layout they found (:func:`plan_in_place`).
        Naming and placing about 300 tensors was a third of a 2-rank load's Python here.
        (The optimizer holds every parameter: the trainer builds it over all of them.)"""
        opt = self.optimizer
        materialize(opt)  # a fresh optimizer's state, to be read into
        live = list(map(local_shard, _live_objects(opt, [])))
        mapped = self._mapped
        if mapped is None or not _same_objects(mapped[0], live):
            tensors = _live_shards(self.model, opt)
            mapped = self._mapped = (live, None if tensors is None else LiveShards(tensors))
        return mapped[1]

    def _objects_in_place(self, reader: ShardReader, plan: InPlace,
                          check: bool) -> tuple[dict[str, bytes], list[dict]]:
        """The objects of an in-place load: {name: bytes} of the registry's, and each
        optimizer param group's saved hyperparameters (DCP pickles every object)."""
        values = {k: stored_object(v) for k, v in read_objects(reader, plan, check=check).items()}
        groups = [{k: values[f"optim.param_groups.{i}.{k}"] for k in group if k != "params"}
                  for i, group in enumerate(self.optimizer.param_groups)]
        return {k: v.getvalue() for k, v in values.items() if not k.startswith("optim.")}, groups

    def _load_planned(self, reader: ShardReader, objects: list[str]) -> dict[str, bytes]:
        """The load DCP plans (see :meth:`load`), ``.metadata`` and the objects decoded by
        llmtrain's unpicklers of DCP's index and of plain values, never by ``pickle.load``
        or ``torch.load(weights_only=False)``. Tensors are read straight into the live
        parameters and optimizer state where the state dict shares their memory
        (``set_state_dict``, which would copy each onto itself, runs only where not)."""
        model_sd, optim_sd = _get_state_dict(self.model, self.optimizer)
        in_place = _shares_storage([model_sd, optim_sd["state"]], self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd, **{k: io.BytesIO() for k in objects}}
        _load_state_dict(state, storage_reader=reader, planner=PlainObjectsPlanner(),
                         no_dist=True)  # dcp.load, no warning
        if in_place:  # only the hyperparameters are left to set
            for group, saved in zip(self.optimizer.param_groups, state["optim"]["param_groups"],
                                    strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        return {k: state[k].getvalue() for k in objects}


class _Kept(NamedTuple):
    """A state dict's model and optimizer dicts kept from one save to the next, with what
    they view (see :meth:`TrainState._tensor_state`)."""
    model: torch.nn.Module
    buffers: list[tuple[torch.nn.Module, str]]  # see _state_buffers
    live: list                                  # _live_objects when they were made
    model_sd: dict
    optim_sd: dict


def _live_objects(optimizer: torch.optim.Optimizer,
                  buffers: list[tuple[torch.nn.Module, str]]) -> list:
    """The optimizer's parameters (the trainer builds it over every one), its state's
    values, and the buffers at ``buffers`` (module, name), in a fixed order. The state is
    iterated, not looked up a parameter at a time (a tensor's ``__hash__`` is Python:
    200 us a load here, against 85)."""
    live = [p for group in optimizer.param_groups for p in group["params"]]
    live += [v for state in optimizer.state.values() for v in state.values()]
    live += [module._buffers.get(name) for module, name in buffers]
    return live


def _state_buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Where the buffers a state dict holds live: (module, name) of each persistent one."""
    return [(module, name) for module in model.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None and name not in module._non_persistent_buffers_set]


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and not any(map(operator.is_not, a, b))


def _live_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """{(checkpoint FQN, global offset of this rank's shard): the shard's live tensor} for
    every parameter and optimizer state tensor, as :meth:`TrainState.state_dict` saves
    them (a fresh optimizer's state created by the caller); None where the optimizer
    holds state that is not a tensor."""
    offsets: dict = {}  # parameters of one shape share their shard's place

    def shard(t: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
        if not isinstance(t, DTensor):
            return (0,) * t.ndim, t.detach()
        key = (tuple(t.shape), t.device_mesh, t.placements)
        if key not in offsets:
            offsets[key] = global_offset(t)
        return offsets[key], local_shard(t)

    out, names = {}, {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            names[p] = fqn = unwrapped_name(name)
            offset, local = shard(p)
            out[(f"model.{fqn}", offset)] = local
        for group in optimizer.param_groups:
            for p in group["params"]:
                for k, v in optimizer.state.get(p, {}).items():
                    if not isinstance(v, torch.Tensor):
                        return None
                    offset, local = shard(v)
                    out[(f"optim.state.{names[p]}.{k}", offset)] = local
    return out


def _get_state_dict(model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``get_state_dict``, a fresh optimizer's state created first as the snapshots' is
    (:func:`materialize`): torch's own creation would leave its step counts at 1."""
    materialize(optimizer)
    return get_state_dict(model, optimizer)


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
        live = {_address(t) for t in [*state_tensors(model, optimizer), *model.buffers()]}
        found = [_address(t) for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
    return bool(found) and None not in found and all(a in live for a in found)
