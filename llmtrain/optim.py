"""The optimizer and the learning-rate schedule a run trains with."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llmtrain.config import OptimConfig
from llmtrain.state_registry import local_shard


def build_optimizer(model: torch.nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # Norm gains and other vectors are not decayed: shrinking them only hurts.
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    # Fused: one kernel per step, and it takes the integrity verdict as ``found_inf``, with
    # no host sync (any optimizer trains and restores: reliability.integrity.optimizer_step).
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)


def lr_schedule(optimizer: torch.optim.Optimizer, o: OptimConfig,
                steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak, then cosine decay to ``min_lr_ratio`` of it over
    ``optim.decay_steps`` (the run's steps when 0)."""
    warmup, total = o.warmup_steps, o.decay_steps or steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def square_norm_share(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global gradient norm, a float32 scalar: the
    squares of the gradient shards it holds, each divided by the number of ranks that
    hold the same shard (a DTensor's replicated mesh dimensions, as HSDP's replicas; a
    plain tensor: every rank), so that one all-reduce of the shares, with whatever else
    it carries, gives the squared norm of the whole model's gradient. No communication
    here, and no DTensor dispatch (``clip_grad_norm_`` reduces over FSDP2's shards with a
    collective of its own)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_copies: dict[int, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        grad, copies = p.grad, world
        if isinstance(grad, DTensor):
            copies = math.prod(grad.device_mesh.size(dim) for dim, placement
                               in enumerate(grad.placements) if placement.is_replicate())
            grad = local_shard(grad)
        by_copies.setdefault(copies, []).append(grad)
    share = torch.zeros((), dtype=torch.float32, device=device)
    for copies, grads in by_copies.items():
        norms = torch._foreach_norm(grads)
        share += torch.stack(norms).float().square().sum() / copies
    return share


def global_norm(share: torch.Tensor) -> torch.Tensor:
    """The global gradient norm from each rank's :func:`square_norm_share` (one
    all-reduce)."""
    total = share.clone()
    dist.all_reduce(total)
    return total.sqrt()


def clip_to(model: torch.nn.Module, max_norm: float, norm: torch.Tensor) -> None:
    """Scales the gradients down so that their global ``norm`` is at most ``max_norm``,
    as ``clip_grads_with_norm_`` does, on each rank's own shards (no dispatch)."""
    grads = [local_shard(p.grad) for p in model.parameters() if p.grad is not None]
    if grads:
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))
