"""Any torch optimizer's state is the run's state: SGD's momentum, Adam's and AdamW's
moments, Adafactor's factored second moment are created as the optimizer creates them
(the registry's one list, :func:`llmtrain.state_registry.state_entries`), snapshotted,
restored into a freshly built optimizer and checkpointed bit for bit; and a step the
integrity guard judges bad is skipped by any of them (:func:`optimizer_step`)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from llmtrain.checkpoint.snapshots import Schedule, Snapshots
from llmtrain.reliability.integrity import optimizer_step
from llmtrain.state_registry import StateRegistry, materialize

OPTIMIZERS = {
    # weight decay that adds to the gradient: a zero step with it would fill the moments
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd_fused_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
}


def _built(kind: str, seed: int, mesh=None):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    if mesh is not None:
        fully_shard(model, mesh=mesh)
    return model, OPTIMIZERS[kind](model.parameters())


def _backward(model, generator: torch.Generator) -> None:
    model(torch.randn(4, 8, generator=generator)).square().mean().backward()


def _train(model, optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _backward(model, generator)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _state(model, optimizer) -> dict:
    """Every parameter and every optimizer state value, copied, by position and key."""
    with torch.no_grad():
        out = {f"param.{i}": _local(p).detach().clone() for i, p in enumerate(model.parameters())}
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            for k, v in optimizer.state.get(p, {}).items():
                out[f"state.{i}.{k}"] = _local(v).clone() if isinstance(v, torch.Tensor) else v
    return out


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))
        if isinstance(x, torch.Tensor) else x == y for x, y in zip(a.values(), b.values()))


def _registry(model, optimizer) -> StateRegistry:
    registry = StateRegistry()
    registry.bind(model, optimizer)
    return registry


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam", "adafactor", "adamw_fused"])
def test_the_created_state_is_the_optimizers_own_first_one(kind):
    """Created before the first step (a restore's target, a load's), the state is what the
    optimizer makes itself: training on from it is training from scratch, bit for bit
    (torch's ``_init_optim_state`` leaves the step counts at 1, and with Adam's or SGD's
    weight decay, moments of ``wd * p``). The parameters, gradients and hyperparameters
    are left as they were."""
    model, optimizer = _built(kind, seed=0)
    before = _state(model, optimizer)
    grad = model[0].weight.grad = torch.ones_like(model[0].weight)
    lr = optimizer.param_groups[0]["lr"]
    materialize(optimizer)
    assert model[0].weight.grad is grad and optimizer.param_groups[0]["lr"] == lr
    model[0].weight.grad = None
    created = _state(model, optimizer)
    assert _bitwise({k: v for k, v in created.items() if k.startswith("param.")}, before)
    assert len(created) > len(before)  # every parameter has its state now
    assert all(torch.equal(v, torch.zeros_like(v)) for k, v in created.items()
               if k.startswith("state.") and k.endswith(".step"))
    _train(model, optimizer, 3, seed=1)
    scratch_model, scratch_optimizer = _built(kind, seed=0)
    _train(scratch_model, scratch_optimizer, 3, seed=1)
    assert _bitwise(_state(model, optimizer), _state(scratch_model, scratch_optimizer))


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam", "adafactor", "adamw_fused"])
def test_a_snapshot_restores_into_a_fresh_optimizer_and_training_goes_on_alike(kind):
    model, optimizer = _built(kind, seed=0)
    _train(model, optimizer, 3, seed=1)
    snaps = Snapshots(Schedule(1), 0, buddy=None, ward=None, events=None)
    assert snaps.take(3, _registry(model, optimizer).tensors(), {"marker": 3})
    snap = snaps.own.at(3)
    snap.verify()
    fresh_model, fresh_optimizer = _built(kind, seed=99)  # other values: all overwritten
    assert snap.restore_into(_registry(fresh_model, fresh_optimizer).tensors())["marker"] == 3
    assert _bitwise(_state(fresh_model, fresh_optimizer), _state(model, optimizer))
    _train(model, optimizer, 2, seed=2)
    _train(fresh_model, fresh_optimizer, 2, seed=2)
    assert _bitwise(_state(fresh_model, fresh_optimizer), _state(model, optimizer))


def test_the_list_leaves_out_state_that_is_no_tensor_and_creates_state_once():
    """SGD without momentum keeps no state: the list is the parameters, and its state is
    created (empty) once, not with a step at every call; a None momentum buffer is left
    out."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    registry = _registry(model, optimizer)
    assert [t.shape for t in registry.tensors()] == [(3, 4), (3,)]
    assert registry.tensors() and len(steps) == 1
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    registry = _registry(model, momentum)
    assert len(registry.entries()) == 4
    momentum.state[model.bias]["momentum_buffer"] = None
    assert [t.shape for t in registry.entries()] == [(3, 4), (3,), (3, 4)]


