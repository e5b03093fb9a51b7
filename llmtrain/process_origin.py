"""Which process a rank is to its node: torchrun's child, or a prepared worker that child
handed itself over to (:mod:`llmtrain.launch.prepared`).

A prepared worker was started, and imported torch and llmtrain, before its attempt began;
torchrun's child is then a small hand-off process that passes it the attempt and waits for
its exit. Three things a rank asks about its own process answer for the hand-off instead:
which process its agent supervises (the identity the warm path knows it by), which process
is its agent (stopped after a FATAL exit), and when it started (the start-up timeline's
launch and imports end at the hand-off, not at the prepared worker's own start). Outside a
hand-off each answers for this process, as before."""

from __future__ import annotations

import os
import signal
from pathlib import Path

# set by a prepared worker as it is handed an attempt
HOLDER_PID_ENV = "LLMTRAIN_HOLDER_PID"      # torchrun's child (the hand-off process)
AGENT_PID_ENV = "LLMTRAIN_AGENT_PID"        # torchrun's agent
HANDED_OVER_ENV = "LLMTRAIN_HANDED_OVER_AT"  # unix time of the hand-off
PREPARED_DIR_ENV = "LLMTRAIN_PREPARED_DIR"  # where a node's prepared workers listen


def holder_pid() -> int:
    """The process torchrun's agent supervises for this rank."""
    return int(os.environ.get(HOLDER_PID_ENV) or os.getpid())


def agent_pid() -> int:
    """This rank's torchrun agent (this process's parent outside a hand-off)."""
    return int(os.environ.get(AGENT_PID_ENV) or os.getppid())


def handed_over_at() -> float | None:
    """When a prepared worker was handed this attempt; None for a process started for it."""
    at = os.environ.get(HANDED_OVER_ENV)
    return float(at) if at else None


def handed_over_pid(holder: int) -> int | None:
    """The prepared worker that a hand-off process ``holder`` of this node passed its
    attempt to, if any (the hand-off records it in the node's prepared-workers folder)."""
    folder = os.environ.get(PREPARED_DIR_ENV)
    if not folder:
        return None
    try:
        return int((Path(folder) / f"{holder}.worker").read_text())
    except (OSError, ValueError):
        return None


def waiting_file(folder: str, pid: int) -> Path:
    """The file by which a prepared worker ``pid`` that waits for its attempt (with its
    CUDA context made, on a GPU node) is known in its node's folder ``folder``."""
    return Path(folder) / f"{pid}.waiting"


def waiting_workers() -> set[int]:
    """This node's prepared workers that wait for an attempt (their PIDs): processes of
    the job's own on its GPUs, not strays."""
    folder = os.environ.get(PREPARED_DIR_ENV)
    if not folder:
        return set()
    return {int(p.stem) for p in Path(folder).glob("*.waiting") if p.stem.isdigit()}


def kill_holder(holder: int) -> None:
    """SIGKILL to a rank's supervised process group ``holder`` (torchrun starts each worker
    as a group's leader) and to the prepared worker it handed its attempt to: that one
    lives in its launcher's session, out of the group's reach, and a stopped one could not
    see its hand-off die."""
    worker = handed_over_pid(holder)
    for kill, pid in ((os.killpg, holder), (os.kill, worker)):
        if pid is not None:
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it died by itself meanwhile
                pass
