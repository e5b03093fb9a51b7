"""Where this process stands in the job before (and after) its session: a warm spare's
wait for the lost rank it takes, the environment that names a rank, a node excluded from
the run refusing to start, and the torchrun agent stopped after an exit that a restart
would only repeat."""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
from datetime import timedelta

from llmtrain.config import ConfigError
from llmtrain.distributed.process_group import node_name
from llmtrain.exit_codes import ExitCode
from llmtrain.process_origin import agent_pid
from llmtrain.recovery.presence import hold_presence
from llmtrain.recovery.roll_call import owner
from llmtrain.reliability.health.exclusion import excluded_hosts

log = logging.getLogger(__name__)

# what a launcher sets in a warm spare's environment (llmtrain launch --standby)
SPARE_ENV = "LLMTRAIN_SPARE"


def place(plan: dict) -> dict[str, str]:
    """The environment that names the rank ``plan`` assigns: its rank, the world's size
    and its node's number."""
    return {"RANK": str(plan["rank"]), "WORLD_SIZE": str(plan["world_size"]),
            "GROUP_RANK": str(plan["rank"] // plan["local_world_size"])}


# What the first model build of a process imports on first use, which a spare imports
# while it waits instead: FSDP2's fully_shard turns each parameter into a DTensor under
# torch._disable_dynamo, whose first call imports torch._dynamo (0.57 s of the CNN
# example's 0.59 s first build here; a survivor's rebuild takes 3 ms). Paid at the
# assignment, it was most of every recovery's group formation.
SPARE_IMPORTS = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
                 "torch.distributed.checkpoint")


def spare_assignment() -> dict | None:
    """A warm spare's wait (a process a standby ``llmtrain launch`` started, which holds
    its place in the job's pool): imports what a first model build would
    (``SPARE_IMPORTS``), says it is ready, then waits for the plan that assigns it a lost
    rank (one JSON line on stdin) and takes that rank's place in its environment. None
    when its input ends first: the job no longer needs it."""
    if "LLMTRAIN_RDZV_ENDPOINT" not in os.environ:
        raise ConfigError("a warm spare needs the rendezvous store's address in "
                          "LLMTRAIN_RDZV_ENDPOINT (run it under llmtrain launch --standby)")
    for name in SPARE_IMPORTS:
        importlib.import_module(name)
    # held from now on, for the process's life: a spare that dies waiting leaves the
    # pool at once (llmtrain.recovery.pool.withdraw), and one holding a rank is known gone
    budget_s = float(os.environ.get("LLMTRAIN_WARM_BUDGET_S", "30"))
    hold_presence(owner(), timedelta(seconds=budget_s))
    if "LLMTRAIN_SPARE_READY_FD" in os.environ:  # the launcher puts it in the pool now
        with open(int(os.environ.pop("LLMTRAIN_SPARE_READY_FD")), "w") as ready:
            ready.write("ready\n")
    line = sys.stdin.readline()
    if not line:
        return None
    plan = json.loads(line)
    per_node = plan["local_world_size"]
    # its GPU: the one its launcher gave it (one spare per device of a standby node, so
    # that two spares of a node never share one, whatever ranks they take), or where
    # torchrun would put the rank
    local = os.environ.get("LOCAL_RANK", str(plan["rank"] % per_node))
    os.environ.update(place(plan), LOCAL_RANK=local, LOCAL_WORLD_SIZE=str(per_node))
    os.environ.pop(SPARE_ENV, None)
    return plan


def stop_agent(code: int) -> None:
    """After a FATAL or EXCLUDE_NODE exit, stops this node's torchrun agent, which would
    otherwise restart the workers into the same failure."""
    if code not in (ExitCode.FATAL, ExitCode.EXCLUDE_NODE) or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restarts < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
        os.kill(agent_pid(), signal.SIGTERM)


def refuse_if_excluded(run_dir: str) -> None:
    """Exits EXCLUDE_NODE (and stops this node's torchrun agent) when this node was
    excluded from the run earlier (a failed GPU, a corrupted replica): a restart of its
    workers must not bring it back."""
    host = node_name()
    if host in (excluded := excluded_hosts(run_dir)):
        log.error("llmtrain: %s is excluded from this run (%s)", host, excluded[host]["reason"])
        stop_agent(ExitCode.EXCLUDE_NODE)
        raise SystemExit(ExitCode.EXCLUDE_NODE)