@pytest.fixture
def mesh(one_rank_mesh):
    return one_rank_mesh


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam"])
def test_a_checkpoint_of_any_optimizer_loads_into_a_fresh_one_in_place(kind, mesh, tmp_path):
    """(Adafactor cannot step an FSDP2 model in torch 2.13: its in-place ``pow_`` on a
    DTensor norm fails.)"""
    from llmtrain.checkpoint import storage
    from llmtrain.checkpoint.manager import CheckpointManager
    from llmtrain.checkpoint.state import TrainState
    from llmtrain.config import CheckpointConfig
    from llmtrain.events import EventLog

    model, optimizer = _built(kind, seed=0, mesh=mesh)
    _train(model, optimizer, 2, seed=1)
    manager = CheckpointManager(CheckpointConfig(mode="sync"), str(tmp_path / "ckpt"),
                                manifest_base={}, events=EventLog(str(tmp_path / "run"), 0),
                                device=torch.device("cpu"), control_group=dist.group.WORLD)
    manager.save(2, TrainState(_registry(model, optimizer), 0))
    fresh_model, fresh_optimizer = _built(kind, seed=99, mesh=mesh)
    state = TrainState(_registry(fresh_model, fresh_optimizer), 0)
    url = storage.step_dir(str(tmp_path / "ckpt"), 2)
    assert state.load(url) == (2, [], False)  # in place into the created state
    assert _bitwise(_state(fresh_model, fresh_optimizer), _state(model, optimizer))
    _train(model, optimizer, 2, seed=2)
    _train(fresh_model, fresh_optimizer, 2, seed=2)
    assert _bitwise(_state(fresh_model, fresh_optimizer), _state(model, optimizer))


def _stepped(kind: str, verdicts: list[float]):
    """A model and optimizer after a step per verdict, each through optimizer_step."""
    model, optimizer = _built(kind, seed=0)
    generator = torch.Generator().manual_seed(1)
    for verdict in verdicts:
        _backward(model, generator)
        optimizer_step(optimizer, torch.tensor(verdict))
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, generator


@pytest.mark.parametrize("kind", ["adamw_fused", "sgd_momentum", "sgd_fused_momentum",
                                  "adafactor"])
def test_a_bad_verdict_leaves_everything_and_a_good_one_steps(kind):
    model, optimizer, generator = _stepped(kind, [0.0, 0.0])
    seen = []
    optimizer.register_step_pre_hook(lambda o, *_: seen.append(getattr(o, "found_inf", None)))
    _backward(model, generator)
    before = _state(model, optimizer)
    bad = torch.tensor(1.0)
    optimizer_step(optimizer, bad)
    optimizer.zero_grad(set_to_none=True)
    assert _bitwise(_state(model, optimizer), before)  # weights, momentum, step counts
    fused = kind.endswith("fused") or "_fused_" in kind
    # fused: skipped on the device (its kernel given the verdict); else never stepped
    assert seen == ([bad] if fused else []) and not hasattr(optimizer, "found_inf")
    # the next batch, applied: as an optimizer that never saw the bad one
    _backward(model, generator)
    optimizer_step(optimizer, torch.tensor(0.0))
    twin, twin_optimizer, twin_generator = _stepped(kind, [0.0, 0.0])
    _backward(twin, twin_generator)
    twin.zero_grad(set_to_none=True)  # the bad batch, drawn and dropped
    _backward(twin, twin_generator)
    twin_optimizer.step()
    assert _bitwise(_state(model, optimizer), _state(twin, twin_optimizer))
    assert not _bitwise(_state(model, optimizer), before)


def test_a_bad_first_step_of_fused_sgd_leaves_no_momentum_behind():
    """Under ``found_inf`` fused SGD's first step keeps the momentum buffers it made with
    ``torch.empty_like``: whatever the memory held would be the momentum of the next step.
    A step that creates state is decided on the host."""
    model, optimizer, generator = _stepped("sgd_fused_momentum", [1.0])
    assert not any(optimizer.state.get(p) for p in model.parameters())
    _backward(model, generator)
    optimizer_step(optimizer, torch.tensor(0.0))
    twin, twin_optimizer, twin_generator = _stepped("sgd_fused_momentum", [])
    _backward(twin, twin_generator)
    twin.zero_grad(set_to_none=True)
    _backward(twin, twin_generator)
    twin_optimizer.step()
    assert _bitwise(_state(model, optimizer), _state(twin, twin_optimizer))


def test_no_verdict_steps():
    model, optimizer, generator = _stepped("sgd_momentum", [])
    _backward(model, generator)
    optimizer_step(optimizer, None)
    assert all(optimizer.state[p]["momentum_buffer"] is not None for p in model.parameters())


@pytest.mark.parametrize("options", [{}, {"fused": True}, {"amsgrad": True}])
def test_adams_state_made_without_a_step_is_the_stepped_one(options):
    """Adam's and AdamW's first state is made without the zero step (a warm restore paid
    a step over its whole shard for it): the same keys, dtypes, devices and values as the
    zero step makes for any other optimizer (a subclass takes that path)."""
    class Subclass(torch.optim.AdamW):
        pass
    made = {}
    for optimizer_type in (torch.optim.AdamW, Subclass):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = optimizer_type(model.parameters(), lr=1e-2, **options)
        materialize(optimizer)
        made[optimizer_type] = [(k, v.dtype, v.device, v.clone())
                                for p in model.parameters()
                                for k, v in sorted(optimizer.state[p].items())]
    fast, stepped = made.values()
    assert [x[:3] for x in fast] == [x[:3] for x in stepped]
    assert all(torch.equal(a[3], b[3]) for a, b in zip(fast, stepped))
    assert ("max_exp_avg_sq" in {k for k, *_ in fast}) == bool(options.get("amsgrad"))
