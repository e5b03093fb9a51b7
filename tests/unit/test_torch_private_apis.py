"""Canaries for the private torch APIs llmtrain relies on (pyproject pins torch to one
minor release for them). Each test names the API and the code that uses it, so a torch
upgrade that moves one fails here, plainly, rather than deep inside a training run."""

from __future__ import annotations

import json
import os
import pickle
import posixpath
import subprocess
import sys
from contextlib import contextmanager

import torch

from conftest import ROOT


def test_dcp_fsspec_writer_and_metadata_tmp_name(tmp_path):
    """checkpoint/storage.py wraps ``FsspecWriter.fs.fs`` (the fsspec filesystem inside
    DCP's private ``_fsspec_filesystem.FileSystem``) to hash every file as it is written,
    and takes the sums of ``.metadata`` from the file DCP writes as ``.metadata.tmp``
    before renaming it."""
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import (FileSystem, FsspecReader,
                                                                 FsspecWriter)

    class Recording(FileSystem):
        opened: list[str] = []

        @contextmanager
        def create_stream(self, path, mode):
            self.opened.append(posixpath.basename(os.fspath(path)))
            with super().create_stream(path, mode) as stream:
                yield stream

    writer = FsspecWriter(str(tmp_path))
    assert isinstance(writer.fs, FileSystem), "FsspecWriter.fs is no longer a FileSystem"
    assert isinstance(writer.fs.fs, fsspec.AbstractFileSystem), "FsspecWriter.fs.fs moved"
    recording = Recording()
    recording.fs = writer.fs.fs
    writer.fs = recording
    dcp.save({"w": torch.arange(8.0)}, storage_writer=writer, no_dist=True)
    assert ".metadata.tmp" in Recording.opened, (
        f"DCP no longer writes .metadata.tmp (opened: {Recording.opened}): "
        f"CommitWriter.finish in llmtrain/checkpoint/storage.py reads its sums by that name")
    out = {"w": torch.zeros(8)}
    dcp.load(out, storage_reader=FsspecReader(str(tmp_path)), no_dist=True)
    assert torch.equal(out["w"], torch.arange(8.0))


def test_dcp_helpers_of_the_raw_shard_format():
    """checkpoint/shard_write.py shares a rank's items among writer threads with DCP's
    ``_split_by_size_and_type`` and records where each lies in a ``_StorageInfo`` (its
    ``transform_descriptors`` mark raw tensors); checkpoint/shard_read.py loads a whole
    checkpoint as ``dcp_to_torch_save`` does (``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``);
    checkpoint/state.py loads each rank's share alone with ``_load_state_dict(no_dist=True)``;
    checkpoint/staging.py refills its buffers with ``_copy_state_dict``, wraps them as
    DTensors with the live ones' spec (``DTensor(local, spec, requires_grad=...)``, a C
    constructor: test_checkpoint_staging.py builds them) and pins its block (and a resume's
    scratch) with ``torch.cuda._pin_memory_utils``."""
    import dataclasses
    import inspect

    import torch.cuda._pin_memory_utils as pin_memory_utils
    from torch.distributed._state_dict_utils import _copy_state_dict
    from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    assert [f.name for f in dataclasses.fields(_StorageInfo)] == [
        "relative_path", "offset", "length", "transform_descriptors"]
    assert list(inspect.signature(_split_by_size_and_type).parameters) == ["bins", "items"]
    assert {"storage_reader", "planner", "no_dist"} <= set(
        inspect.signature(_load_state_dict).parameters)
    assert callable(_EmptyStateDictLoadPlanner)
    assert callable(pin_memory_utils.pin_memory) and callable(pin_memory_utils.unpin_memory)
    buffers = {"w": torch.ones(3)}
    staged = _copy_state_dict({"w": torch.arange(3.0)}, buffers)
    assert staged["w"] is buffers["w"] and torch.equal(buffers["w"], torch.arange(3.0))


