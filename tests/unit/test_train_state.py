"""What TrainState hands DCP to save: the state dict kept from one save to the next while
the live tensors are the same, always equal to a fresh ``get_state_dict``."""

import gc
import hashlib
import json
import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from llmtrain.checkpoint import index, storage
from llmtrain.checkpoint.shard_read import ShardReader
from llmtrain.checkpoint.state import TrainState
from llmtrain.state_registry import RngState, SchedulerState, StateRegistry


class _Position:  # the data sampler's part of the state
    name, per_rank = "data", False
    consumed = 0

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


def _train_state(model, optimizer, scheduler) -> TrainState:
    registry = StateRegistry()
    registry.bind(model, optimizer, SchedulerState(scheduler))
    registry.register(_Position())
    registry.register(RngState(torch.device("cpu")))
    return TrainState(registry, 0)


@pytest.fixture
def group(one_rank_mesh):
    return one_rank_mesh


def _step(model, optimizer, scheduler) -> None:
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _same(saved: dict, fresh: dict) -> bool:
    flat = lambda d, pre="": {f"{pre}{k}": v for key, val in d.items() for k, v in (  # noqa
        flat(val, f"{key}.").items() if isinstance(val, dict) else [(key, val)])}
    a, b = flat(saved), flat(fresh)
    return a.keys() == b.keys() and all(
        torch.equal(x.full_tensor(), y.full_tensor()) if hasattr(x, "full_tensor") else
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in
        ((a[k], b[k]) for k in a))


