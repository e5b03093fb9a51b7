"""The GPU-only choices of parallelize, decided from config and device facts alone."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from llmtrain.config import ConfigError, ParallelismConfig
from llmtrain.distributed.parallelize import _save_matmuls, check_fp8, fp8_all_gather


def test_fp8_needs_fp8_tensor_cores():
    check_fp8("tensorwise", (9, 0), "NVIDIA H100 80GB HBM3")
    check_fp8("rowwise", (8, 9), "NVIDIA L40S")
    with pytest.raises(ConfigError, match=r"parallelism.fp8=rowwise.*A100.*sm_80.*fp8=none"):
        check_fp8("rowwise", (8, 0), "NVIDIA A100-SXM4-80GB")


def test_fp8_weights_are_all_gathered_in_fp8_only_tensorwise_on_gpus():
    assert fp8_all_gather(ParallelismConfig(fp8="tensorwise"), "cuda", 2)
    assert not fp8_all_gather(ParallelismConfig(fp8="tensorwise"), "cuda", 1)  # nothing to gather
    assert not fp8_all_gather(ParallelismConfig(fp8="tensorwise"), "cpu", 2)  # gloo: no FP8 dtype
    assert not fp8_all_gather(ParallelismConfig(fp8="rowwise"), "cuda", 2)  # per-row scales
    assert not fp8_all_gather(ParallelismConfig(fp8="none"), "cuda", 2)


@pytest.mark.parametrize("op", ["_scaled_dot_product_flash_attention",
                                "_scaled_dot_product_efficient_attention",
                                "_scaled_dot_product_cudnn_attention", "mm", "_scaled_mm"])
def test_selective_checkpointing_keeps_every_attention_kernel(op):
    """SDPA picks cuDNN's kernel on Hopper: recomputing it would redo attention in backward."""
    assert _save_matmuls(None, getattr(torch.ops.aten, op).default) == CheckpointPolicy.MUST_SAVE
    assert _save_matmuls(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