def test_rendezvous_state_fields():
    """launch/node.py's standby spare reads the c10d rendezvous state (the private
    ``_RendezvousState``: closed, complete, participants) to see a round short of nodes."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend)
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          use_libuv=True)
    backend = C10dRendezvousBackend(store, "canary")
    assert backend.get_state() is None
    backend.set_state(pickle.dumps(_RendezvousState()))
    state = pickle.loads(backend.get_state()[0])
    assert (state.closed, state.complete, state.participants) == (False, False, {})


FLIGHT_RECORDER = """
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.distributed_c10d._set_pg_timeout(timedelta(seconds=42))
dist.all_reduce(torch.ones(4))
raw = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False)
print(raw.decode())
dist.destroy_process_group()
"""


def test_flight_recorder_dump_and_pg_timeout():
    """reliability/watchdog.py dumps the flight recorder through the private
    ``_dump_fr_trace_json``; reliability/flightrec.py reads these entry fields, and each
    group's ranks and progress (``pg_config``, ``pg_status``; gloo lists its groups' ranks
    under one unnamed key, the world's while there is no other group);
    distributed/process_group.py sets the collective timeout with ``_set_pg_timeout``."""
    proc = subprocess.run([sys.executable, "-c", FLIGHT_RECORDER], capture_output=True,
                          text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "TORCH_FR_BUFFER_SIZE": "16"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    dump = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(dump["pg_config"][""]["ranks"]) == [0], dump["pg_config"]
    assert dump["pg_status"]["0"]["last_enqueued_collective"] == "1", dump["pg_status"]
    entries = dump.get("entries")
    assert entries, "the flight recorder recorded no collective"
    entry = entries[-1]
    missing = {"collective_seq_id", "profiling_name", "input_sizes", "input_dtypes",
               "time_created_ns", "state", "process_group"} - set(entry)
    assert not missing, f"flight-recorder entries lack {missing}: {sorted(entry)}"
    assert "all_reduce" in entry["profiling_name"]


def test_dtensor_and_activation_checkpoint_helpers():
    """model.py computes each rank's shard offset with ``compute_local_shape_and_global_offset``;
    distributed/parallelize.py wraps blocks with the private ``checkpoint_wrapper`` and lists
    aten ops (private names among them) for selective activation checkpointing."""
    import inspect

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    import llmtrain.distributed.parallelize  # noqa: F401 - its op list resolves at import
    assert callable(checkpoint_wrapper)
    params = list(inspect.signature(compute_local_shape_and_global_offset).parameters)
    assert params[:3] == ["global_shape", "mesh", "placements"], params


def test_elastic_agent_hooks_for_the_warm_path():
    """launch/agent.py subclasses torchrun's ``LocalElasticAgent`` (overriding the private
    ``_start_workers`` and ``_monitor_workers``, reading ``_pcontext.subprocess_handlers``)
    and installs it by replacing the name ``LocalElasticAgent`` in
    ``torch.distributed.launcher.api``, which ``launch_agent`` looks up at call time."""
    import inspect

    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    for name in ("_start_workers", "_monitor_workers"):
        assert callable(getattr(LocalElasticAgent, name, None)), f"LocalElasticAgent.{name}"
    assert "LocalElasticAgent(" in inspect.getsource(launcher.launch_agent)
    assert "subprocess_handlers" in inspect.getsource(SubprocessContext.__init__)
    assert "self._pcontext" in inspect.getsource(LocalElasticAgent._monitor_workers)


def test_abort_every_process_group():
    """distributed/failure.py ``abort_groups`` aborts a broken NCCL job's groups with
    the private ``distributed_c10d._abort_process_group`` (None: every group)."""
    import inspect

    import torch.distributed.distributed_c10d as c10d
    assert list(inspect.signature(c10d._abort_process_group).parameters) == ["group"]


def test_dcp_save_plan_caching_by_key(tmp_path):
    """checkpoint/manager.py turns on DCP's save plan caching and sets its private
    ``_cached_plans_key`` per generation of the job's groups: a second save of the same
    layout under a key sends no plan (an unusable one), and a new key plans afresh. Its
    IndexingPlanner reads ``SavePlan.usable`` to keep each rank's items of the last
    usable plan, and their index layout (INDEX2.bin), by key: a save under another key in
    between leaves them; ``forget_plans`` drops DCP's private caches
    (``SavePlanner._cached_*``) and the index's for one key, which then plans afresh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import SavePlanner

    from llmtrain.checkpoint.manager import IndexingPlanner, forget_plans

    class Recording(IndexingPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            sent.append(plan.usable)
            return plan

    sent: list[bool] = []
    indexed = []
    state = {"w": torch.ones(4), "n": 3}
    keys = ("canary-0", "canary-0", "canary-1", "canary-0", "forget canary-0", "canary-0")
    for i, key in enumerate(keys):
        if key.startswith("forget "):
            forget_plans(key.removeprefix("forget "))
            continue
        planner = Recording(enable_plan_caching=True)
        planner._cached_plans_key = key
        dcp.save(state, checkpoint_id=str(tmp_path / str(i)), planner=planner, no_dist=True)
        indexed.append(planner.index_layout)
        loaded = {"w": torch.zeros(4), "n": 0}
        dcp.load(loaded, checkpoint_id=str(tmp_path / str(i)), no_dist=True)
        assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 3
    assert sent == [True, False, True, False, True]
    assert indexed == [([[]], [(0, [("w", (0,)), ("n", None)])])] * 5, indexed
    forget_plans("canary-0"), forget_plans("canary-1")
    assert not any("canary" in key for cache in (
        SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan,
        SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata, IndexingPlanner._kept) for key in cache)


def test_compile_cache_private_apis():
    """distributed/compile_cache.py keys a CPU's blob by the cpuinfo flags inductor picks
    its vector ISA from (``torch.cpu._is_*_supported``), finds the node's inductor cache
    with ``torch._inductor.runtime.cache_dir_utils.cache_dir`` (its CPU kernels are
    ``<dir>/??/*.so``), and reads inductor's and AOTAutograd's cache hits and misses from
    ``torch._dynamo.utils.counters``."""
    import inspect

    from torch._dynamo.utils import counters  # noqa: F401 - it must import
    from torch._functorch._aot_autograd import autograd_cache
    from torch._inductor import codecache, cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    for probe in ("_is_avx2_supported", "_is_avx512_supported", "_is_vnni_supported",
                  "_is_amx_tile_supported"):
        assert isinstance(getattr(torch.cpu, probe)(), bool), probe
    assert isinstance(cache_dir(), str)
    # the counters' names, where torch counts them
    source = inspect.getsource(codecache)
    assert '"fxgraph_cache_hit"' in source and '"fxgraph_cache_miss"' in source
    source = inspect.getsource(autograd_cache)
    assert '"autograd_cache_hit"' in source and '"autograd_cache_miss"' in source
    # an ISA probe already built is not built again (the bundle carries the probes)
    assert "os.path.isfile(output_path)" in inspect.getsource(cpu_vec_isa.VecISA.check_build)
    # the compile workers: started by maybe_warm_pool, which the inductor backend calls
    # at each compile and TORCH_WARM_POOL=0 turns off; until a pool is ready, kernels
    # compile in the process itself
    from torch._dynamo.backends import inductor
    from torch._inductor import async_compile
    assert "maybe_warm_pool()" in inspect.getsource(inductor)
    assert '"TORCH_WARM_POOL"' in inspect.getsource(async_compile.maybe_warm_pool)
    assert "_ready_future.done()" in inspect.getsource(async_compile.AsyncCompile.use_process_pool)


def test_fused_optimizers_take_found_inf():
    """reliability/integrity.py ``optimizer_step`` gives a bad step's verdict to optimizers
    whose ``_step_supports_amp_scaling`` is set (as ``GradScaler`` does) as their
    ``found_inf`` attribute, which skips the step and takes its count back; it reads the
    verdict on the host for the rest."""
    p = torch.nn.Parameter(torch.ones(3))
    fused = torch.optim.AdamW([p], lr=0.1, fused=True)
    assert fused._step_supports_amp_scaling is True
    assert not getattr(torch.optim.AdamW([p], lr=0.1), "_step_supports_amp_scaling", False)
    p.grad = torch.ones(3)
    fused.found_inf = torch.ones(())
    fused.step()
    assert torch.equal(p.detach(), torch.ones(3)) and fused.state[p]["step"].item() == 0


def test_adams_step_dtype_helper():
    """state_registry._adam_first_state makes Adam's ``step`` with the dtype Adam's own
    ``_init_group`` takes from ``torch.optim.optimizer._get_scalar_dtype``."""
    from torch.optim.optimizer import _get_scalar_dtype
    assert _get_scalar_dtype() == torch.float32
    assert _get_scalar_dtype(is_fused=True) == torch.float32


def test_dtensor_sharding_caches_and_mesh_equality():
    """distributed/process_group.py ``forget_meshes`` clears DTensor's sharding plans
    (``torch.distributed.tensor.debug._clear_sharding_prop_cache``, the Python cache and
    the C++ fast path's) and its redistribution plans (``_redistribute._gen_transform_infos``)
    when a generation's mesh changes layout: a mesh equals any other of the same ranks and
    dims whatever its groups, so plans cached for an earlier generation's mesh would be
    handed to a later one of the same layout."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()
    eq = DeviceMesh.__eq__
    names = eq.__code__.co_names
    assert "_flatten_rank_map" in names and "_layout" in names and "_dim_group_names" \
        not in names, "DeviceMesh equality now looks at its groups: forget_meshes may go"
