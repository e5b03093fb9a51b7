"""Turns a plain Transformer into the one that trains: FP8 linears, activation
checkpointing, torch.compile and FSDP2, applied in that order (each wraps the previous).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from llmtrain.config import ParallelismConfig

# Selective checkpointing keeps the outputs of these ops (the expensive ones to redo) and
# recomputes the cheap elementwise work in between.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _fp8_fits(module: nn.Module, fqn: str) -> bool:
    """FP8 GEMMs need both dims divisible by 16; the output head stays in high precision
    because its logits feed the loss directly."""
    if not isinstance(module, nn.Linear) or fqn == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module, recipe: str, device_type: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    if device_type == "cpu":
        # No CPU multiplies FP8 natively. Where oneDNN offers an FP8 matmul (CPUs with
        # AVX-512 FP16) it emulates it, and 200x slower (1.2 s against 7 ms for one
        # 512x128x384 product on a Sapphire Rapids core) than torch's own path (upcast,
        # then the FP32 GEMM), which every other CPU takes anyway.
        torch.backends.mkldnn.enabled = False
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=_fp8_fits)


def _checkpointed(block: nn.Module, mode: str) -> nn.Module:
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    return checkpoint_wrapper(block, preserve_rng_state=False,
                              context_fn=partial(create_selective_checkpoint_contexts,
                                                 _save_matmuls))


def parallelize(model: nn.Module, mesh: DeviceMesh, p: ParallelismConfig) -> nn.Module:
    """Shards ``model`` (a :class:`llmtrain.model.Transformer`) in place over ``mesh``."""
    if p.fp8 != "none":
        apply_fp8(model, p.fp8, mesh.device_type)
    for name, block in list(model.layers.items()):
        if p.activation_checkpoint != "none":
            block = _checkpointed(block, p.activation_checkpoint)
        if p.compile:
            block = torch.compile(block, fullgraph=True)
        model.layers[name] = block
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, p.param_dtype),
                              reduce_dtype=getattr(torch, p.reduce_dtype))
    shard = partial(fully_shard, mesh=mesh, mp_policy=mp)
    for i, block in enumerate(model.layers.values()):
        # The last block's parameters are needed again at once by backward: keep them.
        last = i == len(model.layers) - 1
        shard(block, reshard_after_forward=p.reshard_after_forward and not last)
    shard(model, reshard_after_forward=p.reshard_after_forward)
    return model
