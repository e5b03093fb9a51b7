"""What a node launcher starts: its workers' command line (under torchrun's agent, or a
warm spare's), their environment, the scheduler's signals passed on to them, and the
processes they started in turn."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from llmtrain.config import JobConfig
from llmtrain.distributed.nccl_env import warm_worker_env
from llmtrain.launch.config import LaunchConfig
from llmtrain.launch.template import Process


def torchrun_command(lc: LaunchConfig, train_args: list[str], warm: bool = False,
                     prepared: str | None = None, after_go: bool = False) -> list[str]:
    """torchrun's command line, through llmtrain's agent (``llmtrain.launch.agent``:
    ``warm``, the one that lets the warm path replace a dead worker); ``prepared``: the
    folder of the node's prepared workers, which take each attempt's work; ``after_go``:
    the agent imports, then waits for a line ``go`` on its stdin before it joins (a
    standby's)."""
    conf = (f"join_timeout={lc.join_timeout_s:.0f},last_call_timeout={lc.last_call_timeout_s:.0f},"
            f"keep_alive_interval=2,keep_alive_max_attempt=3")
    if lc.external_store:
        conf += ",is_host=0"
    return [sys.executable, "-m", "llmtrain.launch.agent", *(["--warm"] if warm else []),
            *(["--after-go"] if after_go else []),
            f"--nnodes={lc.nnodes}",
            f"--nproc-per-node={lc.nproc_per_node}", f"--max-restarts={lc.max_restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={lc.rdzv_endpoint}",
            f"--rdzv-id={lc.rdzv_id}", f"--rdzv-conf={conf}",
            f"--monitor-interval="
            f"{lc.warm_monitor_interval_s if warm else lc.monitor_interval_s:g}",
            *_entry(lc, prepared), *train_args]


def _entry(lc: LaunchConfig, prepared: str | None) -> list[str]:
    """torchrun's worker command: the worker's, or the hand-off to a prepared worker in
    folder ``prepared`` (:mod:`llmtrain.launch.handoff`, started as a bare python)."""
    if prepared is None:
        return worker_command(lc)[1:]
    from llmtrain.launch.prepared import HANDOFF
    return ["--no-python", sys.executable, "-I", "-S", HANDOFF, prepared,
            *worker_command(lc)[1:]]


def worker_command(lc: LaunchConfig) -> list[str]:
    """A worker's command, before its arguments: the user's script, or llmtrain's own
    trainer (``llmtrain train``)."""
    return [sys.executable, lc.script] if lc.script else [sys.executable, "-m", "llmtrain", "train"]


def worker_env(cfg: JobConfig, lc: LaunchConfig, host: str) -> dict[str, str]:
    """The environment of this node's workers (torchrun's agent passes it on) or of its
    warm spare. With the warm path on, the process-group settings it needs are set where
    the user has not set them (:func:`llmtrain.distributed.failure.warm_worker_env`)."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LLMTRAIN_HOST": host,
           "LLMTRAIN_RDZV_ID": lc.rdzv_id, "LLMTRAIN_WARM_BUDGET_S": str(cfg.warm.budget_s),
           "LLMTRAIN_RUN_DIR": cfg.training.run_dir,  # where the agent reports to
           # how far a warm shrink and grow may go
           "LLMTRAIN_MIN_NODES": str(lc.node_range[0]),
           "LLMTRAIN_MAX_NODES": str(lc.node_range[1])}
    if not lc.rdzv_endpoint.endswith(":0"):  # port 0: the agent picks one we cannot know
        env["LLMTRAIN_RDZV_ENDPOINT"] = lc.rdzv_endpoint  # the watchdogs meet there
    if cfg.warm.enable and "LLMTRAIN_RDZV_ENDPOINT" in env:
        warm_worker_env(env)
    return env


def forward_signals(procs: list[Process]) -> list[int]:
    """A scheduler's SIGTERM (preemption, scancel) or USR1 goes on to ``procs`` (the agent,
    which passes it to the workers, or a standby node's warm spares, a list they are added
    to as they start): they save, then exit RETRYABLE. Slurm signals every process of a
    step itself, so there it is not passed on a second time. Returns the signals
    received, as they come."""
    received: list[int] = []

    def forward(signum, _frame) -> None:
        received.append(signum)
        for proc in procs:
            proc.send_signal(signum)
    if "SLURM_STEP_ID" not in os.environ:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, forward)
    return received


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout.split()
    return [int(p) for p in out]
