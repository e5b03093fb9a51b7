"""Turns a plain Transformer into the one that trains: FP8 linears, tensor parallelism,
activation checkpointing, torch.compile and FSDP2, applied in that order (each wraps the
previous).

Tensor parallelism (``parallelism.tp`` above 1) follows Megatron's split of a Llama
block over the mesh's ``tp`` dim: the attention's q, k and v projections and the MLP's
w1 and w3 column-wise (each rank computes its own heads and hidden units), wo and w2
row-wise; between blocks the residual stream is split along the sequence (sequence
parallel), so each rank normalizes only its tokens, and gathered once before each
attention and MLP. The embedding is split by vocabulary rows, the output projection by
vocabulary columns, whose logits stay split: the loss is computed on them in place
(``loss_parallel``), never gathering a [tokens, vocabulary] tensor. FSDP2 then shards
every parameter over the data-parallel dims.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import replace
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from llmtrain.config import ConfigError, ParallelismConfig

log = logging.getLogger(__name__)

# Selective checkpointing keeps the outputs of these ops (the expensive ones to redo) and
# recomputes the cheap elementwise work in between.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,  # SDPA's pick on Hopper+
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


def check_fp8(recipe: str, capability: tuple[int, int], name: str) -> None:
    """FP8 GEMMs (``_scaled_mm``) need FP8 tensor cores: compute capability 8.9 or later
    (L4/L40S, H100/H200, B200). On an A100 the first matmul would fail."""
    if capability < (8, 9):
        raise ConfigError(
            f"parallelism.fp8={recipe} needs FP8 tensor cores (compute capability 8.9+: "
            f"H100, H200, L40S, B200), but {name} is sm_{capability[0]}{capability[1]}: "
            f"set parallelism.fp8=none")


def fp8_all_gather(p: ParallelismConfig, device_type: str, shards: int) -> bool:
    """Whether FSDP all-gathers the FP8 weights (tensorwise on GPUs, over 2+ shards): half
    the bytes of bf16, and the cast happens once per shard instead of after the gather. The
    scales are then computed for all weights in one pass after each optimizer step
    (:func:`precompute_fp8_scales`). With one shard nothing is gathered, and that cast, done
    outside the compiled blocks, cost more than FP8 saved (3B on one H200: 0.96x bf16's
    tokens/s with it, 1.14x without)."""
    return p.fp8 == "tensorwise" and device_type == "cuda" and shards > 1


def precompute_fp8_scales(model: nn.Module) -> None:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    precompute_float8_dynamic_scale_for_fsdp(model)


def import_fp8() -> None:
    """Imports torchao's float8 training, which an FP8 build imports on first use (0.6 s of
    a warm spare's 2-core start, where a survivor had it): a process that waits to build
    (a warm spare, a prepared worker) pays it ahead."""
    importlib.import_module("torchao.float8")


def apply_fp8(model: nn.Module, p: ParallelismConfig, device_type: str, shards: int) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    if device_type == "cuda":
        check_fp8(p.fp8, torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    else:
        # No CPU multiplies FP8 natively. Where oneDNN offers an FP8 matmul (CPUs with
        # AVX-512 FP16) it emulates it, and 200x slower (1.2 s against 7 ms for one
        # 512x128x384 product on a Sapphire Rapids core) than torch's own path (upcast,
        # then the FP32 GEMM), which every other CPU takes anyway.
        torch.backends.mkldnn.enabled = False
    config = Float8LinearConfig.from_recipe_name(p.fp8)
    if fp8_all_gather(p, device_type, shards):
        config = replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=_fp8_fits)


def has_tp(mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` has a ``tp`` dim (``build_mesh`` makes one for ``parallelism.tp``
    above 1; a test may make one of a single rank)."""
    return "tp" in (mesh.mesh_dim_names or ())


