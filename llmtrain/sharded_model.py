"""The model one generation of the process group trains, with its optimizer and schedule.

Built on meta and sharded before any storage exists, so no rank ever holds the whole
model; each rank then draws only its shards, the same weights at any world size. Built at
start, and again by the survivors of a lost rank in each new generation (warm path).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from llmtrain.checkpoint import hf
from llmtrain.config import JobConfig, ParallelismConfig
from llmtrain.distributed.parallelize import data_parallel, fp8_all_gather, parallelize
from llmtrain.model import Transformer
from llmtrain.optim import build_optimizer, lr_schedule


class ShardedModel(NamedTuple):
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    fp8_scales: bool  # FP8 weights gathered in FP8: their scales are precomputed each step


def build(cfg: JobConfig, mesh: DeviceMesh, device: torch.device,
          span: Callable[[str], AbstractContextManager], *, init_from: str = "") -> ShardedModel:
    """``span(name)`` times each part; ``init_from``: a Hugging Face directory whose
    weights start the run (each rank reads its shards' rows only)."""
    t = cfg.training
    with span("model_meta"), torch.device("meta"):
        torch.manual_seed(t.seed)
        model = Transformer(cfg.model)
    with span("shard"):
        model = parallelize(model, mesh, cfg.parallelism)
        fp8_scales = fp8_all_gather(cfg.parallelism, device.type, data_parallel(mesh).shape[-1])
    with span("materialize"):
        model.to_empty(device=device)
        model.init_weights(t.seed)
        if init_from:
            hf.load(model, init_from, cfg.model)
    with span("optimizer"):
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = lr_schedule(optimizer, cfg.optim, t.steps)
    return ShardedModel(model, optimizer, scheduler, fp8_scales)


def token_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of ``inputs`` against ``targets`` (under tensor
    parallelism, in :func:`split_loss`'s context: the logits stay split over the
    vocabulary)."""
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def split_loss(p: ParallelismConfig) -> Callable[[], AbstractContextManager]:
    """The context :func:`token_loss` and its backward run in: with tensor parallelism,
    ``loss_parallel`` (the loss works on the vocabulary-split logits in place)."""
    return loss_parallel if p.tp > 1 else contextlib.nullcontext
