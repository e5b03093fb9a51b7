"""A warm spare's rehearsal of one training step, while it waits for a lost rank's place.

A spare is a fresh process: the first step it trains in a lost rank's place pays every
first call of that step, which a survivor paid long ago. Some of those costs belong to the
rank it takes (DTensor's sharding plans keep the mesh they were made on, and so the
process groups and coordinates of that rank, unknown until the fault). The rest do not:
FSDP2's and tensor parallelism's hooks, autograd, the optimizer's and torchao's first
calls, the model build's. The rehearsal pays those before any fault: it builds the job's
model on a process group of torch's ``fake`` backend (one process, no peer, no network:
every collective returns at once with made-up data), trains one step on random tokens,
then destroys that world and clears every plan that names its meshes
(:func:`llmtrain.distributed.process_group.forget_meshes`), so nothing of it can reach the
real step but what was warmed.

Measured in one process on this project's 2-core machine (``debug_cpu`` at tp 2 x
dp_replicate 2, one thread): a fresh rank's build and first step took 0.66 s and 0.41 s;
after a rehearsal as another rank, 0.05 s and 0.24 s (the rest is planning, mostly the
fused AdamW step's). On a GPU the rehearsal runs on the spare's device, eagerly
(``parallelism.compile`` is not rehearsed): on one H200 (torch 2.11), FP8 at tp 2 as rank 1
of a fake world of 4 took 3.0 s and left no process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
import warnings

import torch
import torch.distributed as dist

from llmtrain import sharded_model
from llmtrain.config import ConfigError, JobConfig
from llmtrain.distributed.parallelize import precompute_fp8_scales
from llmtrain.distributed.process_group import build_mesh, forget_meshes, resolve_device

log = logging.getLogger(__name__)


def rehearse(cfg: JobConfig, world_size: int, rank: int, local_rank: int) -> float | None:
    """Trains one step of ``cfg``'s model as ``rank`` of a fake world of ``world_size``
    ranks, then leaves no trace of that world. Returns the seconds it took, or None where
    it did not run (a process group exists, ``rank`` is not one of ``world_size``, the
    layout does not fit them) or failed: a failed rehearsal is logged and costs the spare
    nothing else."""
    if dist.is_initialized():
        return None
    if not 0 <= rank < world_size:
        log.info("warm spare: no rehearsal as rank %d of %d ranks", rank, world_size)
        return None
    try:
        shape = cfg.mesh_shape(world_size)
    except ConfigError as e:
        log.info("warm spare: no rehearsal at %d ranks (%s)", world_size, e)
        return None
    started = time.perf_counter()
    try:
        device = _one_step(cfg, shape, world_size, rank, local_rank)
    except Exception:  # noqa: BLE001 - a rehearsal never costs the spare its place
        log.warning("warm spare: the rehearsal of a step failed; its first real step "
                    "pays its first calls", exc_info=True)
        return None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # resets the group names a real world starts from
        forget_meshes()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    took = time.perf_counter() - started
    log.info("warm spare: rehearsed a step as rank %d of %d on %s in %.2f s", rank, world_size,
             device.type, took)
    return took


def _one_step(cfg: JobConfig, shape: tuple[int, int], world_size: int, rank: int,
              local_rank: int) -> torch.device:
    p = dataclasses.replace(cfg.parallelism, compile=False)
    cfg = dataclasses.replace(cfg, parallelism=p)
    device = resolve_device(p, local_rank)
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    with warnings.catch_warnings():  # a fake group takes no timeout, and says so
        warnings.filterwarnings("ignore", "Set timeout is now only supported")
        mesh = build_mesh(device, shape, cfg.reliability.collective_timeout_s, tp=p.tp)
    built = sharded_model.build(cfg, mesh, device, lambda _part: contextlib.nullcontext())
    if built.fp8_scales:
        precompute_fp8_scales(built.model)
    tokens = torch.randint(cfg.model.vocab_size, (cfg.training.micro_batch_size,
                                                  cfg.data.seq_len + 1), device=device)
    with sharded_model.split_loss(p)():
        sharded_model.token_loss(built.model, tokens[:, :-1], tokens[:, 1:]).backward()
    built.optimizer.step()
    built.optimizer.zero_grad(set_to_none=True)
    return device
