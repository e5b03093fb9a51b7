"""One rank's life under torchrun (``llmtrain train``): refuse to run on an excluded node,
train, record how it ended, and tell the agent when a restart would not help."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys

import torch

from llmtrain.config import ConfigError, JobConfig
from llmtrain.data import ShardError
from llmtrain.distributed.failure import abandon
from llmtrain.distributed.process_group import node_name
from llmtrain.events import EventLog
from llmtrain.exit_codes import ExitCode
from llmtrain.model import Transformer
from llmtrain.recovery.coordinator import REPORTED, Resized
from llmtrain.reliability.health.exclusion import excluded_hosts
from llmtrain.reliability.integrity import TrainingDiverged
from llmtrain.trainer import Trainer


def run_worker(cfg: JobConfig, plan: dict | None = None) -> ExitCode:
    """Trains this rank to the end; raises what the trainer raised, after logging it.
    ``plan``: a warm spare's assignment, to take a lost rank's place. When the survivors
    of a lost node shrink (:class:`Resized`), the trainer is built anew in this process at
    the smaller world size: imports, data files and compiled code stay warm."""
    host = node_name()
    if host in (excluded := excluded_hosts(cfg.training.run_dir)):
        print(f"llmtrain: {host} is excluded from this run ({excluded[host]['reason']})",
              file=sys.stderr)
        stop_agent(ExitCode.EXCLUDE_NODE)
        return ExitCode.EXCLUDE_NODE
    # what was made since the CLI froze its imports (a spare's first model build): no
    # full collection in the start and resume scans it
    gc.freeze()
    held = None
    while True:
        trainer = _start(cfg, plan, held, host)
        # What the start made (the model, its state) lives as long as the trainer, as
        # torch's modules do: the cyclic collector need not scan it in each full
        # collection while training, nor at exit, where that took 0.75 s of a 2-step
        # run's 4.4.
        gc.freeze()
        try:
            code = _train(trainer, host)
        except Resized as shrunk:
            plan, held = shrunk.assignment, shrunk.held
            # LOCAL_RANK (its GPU) stays: a shrink drops whole nodes, a grow adds them
            os.environ.update(place(plan))
            del trainer, shrunk
            gc.unfreeze()  # the old trainer's model and optimizer hold cycles: freed here
            gc.collect()
            continue
        stop_agent(code)
        return code


def _start(cfg: JobConfig, plan: dict | None, held: dict | None, host: str) -> Trainer:
    try:
        return Trainer(cfg, plan, held)
    except (ConfigError, ShardError) as e:
        events = EventLog(cfg.training.run_dir, int(os.environ.get("RANK", 0)))
        events.emit("fatal", host=host, error=f"{type(e).__name__}: {e}")
        events.close()  # written before the agent is stopped (and stops this process)
        stop_agent(ExitCode.FATAL)
        raise
    except BaseException:
        abandon()  # a start that failed once the group existed (a resume that failed)
        raise


def _train(trainer: Trainer, host: str) -> ExitCode:
    """Runs ``trainer`` to its end and closes it; its exit code."""
    failed = True  # until run() returns: only then are the process groups known healthy
    try:
        trainer.run()
        failed = False
    except Resized:
        raise  # the warm path reported it, and goes on in this process
    except TrainingDiverged as e:  # a restart would diverge the same way
        trainer.events.emit("fatal", host=host, step=trainer.step, error=f"{type(e).__name__}: {e}")
        stop_agent(ExitCode.FATAL)
        raise
    except BaseException as e:
        # The first sign of a failure elsewhere (a dead peer breaks our collective): the
        # start of the recovery clock, unless the warm path reported it already.
        if REPORTED not in getattr(e, "__notes__", ()):
            trainer.events.emit("failure", step=trainer.step,
                                error=f"{type(e).__name__}: {e}"[:500])
        raise
    finally:
        trainer.close(failed)
    return trainer.exit_code


def run_spare(cfg: JobConfig) -> ExitCode:
    """A warm spare (``llmtrain spare``, started by a standby ``llmtrain launch``, which
    holds its place in the job's pool): torch and llmtrain already imported, it waits for
    the plan that assigns it a lost rank (one JSON line on stdin), then trains in that
    rank's place. CLEAN if its input ends first: the job no longer needs it warm."""
    if "LLMTRAIN_RDZV_ENDPOINT" not in os.environ:
        raise ConfigError("llmtrain spare needs the rendezvous store's address in "
                          "LLMTRAIN_RDZV_ENDPOINT (run it under llmtrain launch --standby)")
    with torch.device("meta"):  # the first model build pays one-time costs: pay them now
        Transformer(cfg.model)
    if "LLMTRAIN_SPARE_READY_FD" in os.environ:  # the launcher puts it in the pool now
        with open(int(os.environ["LLMTRAIN_SPARE_READY_FD"]), "w") as ready:
            ready.write("ready\n")
    line = sys.stdin.readline()
    if not line:
        return ExitCode.CLEAN
    plan = json.loads(line)
    per_node = plan["local_world_size"]
    # its place on a node, as torchrun numbers a node's workers: the spares of one standby
    # host that take a node's ranks (a grow, a lost node) each take their own GPU
    os.environ.update(place(plan), LOCAL_RANK=str(plan["rank"] % per_node),
                      LOCAL_WORLD_SIZE=str(per_node))
    return run_worker(cfg, plan)


def place(plan: dict) -> dict[str, str]:
    """The environment that names the rank ``plan`` assigns: its rank, the world's size
    and its node's number."""
    return {"RANK": str(plan["rank"]), "WORLD_SIZE": str(plan["world_size"]),
            "GROUP_RANK": str(plan["rank"] // plan["local_world_size"])}


def stop_agent(code: int) -> None:
    """After a FATAL or EXCLUDE_NODE exit, stops this node's torchrun agent, which would
    otherwise restart the workers into the same failure."""
    if code not in (ExitCode.FATAL, ExitCode.EXCLUDE_NODE) or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restarts < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
        os.kill(os.getppid(), signal.SIGTERM)
