"""The failure layer under the warm path (``llmtrain.distributed.failure``): the worker
environment a warm launch sets, the checks of an NCCL job's settings, collective failures
told from a rank's own errors (on real gloo errors from a real lost peer), and the watch
that wakes a rank when its generation fails, on a real TCPStore."""

import errno
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from conftest import signed_store
from ranks import spawn
from llmtrain.config import JobConfig
from llmtrain.distributed.failure import FailureWatch, broke_a_collective, nccl_problems
from llmtrain.distributed.nccl_env import WARM_NCCL_ENV
from llmtrain.launch.children import worker_env
from llmtrain.launch.config import LaunchConfig
from llmtrain.launch.node import warm_off_reason


def test_a_warm_launch_gives_its_workers_the_nccl_settings(monkeypatch):
    """What ``llmtrain launch`` hands torchrun (whose agent passes it to every worker) and
    a warm spare: the warm path's NCCL settings, a user's own value kept; none without
    the warm path."""
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("TORCH_NCCL_RETHROW_CUDA_ERRORS", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the user's: kept
    lc = LaunchConfig(rdzv_endpoint="127.0.0.1:29999", external_store=True)
    env = worker_env(JobConfig(), lc, "node1")  # the warm path is on by default
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"
    assert env["NCCL_NVLS_ENABLE"] == "1"
    assert nccl_problems(env, version=(2, 27, 7)) == []
    off = JobConfig()
    off.warm.enable = False
    cold = worker_env(off, lc, "node1")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in cold
    assert set(WARM_NCCL_ENV) - {"NCCL_NVLS_ENABLE"} <= set(env)


def test_the_launcher_says_why_the_default_warm_path_cannot_work():
    """On by default, the warm path needs a store outside the agents, and on NCCL settings
    that let survivors live; the launcher names what is missing and what to change."""
    cfg = JobConfig()
    alone = LaunchConfig(rdzv_endpoint="127.0.0.1:29999", external_store=True)  # 1 node
    assert "one node" in warm_off_reason(cfg, alone, worker_env(cfg, alone, "node1"))
    inside = LaunchConfig(nnodes="1:2", rdzv_endpoint="127.0.0.1:29999")
    reason = warm_off_reason(cfg, inside, worker_env(cfg, inside, "node1"))
    assert "--external-store" in reason and "--warm.enable false" in reason
    outside = LaunchConfig(nnodes="2", rdzv_endpoint="127.0.0.1:29999", external_store=True)
    assert warm_off_reason(cfg, outside, worker_env(cfg, outside, "node1")) == ""  # gloo
    cfg.parallelism.backend = "nccl"
    env = worker_env(cfg, outside, "node1")
    assert warm_off_reason(cfg, outside, env) == ""
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # torchrun's TearDown, set by the user
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in warm_off_reason(cfg, outside, env)
    cfg.warm.enable = False  # turned off: nothing to say
    assert warm_off_reason(cfg, inside, worker_env(cfg, inside, "node1")) == ""


def test_settings_that_defeat_the_warm_path_on_nccl_are_named():
    """torchrun's own default (TearDown), the default outside torchrun, and a NCCL release
    the in-process restart of nvidia-resiliency-ext refuses."""
    good = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}
    assert nccl_problems(good, version=(2, 28, 9)) == []
    for value in ("1", "3"):
        (problem,) = nccl_problems({**good, "TORCH_NCCL_ASYNC_ERROR_HANDLING": value},
                                   version=(2, 28, 9))
        assert f"TORCH_NCCL_ASYNC_ERROR_HANDLING={value}" in problem and "set 2" in problem
    (problem,) = nccl_problems({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, version=(2, 28, 9))
    assert "TORCH_NCCL_RETHROW_CUDA_ERRORS" in problem
    (problem,) = nccl_problems(good, version=(2, 28, 5))
    assert "2.28.5" in problem


def _lose_a_peer(rank: int, out: str) -> None:
    store = dist.FileStore(f"{out}.store", 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1))
    group = dist.new_group(backend="gloo")
    if rank == 1:  # a silent peer first, then a dead one
        time.sleep(1.5)
        os._exit(0)
    told = {}
    try:
        dist.irecv(torch.ones(1), 1, group=group).wait(timedelta(seconds=0.5))
    except RuntimeError as e:
        told["timed out"] = broke_a_collective(e)
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        told["peer died"] = broke_a_collective(e)
    with open(f"{out}.json", "w") as f:
        json.dump(told, f)
    os._exit(0)


def test_collective_failures_are_told_from_a_ranks_own_errors(tmp_path):
    """gloo's errors are plain RuntimeErrors: a dead peer's and a timeout's, from real
    gloo groups, count as collective failures; an EIO, an out-of-memory, any error of the
    rank's own work does not (that rank leaves; its peers are not replaced)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "told")
    spawn(_lose_a_peer, args=(out,), nprocs=2)
    assert json.load(open(f"{out}.json")) == {"timed out": True, "peer died": True}
    assert broke_a_collective(dist.DistBackendError("NCCL communicator was aborted"))
    assert broke_a_collective(dist.DistStoreError("wait timeout"))
    for own in (OSError(errno.EIO, "Input/output error"),
                torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                RuntimeError("CUDA error: an illegal memory access was encountered"),
                ValueError("bad shape")):
        assert not broke_a_collective(own), own


def test_the_watch_wakes_its_rank_once_its_generation_fails(tmp_path):
    """Each watch waits in the store, on its own connection; setting the generation's key
    wakes it at once and runs its action. A disarmed watch (its rank is leaving that
    generation itself) does nothing when it wakes."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                           wait_for_workers=False)

    def connect():
        return signed_store(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                          use_libuv=True, timeout=timedelta(seconds=30)))
    acted = []
    watch = FailureWatch(connect, "g1/failed", on_failure=lambda _: acted.append("g1"))
    late = FailureWatch(connect, "g1/failed", on_failure=lambda _: acted.append("disarmed"))
    late.disarm()
    time.sleep(0.3)  # both are waiting in the store
    assert not watch.woke.is_set() and acted == []
    set_at = time.monotonic()
    signed_store(server).set("g1/failed", "1")
    assert watch.woke.wait(5)
    assert time.monotonic() - set_at < 2  # woken by the store, not a poll
    for t in (watch._thread, late._thread):
        t.join(5)
        assert not t.is_alive()
    assert acted == ["g1"] and not late.woke.is_set()