def data_parallel(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of the job's mesh (what FSDP2 shards over): the mesh
    itself, or without its ``tp`` dim."""
    if not has_tp(mesh):
        return mesh
    dp = tuple(n for n in mesh.mesh_dim_names if n != "tp")
    return mesh[dp if len(dp) > 1 else dp[0]]


def _tp_styles(linear: nn.Module, fp8: str, device_type: str):
    """Column- and row-wise styles for ``linear``: torchao's FP8 ones for a tensorwise
    FP8 linear on GPUs (they cast before the collective, which then moves FP8: half the
    bytes), else torch's (gloo has no float8 dtypes: FP8 matmuls, collectives in the
    activations' dtype)."""
    if fp8 == "tensorwise" and device_type == "cuda":  # torchao imported only then
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel,
                                                           Float8RowwiseParallel)
        if isinstance(linear, Float8Linear):
            return Float8ColwiseParallel, Float8RowwiseParallel
    return ColwiseParallel, RowwiseParallel


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, fp8: str) -> None:
    """Splits ``model``'s blocks, embedding and output over ``tp_mesh`` (see the
    module's docstring); the output's logits stay split along the vocabulary, for a
    loss under ``torch.distributed.tensor.parallel.loss_parallel``."""
    if tp_mesh.device_type == "cuda":
        # The plan is torch's DTensor styles (and torchao's FP8 ones), whose collectives
        # on NCCL are the same all-gathers and reduce-scatters gloo runs here; read from
        # their source, never run on GPUs.
        log.warning("llmtrain: tensor parallelism across GPUs (NCCL) has never run: it has "
                    "run on gloo (CPU) only")
    col, row = _tp_styles(model.output, fp8, tp_mesh.device_type)
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": col(input_layouts=Shard(1), output_layouts=Shard(-1),
                      use_local_output=False),
    })
    for block in model.layers.values():
        col, row = _tp_styles(block.attention.wq, fp8, tp_mesh.device_type)
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": col(), "attention.wk": col(), "attention.wv": col(),
            "attention.wo": row(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": col(), "feed_forward.w3": col(),
            "feed_forward.w2": row(output_layouts=Shard(1)),
        })


def _checkpointed(block: nn.Module, mode: str) -> nn.Module:
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    return checkpoint_wrapper(block, preserve_rng_state=False,
                              context_fn=partial(create_selective_checkpoint_contexts,
                                                 _save_matmuls))


def _wrapped(module: nn.Module, p: ParallelismConfig) -> nn.Module:
    """``module`` activation-checkpointed, then compiled, as ``p`` asks."""
    if p.activation_checkpoint != "none":
        module = _checkpointed(module, p.activation_checkpoint)
    if p.compile:
        module = torch.compile(module, fullgraph=True)
    return module


def parallelize(model: nn.Module, mesh: DeviceMesh, p: ParallelismConfig) -> nn.Module:
    """Shards ``model`` (a :class:`llmtrain.model.Transformer`) in place over ``mesh``: its
    blocks split over the mesh's ``tp`` dim if it has one (:func:`has_tp`), then FSDP2
    over the rest."""
    dp_mesh = data_parallel(mesh)
    tp = has_tp(mesh)
    if p.fp8 != "none":
        apply_fp8(model, p, mesh.device_type, dp_mesh.shape[-1])
    if tp:
        apply_tp(model, mesh["tp"], p.fp8)
    for name, block in list(model.layers.items()):
        if p.compile and tp:
            # With TP, the attention and the MLP each (checkpointed inside), never the
            # sequence-parallel norms between them: with a whole block compiled, or the
            # norms alone, the gradients came out wrong (torch 2.13 on gloo: grad norm
            # 4.13 and 4.45 instead of 4.80 at the first step; these parts: 4.80).
            for part in ("attention", "feed_forward"):
                setattr(block, part, _wrapped(getattr(block, part), p))
        else:
            block = _wrapped(block, p)
        model.layers[name] = block
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, p.param_dtype),
                              reduce_dtype=getattr(torch, p.reduce_dtype))
    shard = partial(fully_shard, mesh=dp_mesh, mp_policy=mp)
    for i, block in enumerate(model.layers.values()):
        # The last block's parameters are needed again at once by backward: keep them.
        last = i == len(model.layers) - 1
        shard(block, reshard_after_forward=p.reshard_after_forward and not last)
    shard(model, reshard_after_forward=p.reshard_after_forward)
    return model
