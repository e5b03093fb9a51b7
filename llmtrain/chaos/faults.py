"""Fault injection for tests and chaos runs: real failures at named points of a real run.

Training reaches these only through ``llmtrain.fault_points``, and only when a run asks.

A spec (config ``reliability.faults``; with ``reliability.faults = "env"``, the
environment variable ``LLMTRAIN_FAULTS``) lists faults separated by ``;``::

    ACTION@POINT[:key=value,...]

    kill@step:rank=1,step=7                SIGKILL rank 1 as it starts step 7
    kill@checkpoint_write:rank=0,step=10   SIGKILL rank 0 while it writes checkpoint 10
    kill@resume:rank=1                     SIGKILL rank 1 as it starts loading a checkpoint
    hang@step:rank=1,step=5                rank 1 stops in Python (sleeps for ever)
    sigstop@step:rank=1,step=5             rank 1 SIGSTOPs itself, watchdog thread and all
    starve@step:rank=1,step=5,seconds=3    rank 1 keeps its interpreter busy for 3 s, its
                                           lock held: the process runs, its watchdog
                                           thread cannot (a starved rank, not a stopped one)
    desync@step:rank=1,step=5              every rank joins an extra collective at step 5:
                                           rank 1 an all_gather, the others an all_reduce
    desync_size@step:rank=1,step=5         the same, all ranks all_reduce, rank 1 a larger
                                           tensor (gloo aborts on that unless
                                           reliability.desync_debug catches it first)
    slow@step:rank=1,step=5,factor=3       from step 5 on, rank 1's steps take 3 times as
                                           long as its fastest step before did
    nan@loss:rank=1,step=5                 rank 1's loss of step 5 becomes NaN (and so
                                           every rank's gradients)
    bitflip@step:rank=1,step=5,bit=20      rank 1 flips bit 20 of one parameter value of
                                           its shard as step 5 starts (silent corruption)
    badmath@loss:rank=1,step=5             from step 5 on, every loss rank 1 computes is
                                           off by one part in 2**20 (faulty arithmetic)
    eio@retention:step=2                   rank 0's retention pass after the commit of
                                           step 2 fails with EIO (a storage error where no
                                           faultfs mount can make one)
    eio@data_read:rank=1,step=12           rank 1's read of step 12's batch fails with EIO
    error@loss:rank=1,step=12              rank 1's step 12 raises a RuntimeError of its own
                                           (not a collective's: the warm path must replace
                                           rank 1, not its waiting peers)
    bitflip@replica:rank=0                 rank 0 flips a bit of the peer's snapshot replica
                                           it is about to hand to a warm spare
    kill@spare_assigned                    a warm spare dies as soon as it is assigned a
                                           lost rank, before it joins the survivors
    kill@spare_arrived                     a warm spare dies once every member of its
                                           new generation has come, before their group
                                           forms
    hang@process_group                     every rank stops before it joins its process
                                           group (at its start, and in each generation)
    hang@replicate:step=12                 every rank's snapshot replication thread stops
                                           (sleeps for ever) before exchanging its first
                                           snapshot of step 12 or later (a snapshot taken
                                           while the last is still being sent is skipped:
                                           step 12 may be one); once per process, a later
                                           thread replays it cleanly

Points: ``step`` (start of a training step), ``loss`` (each micro-batch's loss),
``replica`` (a buddy about to send a lost rank's snapshot replica to its warm replacement;
``step`` is the snapshot's), ``replicate`` (a rank's replication thread about to exchange
its snapshot of ``step`` with its buddy), ``spare_assigned`` (a warm spare given a lost
rank's place; ``step`` is the snapshot it will restore), ``spare_arrived`` (the same spare
once every member of its generation has come, before their group forms),
``process_group`` (a rank about to join its process group, at its start and in each warm
generation; ``step`` is 0),
``checkpoint_write`` (inside a
rank's DCP shard write, in the background writer), ``resume`` (a verified checkpoint about
to be loaded; ``step`` is the checkpoint's), ``data_read`` (a rank reading its batch of
``step``, on the data reader's thread when it prefetches), ``prepare_shard`` (``llmtrain
data prepare`` about to write a shard; ``step`` counts the shards of its process, from 1).
Keys: ``rank`` and ``step`` (default: any), and ``restart``: the TorchElastic restart
count the fault fires on (default 0, the first attempt), so a restarted job does not meet
the same fault again. ``slow`` also takes ``factor`` and, unlike the others, strikes at
every step from ``step`` on.

Faults can also arrive while the job runs (chaos runs, ``reliability.faults = "env"``):
lines appended to the file named by ``$LLMTRAIN_FAULTS_FILE`` are armed at the next fault
point. Those carry ``id=NAME`` instead of a restart count and strike once per rank across
the whole run, whatever the restarts: a marker ``<file>.fired/NAME.<rank>`` records that
they did.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llmtrain.config import ConfigError

log = logging.getLogger(__name__)

ACTIONS = ("kill", "hang", "sigstop", "starve", "desync", "desync_size", "slow", "nan", "bitflip",
           "badmath", "eio", "error")
POINTS = ("step", "loss", "checkpoint_write", "resume", "prepare_shard", "replica", "replicate",
          "spare_assigned", "spare_arrived", "retention", "data_read", "process_group")


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
    bit: int = 20  # bitflip: which bit of the value (20: a high mantissa bit of a float32)
    seconds: int = 3  # starve: how long
    id: str | None = None  # a fault armed at run time: once per rank, any restart

    def matches(self, point: str, rank: int, step: int, restart: int) -> bool:
        if self.action == "slow":
            at = True  # the steps before ``step`` time the baseline
        elif (self.action == "badmath" or self.point == "replicate") and self.step:
            at = step >= self.step
        else:
            at = self.step in (None, step)
        return (self.point == point and (self.id is not None or self.restart == restart)
                and self.rank in (None, rank) and at)


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        head, _, args = item.partition(":")
        action, _, point = head.partition("@")
        if action not in ACTIONS or point not in POINTS:
            raise FaultSpecError(f"reliability.faults: {item!r} is not ACTION@POINT, with "
                                 f"ACTION in {ACTIONS} and POINT in {POINTS}")
        keys: dict = {}
        for pair in filter(None, args.split(",")):
            key, _, value = pair.partition("=")
            if key == "id" and value.isidentifier():
                keys[key] = value
                continue
            if key not in ("rank", "step", "restart", "factor", "bit", "seconds") \
                    or not value.isdigit():
                raise FaultSpecError(f"reliability.faults: in {item!r}, {pair!r} is not "
                                     f"rank=N, step=N, restart=N, factor=N, bit=N, seconds=N "
                                     f"or id=NAME")
            keys[key] = int(value)
        faults.append(Fault(action, point, **keys))
    return faults


class Injector:
    """The faults armed in one process; ``llmtrain.fault_points`` calls ``point``."""

    def __init__(self, spec: str, rank: int, faults_file: str | None = None):
        self.faults = parse(spec)
        self.rank = rank
        self.faults_file = faults_file
        self._file_mtime: float | None = None
        self._from_file: list[Fault] = []
        self._last: dict[Fault, float] = {}      # slow faults: when the last step began
        self._baseline: dict[Fault, float] = {}  # and their shortest full-speed step
        self._struck: set[Fault] = set()  # nan/bitflip/hang strike once: a replay runs clean

    def _armed_at_run_time(self) -> list[Fault]:
        """The faults of the run-time file, re-read when it changes."""
        if not self.faults_file:
            return []
        try:
            mtime = os.stat(self.faults_file).st_mtime
        except FileNotFoundError:
            return []
        if mtime != self._file_mtime:
            with open(self.faults_file) as f:
                self._from_file = [fault for fault in parse(f.read().replace("\n", ";"))
                                   if fault.id]
            self._file_mtime = mtime
        return self._from_file

    def _first_time(self, fault: Fault) -> bool:
        """Claims a run-time fault for this rank; False if it already struck here."""
        fired = f"{self.faults_file}.fired"
        os.makedirs(fired, exist_ok=True)
        try:
            os.close(os.open(os.path.join(fired, f"{fault.id}.{self.rank}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def point(self, name: str, step: int, target=None):
        """Strikes the faults armed at point ``name`` of ``step``, if any; returns
        ``target``, or the corrupted value that replaces it."""
        faults = self.faults + self._armed_at_run_time()
        if not faults:
            return target
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        for fault in faults:
            if (fault.action.startswith("desync") and fault.point == name
                    and fault.step in (None, step)
                    and (fault.restart == restart if fault.id is None
                         else self._first_time(fault))):
                self._desync(target=fault.rank if fault.rank is not None else 0,
                             by_size=fault.action == "desync_size")
            elif fault.matches(name, self.rank, step, restart) and (
                    fault.id is None or fault.action in ("slow", "badmath")
                    or self._first_time(fault)):
                target = self._strike(fault, step, target)
        return target

    def _strike(self, fault: Fault, step: int, target):
        if fault.action in ("nan", "bitflip", "hang", "starve"):
            if fault in self._struck:
                return target
            self._struck.add(fault)
        if fault.action == "nan":
            return target * float("nan")
        if fault.action == "badmath":
            return target * (1 + 2.0 ** -20)
        if fault.action == "bitflip":
            _flip_bit(target, fault.bit)
        elif fault.action == "eio":
            raise OSError(errno.EIO, f"Input/output error (injected at {fault.point})")
        elif fault.action == "error":
            raise RuntimeError(f"an error of this rank's own (injected at {fault.point})")
        elif fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.action == "starve":
            log.warning("fault: rank %d keeps its interpreter for %d s at %s (step %d)",
                        self.rank, fault.seconds, fault.point, step)
            _starve(fault.seconds)
        elif fault.action == "hang":
            log.warning("fault: rank %d hangs at %s (step %d)", self.rank, fault.point, step)
            while True:
                time.sleep(3600)
        elif fault.action == "slow":
            # The baseline is the shortest full-speed step this injector saw before
            # ``step`` (without ``step``: its first), not only the step before: one step
            # slowed by the machine's load made the factor larger for the whole run.
            now = time.perf_counter()
            full_speed = fault.step is not None and step <= fault.step  # the last step was
            if fault in self._last and (full_speed or fault not in self._baseline):
                took = now - self._last[fault]
                self._baseline[fault] = min(took, self._baseline.get(fault, took))
            if fault in self._baseline and (fault.step is None or step >= fault.step):
                time.sleep((fault.factor - 1) * self._baseline[fault])
            self._last[fault] = time.perf_counter()
        return target

    def _desync(self, target: int, by_size: bool) -> None:
        """A collective the ranks disagree on: the target gathers while the others reduce,
        or (``by_size``) reduces a larger tensor."""
        device = collective_device(dist.get_backend())
        t = torch.ones(16, device=device)
        if self.rank == target and by_size:
            dist.all_reduce(torch.ones(20, device=device))
        elif self.rank == target:
            dist.all_gather([torch.empty(16, device=device)
                             for _ in range(dist.get_world_size())], t)
        else:
            dist.all_reduce(t)


def _starve(seconds: float) -> None:
    """Busy for ``seconds`` with the interpreter's lock held (a switch interval longer than
    that: no other thread of the process gets it), as a long call that keeps the lock, or a
    machine with more work than cores, starves a rank's watchdog thread."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 1)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(before)


def collective_device(backend: str) -> torch.device:
    """Where a tensor must live to go through a group of ``backend``: NCCL takes only this
    rank's GPU (a CPU tensor raises at once, where a desync was wanted); gloo, the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _flip_bit(model: torch.nn.Module | torch.Tensor, bit: int) -> None:
    """Flips ``bit`` of the middle value of this rank's largest parameter shard (or of a
    byte buffer: a snapshot replica), in place: memory that changed under the program, as
    a bad DRAM cell or a cosmic ray does."""
    if isinstance(model, torch.Tensor):
        model[model.numel() // 2] ^= 1 << (bit % 8)
        return
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    shard = max(shards, key=lambda t: t.numel()).detach()
    ints = shard.view(-1).view({2: torch.int16, 4: torch.int32}[shard.element_size()])
    ints[ints.numel() // 2] ^= 1 << bit
