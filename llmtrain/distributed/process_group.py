"""Process-group start-up from torchrun's environment, and the data-parallel DeviceMesh.

Every restart pays start-up again, so start-up is recovery time. The choices, and why:

- **libuv TCPStore, clients not awaited.** The libuv server handles tens of thousands of
  connections on one thread; the old backend's per-connection threads did not scale
  (PyTorch's 96K-rank rendezvous work). The server does not wait for every client to
  connect (``wait_for_workers=False``): nothing needs that, and it serializes start-up.
- **No start-up barrier.** ``init_process_group`` only runs a store-based barrier when
  ``TORCH_DIST_INIT_BARRIER=1``; we leave it off. It costs O(world) store round trips and
  the first collective synchronizes the ranks anyway.
- **Eager NCCL init bound to the device** (``device_id``): the communicator is created at
  once, and DeviceMesh subgroups are then split from it (``ncclCommSplit``) instead of
  each running its own unique-id exchange through the store.
- **Two timeouts:** a short one for rendezvous and group creation, where a missing peer
  should fail fast and be restarted, and a longer one for collectives during training.
- **A store namespace per restart attempt** (see ``connect_store``).

The backend follows the device (NCCL on CUDA, gloo on CPU) unless the config pins one.
``benchmarks/store_scale.py`` measures the store traffic of this sequence against the
naive all-to-all pattern at 1K-16K simulated ranks.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmtrain.config import ParallelismConfig, ReliabilityConfig
from llmtrain.distributed.signed_store import SignedStore, job_store_view, signed


def node_name() -> str:
    """This node's name in events and exclusion records: ``LLMTRAIN_HOST`` (set by the
    launcher, so nodes sharing a kernel can be told apart) or the hostname."""
    return os.environ.get("LLMTRAIN_HOST") or socket.gethostname()


@dataclass(frozen=True)
class WorldInfo:
    """Who this process is in the job, read from torchrun's environment: its rank, the
    world's size, its place on its node (``local_rank`` of ``local_world_size``) and the
    node's name; and the node range ``llmtrain launch --nnodes MIN:MAX`` gave (None
    outside it), which a shrink may not go below and a grow not above."""
    rank: int
    world_size: int
    local_rank: int
    host: str
    local_world_size: int = 1
    min_nodes: int | None = None
    max_nodes: int | None = None

    @classmethod
    def from_env(cls) -> "WorldInfo":
        def count(name: str) -> int | None:
            return int(os.environ[name]) if name in os.environ else None
        return cls(rank=int(os.environ.get("RANK", 0)),
                   world_size=int(os.environ.get("WORLD_SIZE", 1)),
                   local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                   host=node_name(),
                   local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                   min_nodes=count("LLMTRAIN_MIN_NODES"), max_nodes=count("LLMTRAIN_MAX_NODES"))


def free_port() -> int:
    """A TCP port free on loopback now (for single-process runs and local clusters)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _standalone_env() -> None:
    """Lets ``llmtrain train`` run as one process without torchrun."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def device_type(p: ParallelismConfig) -> str:
    """The kind of device a run uses: CUDA when asked for, or present under ``auto``."""
    return "cuda" if p.device == "cuda" or (p.device == "auto" and torch.cuda.is_available()) \
        else "cpu"


def backend_for(p: ParallelismConfig, device: str) -> str:
    """The process group's backend: the config's, else NCCL on CUDA and gloo on CPU."""
    return p.backend if p.backend != "auto" else ("nccl" if device == "cuda" else "gloo")


def resolve_device(p: ParallelismConfig, local_rank: int) -> torch.device:
    if device_type(p) == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("parallelism.device='cuda' but no CUDA device is visible; "
                               "use parallelism.device='cpu' or 'auto'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _attempt_namespace() -> str:
    """Keys of this attempt. Only the agent's shared store outlives an attempt; a fresh
    per-round store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) needs no attempt in the name,
    and must not have one: a spare's agent has restarted fewer times than the others."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "llmtrain"
    return f"llmtrain/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def open_store(name: str, timeout: timedelta, round_id: str | None = None) -> SignedStore:
    """A new store client under ``name`` for a thread that must reach a store while the
    main thread may be stuck: the watchdog's.

    Under ``llmtrain launch`` (``LLMTRAIN_RDZV_ENDPOINT``) it is the rendezvous store,
    served by an agent or ``llmtrain rdzv-store`` and so outside every worker: with a
    store per round, the job's own store lives in rank 0's process, and a rank 0 that is
    stopped (SIGSTOP, a kernel hang) would take the watchdogs' meeting point along. The
    keys go under a name the round's ranks agree on through the job's store at start, or
    under ``round_id`` when they already agree on one (a warm spare has no job store).
    Values in the rendezvous store are signed with the job's secret
    (:mod:`llmtrain.distributed.signed_store`); in the job's own store, when one is given.
    """
    outside = rendezvous_store(timeout)
    if round_id is None:
        job = dist.PrefixStore(_attempt_namespace(), dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timeout, use_libuv=True))
        if outside is None:
            return job_store_view(dist.PrefixStore(name, job), name)
        round_id = job.compare_set(f"{name}/round", "", uuid.uuid4().hex).decode()
    where = f"llmtrain/rounds/{round_id}/{name}"
    return signed(dist.PrefixStore(where, outside), where,
                  reconnect=lambda: dist.PrefixStore(where, rendezvous_store(timeout)))


