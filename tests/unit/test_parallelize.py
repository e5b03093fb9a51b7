"""What parallelize decides and applies: the GPU-only choices, from config and device facts
alone; and, through llmtrain's own build on a one-rank gloo mesh, that FP8 and activation
checkpointing are really in the model it returns and change what they must."""

import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import CheckpointPolicy

from llmtrain.config import ConfigError, ParallelismConfig, load_config
from llmtrain.distributed.parallelize import _save_matmuls, check_fp8, fp8_all_gather
from llmtrain.model import TransformerBlock
from llmtrain.sharded_model import ShardedModel, build

BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


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


# -- applied: llmtrain's own build (meta, parallelize, materialize, optimizer) ----------

@pytest.fixture
def built(one_rank_mesh):
    """Builds the debug preset's model as a run does, with parallelism overrides; FP8 on
    CPU turns oneDNN off for the process, which is put back after the test."""
    mkldnn = torch.backends.mkldnn.enabled

    def make(**parallelism: str) -> ShardedModel:
        cfg = load_config("debug_cpu", [(f"parallelism.{k}", v) for k, v in parallelism.items()])
        return build(cfg, one_rank_mesh, torch.device("cpu"),
                     lambda name: contextlib.nullcontext())
    yield make
    torch.backends.mkldnn.enabled = mkldnn


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def train_step(sharded: ShardedModel, seed: int) -> float:
    """One forward, backward and optimizer step on batch ``seed``; its loss."""
    inputs, targets = batch(seed)
    loss = F.cross_entropy(sharded.model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    sharded.optimizer.step()
    sharded.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def local_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name.replace("_checkpoint_wrapped_module.", ""): p.to_local().detach().clone()
            for name, p in model.named_parameters()}


def test_fp8_converts_every_block_linear_and_changes_the_loss(built):
    """The block's seven projections compute in FP8; the output head stays in high
    precision (its logits feed the loss). From the same weights FP8's loss differs from
    fp32's at once, and the weights after a step too, but not by much: FP8 that did
    nothing, or FP8 on the wrong modules, fails here."""
    from torchao.float8.float8_linear import Float8Linear
    fp32, fp8 = built(), built(fp8="tensorwise")
    n_layers = len(fp8.model.layers)
    expected = {f"layers.{i}.{linear}" for i in range(n_layers) for linear in BLOCK_LINEARS}
    converted = {name for name, m in fp8.model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == expected
    assert isinstance(fp8.model.output, nn.Linear) and not isinstance(fp8.model.output,
                                                                      Float8Linear)
    assert not any(isinstance(m, Float8Linear) for m in fp32.model.modules())

    before = local_weights(fp32.model)
    assert all(torch.equal(before[k], v) for k, v in local_weights(fp8.model).items())
    losses = {name: [train_step(s, seed) for seed in (1, 2)]
              for name, s in (("fp32", fp32), ("fp8", fp8))}
    for step in range(2):
        assert losses["fp8"][step] != losses["fp32"][step], losses
        assert losses["fp8"][step] == pytest.approx(losses["fp32"][step], rel=0.02), losses
    after32, after8 = local_weights(fp32.model), local_weights(fp8.model)
    changed = [k for k in after32 if not torch.equal(after32[k], after8[k])]
    assert changed, "an optimizer step on FP8's gradients left the weights as fp32's"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_wraps_and_recomputes_every_block(built, mode):
    """Each block is a checkpoint wrapper and its forward runs again in backward (the
    recomputation); the losses and the gradients are the plain model's."""
    plain, checkpointed = built(), built(activation_checkpoint=mode)
    assert all(isinstance(b, CheckpointWrapper) for b in checkpointed.model.layers.values())
    assert not any(isinstance(m, CheckpointWrapper) for m in plain.model.modules())
    inputs, targets = batch(1)
    results = {}
    for name, sharded in (("plain", plain), (mode, checkpointed)):
        calls = []
        hooks = [b.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
                 for i, b in enumerate(m for m in sharded.model.modules()
                                       if isinstance(m, TransformerBlock))]
        loss = F.cross_entropy(sharded.model(inputs).flatten(0, 1), targets.flatten())
        forward_calls = len(calls)
        loss.backward()
        for hook in hooks:
            hook.remove()
        grads = {k.replace("_checkpoint_wrapped_module.", ""): p.grad.to_local()
                 for k, p in sharded.model.named_parameters()}
        results[name] = (loss.item(), forward_calls, len(calls), grads)
    n_layers = len(plain.model.layers)
    assert results["plain"][1:3] == (n_layers, n_layers)  # no recomputation
    assert results[mode][1:3] == (n_layers, 2 * n_layers)  # each block again in backward
    assert results[mode][0] == pytest.approx(results["plain"][0], rel=1e-6)
    for k, grad in results["plain"][3].items():
        torch.testing.assert_close(results[mode][3][k], grad, rtol=1e-5, atol=1e-7)


def test_the_tp_plan_on_a_one_rank_tp_dim_trains_as_the_model_without_it(
        built, one_rank_mesh, monkeypatch):
    """The TP path on a mesh whose ``tp`` dim has one rank (what ``make gpu-check`` runs
    on one GPU, there with torchao's FP8 styles): every block projection, the embedding
    and the output are DTensors on both dims (the plan's, then FSDP2's), the logits come
    out split along the vocabulary for ``loss_parallel``, and three steps' losses are the
    model's without TP, but for the order of a few float32 sums. Without FP8 the plan
    never imports torchao (0.6 s of a warm spare's first build)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from llmtrain.sharded_model import build as build_sharded
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    for module in ("torchao.float8.float8_linear", "torchao.float8.float8_tensor_parallel"):
        monkeypatch.setitem(sys.modules, module, None)  # an import of it raises
    tp = build_sharded(load_config("debug_cpu"), mesh, torch.device("cpu"),
                       lambda name: contextlib.nullcontext())
    split = {name: p.device_mesh.mesh_dim_names for name, p in tp.model.named_parameters()
             if name.endswith(("wq.weight", "w2.weight", "tok_embeddings.weight",
                               "output.weight"))}
    assert len(split) == 2 * len(tp.model.layers) + 2
    assert set(split.values()) == {("dp_shard", "tp")}, split
    inputs, _ = batch(1)
    logits = tp.model(inputs)
    assert isinstance(logits, DTensor) and logits.placements == (Shard(logits.ndim - 1),)
    plain = built()
    losses = {"plain": [train_step(plain, seed) for seed in (1, 2, 3)], "tp": []}
    for seed in (1, 2, 3):
        inputs, targets = batch(seed)
        with loss_parallel():
            loss = F.cross_entropy(tp.model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
        tp.optimizer.step()
        tp.optimizer.zero_grad(set_to_none=True)
        losses["tp"].append(loss.full_tensor().item())
    assert losses["tp"] == pytest.approx(losses["plain"], rel=1e-5), losses
    assert losses["tp"][2] != losses["tp"][0]  # it stepped
