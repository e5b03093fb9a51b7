"""Process-group start-up choices that CPU runs never exercise, checked as functions."""

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