def rendezvous_store(timeout: timedelta) -> dist.Store | None:
    """A client of the rendezvous store outside the workers (``LLMTRAIN_RDZV_ENDPOINT``,
    set by ``llmtrain launch``), or None without one."""
    endpoint = os.environ.get("LLMTRAIN_RDZV_ENDPOINT")
    if not endpoint:
        return None
    host, _, port = endpoint.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, use_libuv=True)


def connect_store(world: WorldInfo, r: ReliabilityConfig) -> dist.Store:
    """The rendezvous store, namespaced by restart attempt.

    By default torchrun's agent shares its own TCPStore with the workers and keeps it
    across restarts, so a restarted worker would read the dead workers' gloo/NCCL
    addresses left in it and fail to connect. A prefix per attempt keeps every attempt's
    keys apart. (Setting TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun, as the
    launchers do, gives each rendezvous round a fresh store instead.)
    """
    _standalone_env()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world.world_size,
        is_master=not agent_store and world.rank == 0,
        timeout=timedelta(seconds=r.init_timeout_s), wait_for_workers=False,
        multi_tenant=True, use_libuv=True)
    return dist.PrefixStore(_attempt_namespace(), store)


_DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring",
                      "NCCL_PROTO": "Simple"}


def make_deterministic(p: ParallelismConfig, device_type: str,
                       env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """``parallelism.deterministic`` on CUDA: deterministic kernels, and NCCL's choice of
    algorithm and protocol (which follows message size and topology) pinned, so that a
    restart on other nodes reduces in the same order. Called before the process group
    exists: cuBLAS reads its workspace setting at its first call, NCCL its variables when
    the first communicator is created. Variables already set are the user's and kept;
    returns those it set."""
    if not (p.deterministic and device_type == "cuda"):
        return {}
    new = {k: v for k, v in _DETERMINISTIC_ENV.items() if k not in env}
    env.update(new)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return new


def init_process_group(p: ParallelismConfig, r: ReliabilityConfig, world: WorldInfo,
                       store: dist.Store, timeout_s: float | None = None) -> torch.device:
    """Joins the job's default process group, waiting for its members up to ``timeout_s``
    (``r.init_timeout_s`` by default); returns this rank's device."""
    device = resolve_device(p, world.local_rank)
    make_deterministic(p, device.type)
    dist.init_process_group(
        backend=backend_for(p, device.type), store=store, rank=world.rank, world_size=world.world_size,
        timeout=timedelta(seconds=r.init_timeout_s if timeout_s is None else timeout_s),
        device_id=device if device.type == "cuda" else None)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=r.collective_timeout_s))
    return device


def build_mesh(device: torch.device, shape: tuple[int, int],
               collective_timeout_s: float, tp: int = 1) -> DeviceMesh:
    """A 1-D ``dp_shard`` mesh for FSDP, or 2-D ``(dp_replicate, dp_shard)`` for HSDP;
    with ``tp`` above 1, a last dim ``tp`` of that many consecutive ranks (a node's). Its
    groups get the job's collective timeout too: made with the backend's default (NCCL's
    10 minutes), a longer ``reliability.hang_timeout_s`` would never be reached on them."""
    replicate, shard = shape
    dims = [("dp_replicate", replicate)] * (replicate > 1) + [("dp_shard", shard)]
    dims += [("tp", tp)] * (tp > 1)
    global _last_dims
    if _last_dims is not None and _last_dims != dims:  # a resize: plans of other groups
        forget_meshes()
    _last_dims = dims
    mesh = init_device_mesh(device.type, tuple(n for _, n in dims),
                            mesh_dim_names=tuple(name for name, _ in dims))
    for dim in range(mesh.ndim):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=collective_timeout_s),
                                              mesh.get_group(dim))
    return mesh


_last_dims: list[tuple[str, int]] | None = None  # the mesh this process made last


def forget_meshes() -> None:
    """Clears DTensor's sharding plans (this thread's and the C++ fast path's) and its
    redistribution plans, which keep the meshes they were made on. A mesh equals any
    other of the same ranks and dims whatever its process groups, so a later generation
    back at an earlier layout (a grow after a shrink) was handed plans holding the
    destroyed groups ("Could not resolve the process group registered under the name N").
    Called on the training thread when a generation's mesh has another layout than the
    one before, and after a warm spare's rehearsal (:mod:`llmtrain.spare_rehearsal`). A
    generation at the same layout (a spare's recovery) keeps them: its groups are made in
    the same order and get the same names, and planning every op again cost a TP
    generation's first step about a second here (one run each)."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


def global_mean(value: torch.Tensor) -> float:
    """The mean of ``value`` over all ranks (each holds an equal share of the batch)."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def side_group(timeout_s: float, desc: str) -> dist.ProcessGroup:
    """A gloo group of every rank beside the job's (votes, snapshot replication), named
    ``desc`` in the flight recorder's dumps (:data:`llmtrain.distributed.group_names.OFF_THREAD`
    first for one used off the training thread), bounded by the job's collective timeout, not gloo's 30-minute
    default: a peer lost mid-exchange must not hold a survivor past its recovery budget."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s),
                          group_desc=desc)
