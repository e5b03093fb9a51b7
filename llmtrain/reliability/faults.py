"""Fault injection for tests and chaos runs: real failures at named points of a real run.

A spec (config ``reliability.faults``, or the environment variable ``LLMTRAIN_FAULTS``,
both applied) lists faults separated by ``;``::

    ACTION@POINT[:key=value,...]

    kill@step:rank=1,step=7                SIGKILL rank 1 as it starts step 7
    kill@checkpoint_write:rank=0,step=10   SIGKILL rank 0 while it writes checkpoint 10
    hang@step:rank=1,step=5                rank 1 stops in Python (sleeps for ever)
    sigstop@step:rank=1,step=5             rank 1 SIGSTOPs itself, watchdog thread and all
    desync@step:rank=1,step=5              every rank joins an extra collective at step 5:
                                           rank 1 an all_gather, the others an all_reduce
    desync_size@step:rank=1,step=5         the same, all ranks all_reduce, rank 1 a larger
                                           tensor (gloo aborts on that unless
                                           reliability.desync_debug catches it first)
    slow@step:rank=1,step=5,factor=3       from step 5 on, rank 1's steps take 3 times as
                                           long as its step 4 did

Points: ``step`` (start of a training step), ``checkpoint_write`` (inside a rank's DCP
shard write, in the background writer). Keys: ``rank`` and ``step`` (default: any), and
``restart``: the TorchElastic restart count the fault fires on (default 0, the first
attempt), so a restarted job does not meet the same fault again. ``slow`` also takes
``factor`` and, unlike the others, strikes at every step from ``step`` on.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmtrain.config import ConfigError

ACTIONS = ("kill", "hang", "sigstop", "desync", "desync_size", "slow")
POINTS = ("step", "checkpoint_write")


class FaultSpecError(ConfigError):
    pass


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    rank: int | None = None
    step: int | None = None
    restart: int = 0
    factor: int = 1

    def matches(self, point: str, rank: int, step: int, restart: int) -> bool:
        at = step >= self.step - 1 if self.action == "slow" and self.step else \
            self.step in (None, step)
        return (self.point == point and self.restart == restart
                and self.rank in (None, rank) and at)


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        head, _, args = item.partition(":")
        action, _, point = head.partition("@")
        if action not in ACTIONS or point not in POINTS:
            raise FaultSpecError(f"reliability.faults: {item!r} is not ACTION@POINT, with "
                                 f"ACTION in {ACTIONS} and POINT in {POINTS}")
        keys = {}
        for pair in filter(None, args.split(",")):
            key, _, value = pair.partition("=")
            if key not in ("rank", "step", "restart", "factor") or not value.isdigit():
                raise FaultSpecError(f"reliability.faults: in {item!r}, {pair!r} is not "
                                     f"rank=N, step=N, restart=N or factor=N")
            keys[key] = int(value)
        faults.append(Fault(action, point, **keys))
    return faults


_faults: list[Fault] = []
_rank = 0


def install(spec: str, rank: int) -> None:
    """Arms the faults of ``spec`` and of ``$LLMTRAIN_FAULTS`` for this process."""
    global _rank
    _faults[:] = parse(f"{spec};{os.environ.get('LLMTRAIN_FAULTS', '')}")
    _rank = rank


def point(name: str, step: int) -> None:
    """Called where a fault may strike; does nothing unless one is armed here."""
    if not _faults:
        return
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    for fault in _faults:
        if (fault.action.startswith("desync") and fault.point == name
                and fault.step in (None, step) and fault.restart == restart):
            _desync(target=fault.rank if fault.rank is not None else 0,
                    by_size=fault.action == "desync_size")
        elif fault.matches(name, _rank, step, restart):
            _strike(fault, step)


_started: dict[Fault, float] = {}   # slow faults: when the last full-speed step began
_baseline: dict[Fault, float] = {}  # and how long it took


def _strike(fault: Fault, step: int) -> None:
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "hang":
        while True:
            time.sleep(3600)
    elif fault.action == "slow":
        if step == fault.step - 1:
            _started[fault] = time.perf_counter()
        elif fault not in _baseline:
            _baseline[fault] = time.perf_counter() - _started.pop(fault, time.perf_counter())
        if fault in _baseline:
            time.sleep((fault.factor - 1) * _baseline[fault])


def _desync(target: int, by_size: bool) -> None:
    """A collective the ranks disagree on: the target gathers while the others reduce,
    or (``by_size``) reduces a larger tensor."""
    t = torch.ones(16)
    if _rank == target and by_size:
        dist.all_reduce(torch.ones(20))
    elif _rank == target:
        dist.all_gather([torch.empty(16) for _ in range(dist.get_world_size())], t)
    else:
        dist.all_reduce(t)