def test_the_saved_state_dict_follows_training_and_a_replaced_state(group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model[2].register_buffer("scale", torch.ones(1))  # in the state dict, not the optimizer
    fully_shard(model, mesh=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    state = _train_state(model, optimizer, scheduler)
    _step(model, optimizer, scheduler)
    first = state.state_dict(1)
    for step in (2, 3):
        _step(model, optimizer, scheduler)  # weights, moments, step and rate all change
        saved = state.state_dict(step)
        assert saved["model"] is first["model"]  # kept: no walk over the modules
        fresh = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
        assert _same({k: saved[k] for k in fresh}, fresh)
        assert saved["optim"]["param_groups"][0]["lr"] == scheduler.get_last_lr()[0]
    for moments in optimizer.state.values():  # new tensors, as set_state_dict may make
        moments["exp_avg"] = moments["exp_avg"].clone()
    _step(model, optimizer, scheduler)
    saved = state.state_dict(4)
    assert saved["model"] is not first["model"]
    fresh = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    assert _same({k: saved[k] for k in fresh}, fresh)
    model[2].scale = torch.full((1,), 2.0)  # a buffer replaced, the optimizer unchanged
    assert state.state_dict(5)["model"]["2.scale"].item() == 2.0


def _after_one_step(group):
    """A one-rank FSDP model, its AdamW and schedule after one step, and their TrainState."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    fully_shard(model, mesh=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = _train_state(model, optimizer, scheduler)
    _step(model, optimizer, scheduler)
    return model, optimizer, scheduler, state


def _saved_at_step_1(group, tmp_path, **checkpoint):
    """A one-rank FSDP model, its AdamW and schedule after one step, saved as step 1 by a
    sync CheckpointManager (``checkpoint``: more of its config) under tmp_path/ckpt:
    (model, optimizer, scheduler, state, manager); its events under tmp_path/run."""
    from llmtrain.checkpoint.manager import CheckpointManager
    from llmtrain.config import CheckpointConfig
    from llmtrain.events import EventLog

    model, optimizer, scheduler, state = _after_one_step(group)
    manager = CheckpointManager(CheckpointConfig(mode="sync", **checkpoint), str(tmp_path / "ckpt"),
                                manifest_base={}, events=EventLog(str(tmp_path / "run"), 0),
                                device=torch.device("cpu"), control_group=dist.group.WORLD)
    manager.save(1, state)
    return model, optimizer, scheduler, state, manager


def test_a_resume_at_the_saved_size_unpickles_nothing_and_a_load_runs_no_collection(
        group, tmp_path, monkeypatch):
    """A restart at the saved world size finds its items in ITEMS.json, through the one
    reader that found the checkpoint loadable in place: DCP's ``.metadata`` (a pickle,
    listing every rank's chunks) is not unpickled at all. A checkpoint written before
    ITEMS.json loads in place from ``.metadata``. And no cyclic collection runs inside a
    load (a full one took six times a warm load)."""
    from llmtrain.checkpoint import shard_read
    from llmtrain.checkpoint import state as state_module
    model, optimizer, scheduler, state, manager = _saved_at_step_1(group, tmp_path)
    saved = [t.detach().clone() for t in state_module._live_objects(optimizer, [])]
    _step(model, optimizer, scheduler)
    opened, unpickled = [], []

    class Counted(state_module.ShardReader):
        def __init__(self, *args, **kwargs):
            opened.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(state_module, "ShardReader", Counted)
    monkeypatch.setattr(shard_read.ShardReader, "read_metadata",
                        lambda *a, **k: unpickled.append(1) or 1 / 0)
    assert manager.resume(state) == 1
    assert len(opened) == 1 and unpickled == [], (opened, unpickled)
    assert all(map(torch.equal, state_module._live_objects(optimizer, []), saved))
    monkeypatch.undo()

    url = storage.step_dir(str(tmp_path / "ckpt"), 1)
    (tmp_path / "ckpt" / "step-00000001" / index.ITEMS).unlink()  # as written before it
    collecting = []  # whether a collection could run, seen in the middle of a load
    read = state_module.read_in_place

    def watched(*args, **kwargs):
        collecting.append(gc.isenabled())
        return read(*args, **kwargs)

    monkeypatch.setattr(state_module, "read_in_place", watched)
    _step(model, optimizer, scheduler)
    assert state.load(url) == (1, [], False)  # step, nothing missing, not planned: in place
    assert collecting == [False] and gc.isenabled()
    assert all(map(torch.equal, state_module._live_objects(optimizer, []), saved))
    manager.close()


def test_a_load_lands_in_the_live_tensors_after_they_are_replaced(group, tmp_path):
    """Loads keep their map of the live shards from one to the next; an optimizer state
    tensor replaced by a new one, and a parameter whose local shard FSDP replaced, must
    get the checkpoint's values, not the tensors they replaced."""
    model, optimizer, scheduler, state, manager = _saved_at_step_1(group, tmp_path)
    manager.close()
    url = storage.step_dir(str(tmp_path / "ckpt"), 1)
    weight = model[0].weight
    saved_weight = weight.to_local().detach().clone()
    saved_moment = optimizer.state[weight]["exp_avg"].to_local().clone()
    assert state.fits_in_place(url, checked=True)
    assert state.load(url) == (1, [], False)  # in place, the map now kept

    optimizer.state[weight]["exp_avg"] = torch.zeros_like(optimizer.state[weight]["exp_avg"])
    weight._local_tensor = torch.zeros_like(weight._local_tensor)  # as FSDP's reset does
    assert state.load(url) == (1, [], False)
    assert torch.equal(optimizer.state[weight]["exp_avg"].to_local(), saved_moment)
    assert torch.equal(weight.to_local().detach(), saved_weight)


def test_tensors_read_through_host_slots_land_in_place_and_are_checked(group, tmp_path,
                                                                       monkeypatch, caplog):
    """Destinations that cannot be read into (here: not contiguous; on a GPU: every one)
    are read through two host slots in turn and copied out, however many slots' worth
    the state is; each tensor is checked against its sum, and a damaged one is named."""
    import logging
    from llmtrain.checkpoint import in_place
    from llmtrain.checkpoint import state as state_module
    from llmtrain.checkpoint.shard_read import DamagedCheckpoint
    model, optimizer, scheduler, state, manager = _saved_at_step_1(group, tmp_path)
    manager.close()
    url = storage.step_dir(str(tmp_path / "ckpt"), 1)
    saved = [t.detach().clone() for t in state_module._live_objects(optimizer, [])]
    for p in model.parameters():  # each local shard, and its moments, now column-major
        for d in (p, *(v for v in optimizer.state[p].values()
                       if isinstance(v, torch.Tensor) and v.dim() == 2)):
            local = d._local_tensor
            if local.dim() == 2:
                d._local_tensor = torch.zeros(local.shape[::-1], dtype=local.dtype).t()
    assert not all(state_module.local_shard(t).is_contiguous()
                   for t in state_module._live_objects(optimizer, []))
    monkeypatch.setattr(in_place, "STAGE", 2 * 4096)  # two small tensors a slot
    with caplog.at_level(logging.INFO, logger="llmtrain.checkpoint.in_place"):
        assert state.load(url, check=True) == (1, [], False)  # in place, checked
    said = [r.getMessage() for r in caplog.records if "checkpoint load:" in r.getMessage()]
    assert said and "through 2 host slot(s)" in said[0], said
    # four tensors of under a page each (the weights' and their moments'), two a slot
    assert "in 2 batch(es)" in said[0], said
    assert all(map(torch.equal, state_module._live_objects(optimizer, []), saved))

    # a byte of the first file's tensors flipped: named, whichever slot it was read through
    shard = sorted(f for f in os.listdir(url) if f.endswith(".distcp"))[0]
    with open(os.path.join(url, shard), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(DamagedCheckpoint, match="corrupted"):
        state.load(url, check=True)


def test_a_later_checkpoint_takes_the_kept_layout_and_loads_its_own_bytes(group, tmp_path):
    """A load keeps where each live tensor's bytes are for as long as the checkpoints'
    layout stays: a later checkpoint of the run (other bytes, other sums, objects of
    other sizes) takes it, and each load gets its own checkpoint's values, each item
    checked against that checkpoint's own sum."""
    from llmtrain.checkpoint import state as state_module
    model, optimizer, scheduler, state, manager = _saved_at_step_1(group, tmp_path)
    live = lambda: [t.detach().clone() for t in state_module._live_objects(optimizer, [])]
    saved = {1: live()}
    for _ in range(3):
        _step(model, optimizer, scheduler)
    state.registry.items["data"].consumed = 10 ** 400  # the trainer's record grows
    manager.save(12345, state)
    saved[12345] = live()
    manager.close()
    urls = {step: storage.step_dir(str(tmp_path / "ckpt"), step) for step in saved}
    trainer = [ShardReader(url).stored_items()[("trainer", None)] for url in urls.values()]
    assert trainer[0].relative_path == trainer[1].relative_path
    assert trainer[0].length < trainer[1].length
    # no INDEX.bin: an llmtrain from before INDEX2.bin, which would refuse one it cannot
    # read as damaged, reads ITEMS.json
    assert not any(os.path.exists(os.path.join(url, index.INDEX_ROWS)) for url in urls.values())
    kept = []
    for step in (1, 12345, 1):
        _step(model, optimizer, scheduler)
        # in place, every item checked against this checkpoint's sums
        assert state.load(urls[step], check=True) == (step, [], False)
        assert all(map(torch.equal, state_module._live_objects(optimizer, []), saved[step]))
        kept.append(state._mapped[1].kept[1])
    assert kept[0] is kept[1] is kept[2]  # found once, taken twice


def test_a_dcp_format_resume_refuses_a_metadata_pickle_that_would_run_code(group, tmp_path):
    """Whoever can write the checkpoint storage replaces a dcp-format checkpoint's
    ``.metadata`` (which a resume of that format reads, as DCP plans its load) with a
    pickle that runs a command, and the manifest's sum with its own: llmtrain's unpickler
    of DCP's index refuses it, the checkpoint is moved aside as damaged, the run starts
    from step 0, and the command never ran."""
    from llmtrain.events import read_events
    *_, state, manager = _saved_at_step_1(group, tmp_path, format="dcp")
    url = storage.step_dir(str(tmp_path / "ckpt"), 1)
    marker = tmp_path / "ran"
    payload = b"cposix\nsystem\n(S'touch %s'\ntR." % str(marker).encode()
    with open(os.path.join(url, ".metadata"), "wb") as f:
        f.write(payload)
    manifest_path = os.path.join(url, storage.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["files"][".metadata"] = {"size": len(payload),
                                      "sha256": hashlib.sha256(payload).hexdigest()}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    assert manager.resume(state) == 0
    assert not marker.exists()
    [rejected] = read_events(str(tmp_path / "run"), "checkpoint_rejected")
    assert rejected["step"] == 1 and "not DCP's index" in rejected["problems"][0]
    assert "posix.system" in rejected["problems"][0]
    manager.close()


def test_a_save_refused_midway_costs_only_itself_not_every_later_save(group, tmp_path):
    """The first save is refused while DCP plans it (the fence could not prove membership:
    the store restarted): DCP's plan cache kept half a plan, and every later save failed
    with a KeyError in its planner, the job training on without a checkpoint. The next
    save plans afresh on every rank, and commits."""
    from llmtrain.checkpoint.manager import CheckpointManager
    from llmtrain.config import CheckpointConfig
    from llmtrain.events import EventLog, read_events

    model, optimizer, scheduler, state = _after_one_step(group)
    refusing = [True]

    def fence(what: str) -> None:
        if refusing[0] and "clearing" in what:
            raise RuntimeError(f"{what} refused: the rendezvous store could not be reached")
    run = str(tmp_path / "run")
    manager = CheckpointManager(CheckpointConfig(mode="sync"), str(tmp_path / "ckpt"),
                                manifest_base={}, events=EventLog(run, 0),
                                device=torch.device("cpu"), control_group=dist.group.WORLD,
                                fence=fence)
    manager.save(1, state)
    refusing[0] = False
    for step in (2, 3):
        _step(model, optimizer, scheduler)
        manager.save(step, state)
    assert [e["step"] for e in read_events(run, "checkpoint_failed")] == [1]
    assert [e["step"] for e in read_events(run, "checkpoint_committed")] == [2, 3]


def test_a_write_that_does_not_end_in_time_names_its_checkpoint(group, tmp_path):
    """A leave waits for the write in flight up to its budget: one that outlasts it says
    which checkpoint it was (and, where one waits, its I/O group's collective), not a bare
    TimeoutError; the write itself goes on and commits once it can."""
    from llmtrain.checkpoint.manager import CheckpointManager
    from llmtrain.config import CheckpointConfig
    from llmtrain.events import EventLog, read_events

    _, _, _, state = _after_one_step(group)
    release = threading.Event()
    run = str(tmp_path / "run")
    manager = CheckpointManager(CheckpointConfig(mode="async_thread"), str(tmp_path / "ckpt"),
                                manifest_base={}, events=EventLog(run, 0),
                                device=torch.device("cpu"), control_group=dist.group.WORLD,
                                fence=lambda what: release.wait(30))  # storage that stalls
    manager.save(1, state)
    with pytest.raises(TimeoutError, match=r"^the write of checkpoint 1 did not end within "
                                           r"0\.3 s$"):
        manager.wait(0.3)
    release.set()
    manager.wait(30)
    assert [e["step"] for e in read_events(run, "checkpoint_committed")] == [1]
