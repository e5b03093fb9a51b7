"""Run control: what every rank must decide together, and how this rank's run ends.

Time, signals, a failed GPU and ``llmtrain stop`` are seen by one rank at a time; acting
on them alone would leave the others blocked in the next collective until the watchdog
fires. So ranks agree on them with a small all-reduce on a gloo group of their own, cast
about every ``control.vote_interval_s``, not every step: at thousands of ranks a gloo
all-reduce takes a sizable share of a second. Each vote runs in the background until the
next is due, where it is decided identically on every rank, so a signal or a failed GPU
is acted on within two intervals. A vote also carries each rank's count of steps in the
interval (from the time of its steps that trained: skipped ones say nothing of the pace),
and the largest is the next interval, the same for all; it at most doubles from one vote
to the next, so the interval stays within a few ``vote_interval_s`` when the pace changes. This works with checkpointing on or off: a save by time is one of the flags, and so is
a grow (rank 0 saw a spare waiting while the job runs below its size: every rank then
takes it in at the same step).

The outcome is the exit code the launcher acts on: EXCLUDE_NODE for the rank whose
hardware failed, RETRYABLE for ranks stopped early (a signal, a peer's failure, a named
replica), CLEAN otherwise.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from llmtrain.config import ControlConfig
from llmtrain.events import EventLog
from llmtrain.exit_codes import ExitCode
from llmtrain.reliability.health.exclusion import exclude_host
from llmtrain.reliability.health.monitor import HealthWatch
from llmtrain.stop_request import StopRequestWatch, clear_request

# How long ranks stopped by a peer's failed health check wait before exiting, so the
# launcher sees the failed node's EXCLUDE_NODE before our RETRYABLE.
log = logging.getLogger(__name__)

PEER_STOP_GRACE_S = 2.0


@dataclass
class Verdict:
    """What the ranks decided at a step: save by time, and stop (then save first)."""
    save_by_time: bool = False
    stop: bool = False
    grow: bool = False  # a spare waits and the job runs below its size: take it in now
    preempt: bool = False  # the stop is a signal's (a preemption), not a request's


class RunControl:
    def __init__(self, cfg: ControlConfig, group: dist.ProcessGroup, *, run_dir: str,
                 rank: int, host: str, events: EventLog, health: HealthWatch,
                 can_grow: Callable[[], bool] = lambda: False):
        """``health``: the monitor whose first fatal finding makes this rank vote to stop;
        ``can_grow``: asked on rank 0 at each vote it casts, whether the job may grow now."""
        self.cfg, self.run_dir, self.rank, self.host = cfg, run_dir, rank, host
        self.events, self.health = events, health
        self.can_grow = can_grow if rank == 0 else lambda: False
        # one look-out is enough: the ranks vote on what it saw
        self.requests = StopRequestWatch(run_dir).start() if rank == 0 else None
        self._signal: int | None = None
        if cfg.save_on_signal:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._on_signal)
        self.excluded = False
        self._excluding = threading.Lock()
        self.preempted = False  # stopped by a signal or a peer: a restart goes on
        self._finishing = False  # stopped on a request: the run ends here
        self.stopped_by_peer = False
        self._sdc_named: list[int] = []  # ranks whose replica or arithmetic diverged
        self.bind(group)

    def bind(self, group: dist.ProcessGroup) -> None:
        """The vote's own gloo group (``side_group``, formed with the job's process group
        at start and in each new generation after a warm recovery), lent also to the
        training thread's other agreements: checkpoint decisions, the snapshot interval."""
        self.group = group
        self.vote_in_flight: tuple[dist.Work, torch.Tensor] | None = None
        self.every = 1  # steps between votes, agreed by the last one
        self.cast: tuple[int, float] | None = None  # the step and time the last was cast
        self.voted_stop = False  # this rank has voted to stop
        self._worked = (0, 0.0)  # steps that trained since the last cast, and their time
        self._last_call: float | None = None

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum

    def signalled(self) -> bool:
        """Whether this rank received a preemption's signal (SIGTERM, SIGUSR1)."""
        return self._signal is not None

    def stopped_on_request(self) -> bool:
        """Whether the ranks stopped on a stop request (``llmtrain stop``): the run ends
        here, not to be restarted."""
        return self._finishing

    def named_corrupt(self) -> bool:
        """Whether ranks were named for silent data corruption (:meth:`name_corrupt`):
        every rank stops, to restart without the named one's node."""
        return bool(self._sdc_named)

    # -- at the end of every step ----------------------------------------------------

    def unhealthy(self, step: int) -> bool:
        """Whether this rank's GPU failed a check; its node is excluded at first sight,
        so the record exists however the run ends."""
        fatal = self.health.fatal_finding()
        with self._excluding:  # the training thread and the health monitor's
            if fatal is not None and not self.excluded:
                self.exclude_node(fatal.sentence(), step, findings=[asdict(fatal)])
        return fatal is not None

    def vote(self, step: int, *, time_due: bool, idle: bool = False) -> Verdict:
        """Decides the vote cast one interval ago (if due at ``step``) and casts the next:
        ``time_due``: this rank's clock says a save by time is due; ``idle``: the step
        trained nothing (a skipped batch), so its time says nothing of the pace."""
        self._time_step(idle)
        if self.cast is not None and self.cast[0] < step < self.cast[0] + self.every:
            return Verdict()  # (a rollback that went back before the vote decides it)
        by_time = by_signal = by_vote = by_request = grow = False
        if self.vote_in_flight is not None:
            work, flags = self.vote_in_flight
            work.wait()
            by_time, by_signal, by_vote, by_request, grow = (bool(f) for f in flags[:5])
            self.every = int(flags[5])
        unhealthy = self.unhealthy(step)
        request = self.requests and self.requests.request
        flags = torch.tensor([int(time_due and not by_time), int(self._signal is not None),
                              int(unhealthy), int(request is not None),
                              int(not grow and self.can_grow()), self._steps_per_vote(step)])
        stop = by_signal or by_vote or by_request
        self.vote_in_flight = None if stop else (
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flags)
        if by_vote and not self.voted_stop and not by_signal:
            self.stopped_by_peer = True
        if by_signal:
            self.events.emit_once("preempted", step=step,
                                  signal=self._signal or "on another rank")
        if by_request:
            self._finishing = True
            self.events.emit_once("stop_requested", step=step, **(request or {}))
        if by_vote and self.voted_stop:
            self.events.emit("stop_vote", step=step)
        self.voted_stop = self.voted_stop or unhealthy
        self.preempted = self.preempted or (stop and not self._finishing)
        return Verdict(save_by_time=by_time, stop=stop, grow=grow and not stop,
                       preempt=by_signal and not by_request)

    def _time_step(self, idle: bool) -> None:
        """Adds the step just ended (the time since the last call) to the pace, unless it
        was idle: a run of skipped ~1 ms steps must not stretch the interval to thousands
        of steps that then take seconds each, past any preemption grace."""
        now = time.monotonic()
        if not idle and self._last_call is not None:
            self._worked = (self._worked[0] + 1, self._worked[1] + now - self._last_call)
        self._last_call = now

    def _steps_per_vote(self, step: int) -> int:
        """This rank's proposal: the steps in ``vote_interval_s`` at the pace of the steps
        that trained since the last vote it cast; at most twice the interval in force (a
        fast stretch cannot stretch it at once), unchanged when none trained, and 1 until
        there is a pace (or when the interval is 0)."""
        (count, seconds), self._worked = self._worked, (0, 0.0)
        first, self.cast = self.cast is None, (step, time.monotonic())
        if not self.cfg.vote_interval_s or first:
            return 1
        if not count:
            return self.every
        pace = seconds / count
        ideal = int(self.cfg.vote_interval_s / pace) if pace > 0 else 2 * self.every
        return max(1, min(ideal, 2 * self.every))


    # -- how this rank's run ends ----------------------------------------------------

    def exclude_node(self, reason: str, step: int, source: str = "monitor",
                     findings=()) -> None:
        """Takes this node out of the run: its GPU failed a check, or its replica diverged."""
        self.excluded = True
        exclude_host(self.run_dir, self.host, reason, findings=list(findings), rank=self.rank)
        self.events.emit("node_excluded", host=self.host, reason=reason, source=source,
                         step=step)
        log.error("llmtrain: rank %s stops with EXCLUDE_NODE: %s", self.rank, reason)

    def name_corrupt(self, ranks: list[int], reason: str, step: int) -> None:
        """Ranks found computing or holding state unlike their peers': the named one's
        node is excluded, and everyone stops to restart without it."""
        self._sdc_named = ranks
        if self.rank in ranks:
            self.exclude_node(f"{reason} at step {step} (silent data corruption)", step,
                              source="integrity")

    def let_the_failed_exit_first(self) -> None:
        """Ranks stopped for a peer's failed node wait, so that the launcher sees that
        node's EXCLUDE_NODE rather than stopping it in favor of our RETRYABLE."""
        if self.stopped_by_peer or (self._sdc_named and not self.excluded):
            time.sleep(PEER_STOP_GRACE_S)

    def run_ended(self, complete: bool) -> None:
        """A stop request is done with once the run stopped on it, or moot once complete."""
        if self.rank == 0 and (self._finishing or complete):
            clear_request(self.run_dir)

    @property
    def exit_code(self) -> ExitCode:
        if self.excluded:
            return ExitCode.EXCLUDE_NODE
        return ExitCode.RETRYABLE if self.preempted or self._sdc_named else ExitCode.CLEAN

    def close(self, timeout_s: float) -> None:
        """Stops the look-out; a vote in flight is waited for at most ``timeout_s`` (a
        peer that died leaves it pending until the group's timeout)."""
        if self.requests is not None:
            self.requests.close()
        if self.vote_in_flight is not None:
            work, _ = self.vote_in_flight
            deadline = time.monotonic() + timeout_s
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.01)
