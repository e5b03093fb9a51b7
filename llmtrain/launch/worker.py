"""One rank's life under torchrun (``llmtrain train``): refuse to run on an excluded node,
train, record how it ended, and tell the agent when a restart would not help."""

from __future__ import annotations

import gc
import os

import torch

from llmtrain.placement import refuse_if_excluded, spare_assignment, stop_agent
from llmtrain.config import ConfigError, JobConfig
from llmtrain.data import ShardError
from llmtrain.distributed.failure import abandon
from llmtrain.distributed.parallelize import import_fp8
from llmtrain.distributed.process_group import node_name
from llmtrain.events import EventLog
from llmtrain.exit_codes import ExitCode
from llmtrain.model import Transformer
from llmtrain.spare_rehearsal import rehearse
from llmtrain.trainer import Trainer


def run_worker(cfg: JobConfig, plan: dict | None = None) -> ExitCode:
    """Trains this rank to the end; raises what the trainer raised, after logging it.
    ``plan``: a warm spare's assignment, to take a lost rank's place. A shrink or a grow
    (the job going on at another size) happens inside the trainer's session, in this
    process: imports, data files and compiled code stay warm."""
    try:
        refuse_if_excluded(cfg.training.run_dir)
    except SystemExit as e:
        return ExitCode(e.code)
    # what was made since the CLI froze its imports (a spare's first model build): no
    # full collection in the start and resume scans it
    gc.freeze()
    trainer = _start(cfg, plan)
    # What the start made (the model, its state) lives as long as the trainer, as
    # torch's modules do: the cyclic collector need not scan it in each full
    # collection while training, nor at exit, where that took 0.75 s of a 2-step
    # run's 4.4.
    gc.freeze()
    try:
        with trainer.session:  # a failure is recorded, and the session closed as failed
            trainer.run()
    finally:
        trainer.data.close()
    return trainer.exit_code


def _start(cfg: JobConfig, plan: dict | None) -> Trainer:
    try:
        return Trainer(cfg) if plan is None else Trainer.as_spare(cfg, plan)
    except (ConfigError, ShardError) as e:
        events = EventLog(cfg.training.run_dir, int(os.environ.get("RANK", 0)))
        events.emit("fatal", host=node_name(), error=f"{type(e).__name__}: {e}")
        events.close()  # written before the agent is stopped (and stops this process)
        stop_agent(ExitCode.FATAL)
        raise
    except BaseException:
        abandon()  # a start that failed once the group existed (a resume that failed)
        raise


def run_spare(cfg: JobConfig) -> ExitCode:
    """A warm spare (``llmtrain spare``, started by a standby ``llmtrain launch``, which
    holds its place in the job's pool): torch and llmtrain already imported and a step of
    the model rehearsed (that off or failed: the model built once on meta), it waits for
    the plan that assigns it a lost rank, then trains in that rank's place. CLEAN if its
    input ends first: the job no longer needs it."""
    if not (cfg.warm.rehearse and _rehearsed(cfg)):
        with torch.device("meta"):  # the first model build pays one-time costs: pay them now
            Transformer(cfg.model)
        if cfg.parallelism.fp8 != "none":
            import_fp8()
    plan = spare_assignment()
    return ExitCode.CLEAN if plan is None else run_worker(cfg, plan)


def _rehearsed(cfg: JobConfig) -> bool:
    """A step rehearsed as this spare's local rank of the largest world its launcher may
    join (:mod:`llmtrain.spare_rehearsal`)."""
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world_size = (int(os.environ.get("LLMTRAIN_MAX_NODES", "1"))
                      * int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:  # not set by a launcher of llmtrain's: no world to rehearse in
        return False
    return rehearse(cfg, world_size, local_rank, local_rank) is not None
