"""Staging into reused buffers (checkpoint/staging.py): a snapshot, not a view of the
live state; the same buffers from save to save; new ones when the layout changes; made
ahead of the first save, as views of one block, each starting a page; the copy begun by
``start``, not by ``stage``; the pairing of one save taken up by the next, holding no
live tensor alive."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

# A process of its own: DTensors need a process group (gloo, a world of one).
STAGING = """
import io, torch, torch.distributed as dist
from multiprocessing.reduction import ForkingPickler
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from llmtrain.checkpoint.staging import ReusedBufferStager
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = DeviceMesh("cpu", [0])
live = {"w": distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(0)]),
        "step": distribute_tensor(torch.tensor(7.0), mesh, [Replicate()]),
        "m": torch.ones(4), "lr": 0.1, "blob": io.BytesIO(b"a")}
stager = ReusedBufferStager(cuda=False, share_memory=False)

def staged_by(stager, state):  # as the manager does: the copy begins after DCP's call
    done = stager.stage(state)
    assert not done.done()
    stager.start()
    return done.result()
first = staged_by(stager, live)
with torch.no_grad():
    for t in (live["w"], live["step"], live["m"]):
        t.add_(100)
assert torch.equal(first["w"].to_local(), torch.arange(6.0).reshape(2, 3))
assert first["step"].to_local().item() == 7.0 and torch.equal(first["m"], torch.ones(4))
live["lr"], live["blob"] = 0.2, io.BytesIO(b"b")
second = staged_by(stager, live)
assert second["w"].to_local().data_ptr() == first["w"].to_local().data_ptr()
assert torch.equal(second["m"], torch.ones(4) + 100) and second["m"] is first["m"]
assert second["lr"] == 0.2 and second["blob"].getvalue() == b"b"
live["m"] = torch.ones(5)
third = staged_by(stager, live)
assert third["m"].shape == (5,) and third["m"] is not first["m"]
# a local shard FSDP replaced and a state tensor replaced: neither kept alive by the
# pairing the next save starts from, and the next save copies the new ones
import gc, weakref
gone = [weakref.ref(live["w"]._local_tensor), weakref.ref(live["m"])]
live["w"]._local_tensor = torch.full((2, 3), 50.0)
live["m"] = torch.full((5,), 3.0)
gc.collect()
assert [ref() for ref in gone] == [None, None]
fourth = staged_by(stager, live)
assert torch.equal(fourth["w"].to_local(), torch.full((2, 3), 50.0))
assert torch.equal(fourth["m"], torch.full((5,), 3.0)) and fourth["m"] is third["m"]

def storage(t):
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()
for share in (False, True):
    ahead = ReusedBufferStager(cuda=False, share_memory=share)
    made = ahead.prepare(live).result()  # the trainer's call after its first step
    assert len({storage(made[k]) for k in ("w", "step", "m")}) == 1  # one block
    staged = staged_by(ahead, live)
    assert staged["w"].to_local().data_ptr() == made["w"].to_local().data_ptr()
    assert staged["w"].placements == live["w"].placements and staged["w"].shape == (2, 3)
    assert torch.equal(staged["w"].to_local(), live["w"].to_local())
    assert staged["m"].is_shared() == share
    # each buffer starts a page, which a direct write takes as it lies
    assert all(t.data_ptr() % 4096 == 0 for t in (staged["w"].to_local(), staged["m"]))
    ForkingPickler.dumps(staged)  # what async_process sends (it crashed on offset wrappers)
print("ok")
"""


def test_staged_state_is_a_snapshot_in_reused_buffers():
    proc = subprocess.run([sys.executable, "-c", STAGING], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_a_pinned_block_is_unpinned_with_its_last_view_not_before(monkeypatch):
    """The pinning is released when the memory goes: the block tensor itself is dropped as
    soon as its views are cut (a view does not keep it alive), and unpinning then would
    leave the staging buffers in pageable memory while a GPU copies into them. (CUDA's
    register calls are recorded here: this machine has no GPU to pin with.)"""
    import gc

    import torch

    from llmtrain.checkpoint import staging
    calls = []
    monkeypatch.setattr(staging.pin_memory_utils, "pin_memory",
                        lambda ptr, size: calls.append(("pin", ptr)))
    monkeypatch.setattr(staging.pin_memory_utils, "unpin_memory",
                        lambda ptr: calls.append(("unpin", ptr)))
    block, views = staging.host_block([torch.ones(3), torch.ones(2, 2)], pin=True)
    ptr = block.data_ptr()
    del block
    gc.collect()
    assert calls == [("pin", ptr)]
    del views
    gc.collect()
    assert calls == [("pin", ptr), ("unpin", ptr)]


def test_the_staging_copy_runs_nicer_than_the_training_thread(monkeypatch):
    """checkpoint.writer_nice is added to the staging thread's niceness too: its copy
    takes the CPU training leaves idle, and the save call's own Python is not held back
    by the copy's time slices."""
    import os
    import threading

    import torch

    from llmtrain.checkpoint.staging import ReusedBufferStager
    seen = []
    copy = torch._foreach_copy_

    def recording(dst, src, **kwargs):  # the niceness of the thread copying
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return copy(dst, src, **kwargs)
    monkeypatch.setattr(torch, "_foreach_copy_", recording)
    stager = ReusedBufferStager(cuda=False, share_memory=False, nice=3)
    try:
        done = stager.stage({"m": torch.ones(4)})
        stager.start()
        staged = done.result()
        assert torch.equal(staged["m"], torch.ones(4))
    finally:
        stager.close()
    assert seen == [min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + 3)]
