"""Process-group start-up choices that CPU runs never exercise, checked as functions."""

import subprocess
import sys

import pytest
import torch

from llmtrain.config import ParallelismConfig
from llmtrain.distributed.process_group import make_deterministic

PINNED = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


@pytest.fixture
def torch_flags():
    """Restores the process-wide determinism flags the test sets."""
    cudnn = torch.backends.cudnn
    saved = torch.are_deterministic_algorithms_enabled(), cudnn.deterministic, cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(saved[0])
    cudnn.deterministic, cudnn.benchmark = saved[1:]


def test_deterministic_on_cuda_pins_kernels_and_nccl_but_keeps_the_users_settings(torch_flags):
    env = {}
    assert make_deterministic(ParallelismConfig(deterministic=True), "cuda", env) == PINNED
    assert env == PINNED
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    env = {"NCCL_ALGO": "Tree", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    assert make_deterministic(ParallelismConfig(deterministic=True), "cuda", env) == {
        "NCCL_PROTO": "Simple"}
    assert env == {"NCCL_ALGO": "Tree", "CUBLAS_WORKSPACE_CONFIG": ":16:8",
                   "NCCL_PROTO": "Simple"}


@pytest.mark.parametrize("deterministic,device", [(True, "cpu"), (False, "cuda")])
def test_cpu_or_not_asked_changes_nothing(torch_flags, deterministic, device):
    torch.use_deterministic_algorithms(False)
    env = {}
    assert make_deterministic(ParallelismConfig(deterministic=deterministic), device, env) == {}
    assert env == {} and not torch.are_deterministic_algorithms_enabled()


MESH_TIMEOUTS = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from llmtrain.distributed.process_group import build_mesh
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
mesh = build_mesh(torch.device("cpu"), (2, 1), collective_timeout_s=4321)
timeouts = {mesh.get_group(d)._get_backend(torch.device("cpu")).options._timeout
            for d in range(mesh.ndim)}
assert timeouts == {timedelta(seconds=4321)}, timeouts
dist.destroy_process_group()
"""


def test_every_mesh_group_gets_the_collective_timeout(tmp_path):
    """HSDP's groups are made with the backend's default timeout (NCCL's 10 minutes), under
    a hang timeout that may be longer: build_mesh gives each the job's collective timeout."""
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", MESH_TIMEOUTS, str(r), store],
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()[-3000:]
