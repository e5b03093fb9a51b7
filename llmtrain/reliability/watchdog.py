"""Hang watchdog: heartbeats, detection, a flight-recorder dump on every live rank, a
verdict, and a retryable exit.

The training thread only stamps its progress (``beat``: three attribute writes). A thread
per rank does the rest through its own store connection (the rendezvous store under
``llmtrain launch``, which no worker hosts; see ``open_store``), never through a process
group (which may be the thing that is stuck):

- every ``heartbeat_interval_s`` it publishes the rank's progress; a rank that has been
  quiet (no progress) for a few of its usual gaps between beats also publishes where it is
  in each process group, read from its flight recorder (the newest collective it entered:
  sequence number, op, sizes, dtypes, whether it is still inside and for how long, the
  collective's usual duration), and beats four times as often. Heartbeats are reduced per
  node and then across nodes (:mod:`llmtrain.reliability.heartbeats`), so that rank 0 reads
  one summary per node;
- rank 0 judges those: ranks inside the same collective of a group with different calls
  are a desync, declared at once (about two seconds after it happens); ranks waiting in
  collective #N longer than ``not_arrived_factor`` times its usual duration while a quiet
  rank of the group has entered only earlier ones name that rank as not arrived, at once;
- it declares a hang when its own rank made no progress for the hang timeout, or when a
  watched rank's heartbeat is older than that (a rank stopped whole, e.g. SIGSTOP):
  rank 0 watches every rank, rank 1 watches rank 0. The timeout is learned from the run:
  once it has shown its pace, ``hang_timeout_step_factor`` times its slowest recent step,
  kept within [``hang_timeout_floor_s``, ``hang_timeout_s``]; a rank in a declared long
  phase (start-up, resume, a blocking save, rank 0 reading the event log) counts itself in
  the store's ``long_phases`` (one count per membership of the job), and ranks waiting for
  it wait ``phase_timeout_s``;
- the first rank to declare one claims the event in the store and becomes its leader;
  every rank seeing the event dumps its flight-recorder entries and Python stacks to
  ``<run dir>/diagnostics/<event>/rank-N.json``; the leader waits for the dumps (up to
  ``dump_timeout_s``), analyzes them (:mod:`llmtrain.reliability.flightrec`), writes
  ``report.md`` and ``report.json`` and an event, and every rank exits RETRYABLE so the
  launcher restarts the job from its last checkpoint;
- with the warm path on, a hang whose report names its stuck ranks goes warm instead: the
  leader has their agents kill them (:func:`llmtrain.recovery.eviction.evict`), every other
  rank stays, its stuck collective fails as the peer's connections close, and the warm
  path replaces the killed ranks with spares. A rank whose agent does not answer (its
  node cut off from the network) is marked gone by the leader, and every other rank shuts
  its own ends of the connections to it (:mod:`llmtrain.recovery.sockets`). A desync
  or a failed collective goes cold (a replay would meet the same fault).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from llmtrain.config import ReliabilityConfig
from llmtrain.distributed.flight_recorder import flight_recorder, thread_stacks
from llmtrain.distributed.process_group import open_store
from llmtrain.events import EventLog
from llmtrain.exit_codes import ExitCode
from llmtrain.fsio import join, makedirs, write_atomic
from llmtrain.reliability import flightrec
from llmtrain.recovery import sockets
from llmtrain.reliability.heartbeats import (ControlPlane, World, awaited, positions, silence,
                                             summarize, verdict)
from llmtrain.reliability.liveness import HOST, beat_fields

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from llmtrain.recovery.interface import Evict
    from llmtrain.recovery.fence import Fence

# Steps a run must show before its hang timeout is learned from their pace, and how many
# recent ones that pace is taken from.
_LEARN_AFTER_STEPS, _RECENT_STEPS = 3, 100


def configure_diagnostics(cfg: ReliabilityConfig, run_dir: str) -> None:
    """Turns the collective flight recorder on (gloo and NCCL) before any group exists,
    and PyTorch's cross-rank collective check with ``desync_debug``; NCCL's own dump on a
    timeout goes to the run's diagnostics when that is a local path. Settings already in
    the environment win."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(cfg.flight_recorder_entries))
    if cfg.desync_debug:
        os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
        dist.set_debug_level_from_env()  # read once at import; it happened already
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if "://" not in run_dir:
        target = os.path.join(run_dir, "diagnostics", "nccl-timeout")
        makedirs(target)
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(target, "rank-"))


@contextlib.contextmanager
def _diagnosing(watchdog):
    """A collective that fails PyTorch's desync check is diagnosed like a hang."""
    try:
        yield
    except RuntimeError as e:
        if "mismatch between collectives" not in str(e):
            raise
        watchdog.collective_failed(e)


class WatchdogLike(Protocol):
    """This rank's hang watchdog as the session and its components use it, on
    (:class:`Watchdog`) or off (:class:`NoWatchdog`): see :func:`start_watchdog`."""

    def diagnosing(self) -> contextlib.AbstractContextManager:
        """Around a step: a desync PyTorch detects becomes the watchdog's diagnosis."""

    def start(self) -> None: ...

    def beat(self, step: int, phase: str, long: bool = False) -> None:
        """Progress from the training thread: ``phase`` of ``step``."""

    def new_generation(self) -> None: ...

    def collective_failed(self, error: BaseException) -> None: ...

    def slowdowns(self) -> dict[int, float]:
        """Rank 0's latest estimate of the slowest ranks (rank -> slowdown)."""

    def close(self) -> None: ...


class NoWatchdog:
    """``reliability.watchdog = false``: nothing watches, a desync is raised as it is."""

    def diagnosing(self) -> contextlib.AbstractContextManager:
        return _diagnosing(self)

    def start(self) -> None:
        pass

    def beat(self, step: int, phase: str, long: bool = False) -> None:
        pass

    def new_generation(self) -> None:
        pass

    def collective_failed(self, error: BaseException) -> None:
        raise error

    def slowdowns(self) -> dict[int, float]:
        return {}

    def close(self) -> None:
        pass


class Watchdog:
    def __init__(self, cfg: ReliabilityConfig, store: dist.Store, run_dir: str,
                 events: EventLog, rank: int, world_size: int, local_world_size: int = 0,
                 on_exit: Callable[[], None] = lambda: None,
                 evict: Evict | None = None, fence: Fence | None = None):
        """``local_world_size``: ranks per node, whose heartbeats a node leader reduces
        (0: the world is one node). ``on_exit``: called before this rank leaves for a cold
        restart. ``evict(ranks, via)``: has stuck ranks leave for the warm path to replace them
        (``via``: this thread's connection to the store, so none other is opened),
        returning those cut off from the store with their connection ends (None: every
        hang goes cold). ``fence``: asked at every tick whether this rank was replaced
        (then the process ends)."""
        self.cfg, self.store, self.events = cfg, store, events
        self.on_exit, self.evict, self.fence = on_exit, evict, fence
        self.rank, self.world_size = rank, world_size
        self.plane = ControlPlane(store, rank, world_size, local_world_size,
                                  cfg.heartbeat_interval_s)
        # a watchdog starts with its rank's groups, every member's formed (a spare's, once
        # the survivors left the old ones): what was published before is of another generation
        self.plane.since_ns = time.time_ns()
        self.diagnostics = join(run_dir, "diagnostics")
        self.step, self.phase = 0, "start-up"
        self.limit: float | None = cfg.phase_timeout_s  # start-up is a long phase
        self.progress = self._step_began = time.monotonic()
        self.recent_steps: deque[float] = deque(maxlen=_RECENT_STEPS)
        self.recent_gaps: deque[float] = deque(maxlen=_RECENT_STEPS)  # between beats
        self._counted_long = False  # whether this rank counts in the store's long_phases
        self._long_counted_in = ""  # the key it counts in (_long_key)
        self._store_out = False  # a tick failed: the store may have been out
        # this rank's own waits count from here (monotonic, and wall-clock ns): the end of
        # this process's last pause, or of the store's last long stall (_judge_from_now)
        self._judged_from, self._judged_from_ns = 0.0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._responding = threading.Lock()  # one response per process, whoever starts it
        self.error: str | None = None
        self._generation_ns = 0  # when this generation's groups began (new_generation)
        self._next_window = time.monotonic() + cfg.straggler_window_s
        self._streaks: dict[int, int] = {}  # windows running a rank was slow
        # Rank 0's latest estimate of the slowest ranks; ranks that were among them and are
        # no longer are shown at the median.
        self._slowdowns: dict[int, float] = {}
        # silent ranks seen starved, by the step and phase of their last beat (one event each)
        self._starved: dict[int, tuple[int, str]] = {}

    def diagnosing(self) -> contextlib.AbstractContextManager:
        """Around a step: a desync PyTorch detects becomes this watchdog's diagnosis."""
        return _diagnosing(self)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="llmtrain-watchdog",
                                        daemon=True)
        self._thread.start()

    def beat(self, step: int, phase: str, long: bool = False) -> None:
        """Progress from the training thread (a few attribute writes): ``phase`` is what
        the rank does now in ``step``; "step" means the step just ended. ``long`` declares
        a phase that cannot beat (resume, a blocking save): until the next step ends, the
        hang timeout is ``phase_timeout_s``, as it is from start-up to the first step."""
        now = time.monotonic()
        if self.limit is None:
            self.recent_gaps.append(now - self.progress)
        if phase == "step":
            if self.limit is None:
                self.recent_steps.append(now - self._step_began)
            self._step_began = now
            self.limit = None
        elif long:
            self.limit = self.cfg.phase_timeout_s
        self.step, self.phase, self.progress = step, phase, now

    @property
    def timeout(self) -> float:
        """``hang_timeout_s`` until the run has shown its pace, then the learned timeout. A
        heartbeat silent this long is a stopped or dead rank, whatever phase it was in."""
        c = self.cfg
        if not c.hang_timeout_step_factor or len(self.recent_steps) < _LEARN_AFTER_STEPS:
            return c.hang_timeout_s
        learned = c.hang_timeout_step_factor * max(self.recent_steps)
        return min(c.hang_timeout_s, max(c.hang_timeout_floor_s, learned))

    @property
    def quiet(self) -> bool:
        """No progress for three of the usual gaps between beats (half a heartbeat interval
        at least): the rank may be waiting in a collective that will not finish."""
        if self.limit is not None or not self.recent_gaps:
            return False
        usual = max(self.cfg.heartbeat_interval_s / 2, 3 * max(self.recent_gaps))
        return time.monotonic() - self.progress > usual

    @property
    def progress_timeout(self) -> float:
        """How long this rank may go without progress: more in a declared long phase."""
        return self.timeout if self.limit is None else max(self.timeout, self.limit)

    def slowdowns(self) -> dict[int, float]:
        """Rank 0's latest estimate of the slowest ranks (rank -> how many times slower
        than the others it reaches collectives); ranks that were among them and are no
        longer are shown at the median. Empty on other ranks."""
        return dict(self._slowdowns)

    def new_generation(self) -> None:
        """The process groups are formed again (a warm recovery): collectives of the old
        ones are not compared with the new ones', nor dumped with them. Called as this rank
        leaves the old groups, and again once every member of the new generation has come
        (all left the old ones): from then on nothing a peer published before is judged.
        Until this rank's first step of the generation ends, it is in a long phase, as
        from start-up to the first step: that step plans and runs things for the first
        time (a fresh spare's sharding propagation took seconds under load), so no peer
        names this rank not arrived while it runs, and waiting for it is no hang until
        ``phase_timeout_s``. A rank that stops beating is still named after the hang
        timeout."""
        self.plane.since_ns = self._generation_ns = time.time_ns()
        self.limit = self.cfg.phase_timeout_s

    def _recorder(self) -> dict:
        """This rank's flight recorder, this generation's entries only."""
        return flight_recorder(self._generation_ns)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:  # the rendezvous store outlives the round: leave it no per-rank keys
            self.plane.close()
            if self._counted_long:
                self.store.add(self._long_counted_in, -1)
        except Exception:  # the store may be gone at the end; nothing is lost
            pass

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        """Ticks every heartbeat interval, on time (a peer's silence is judged against
        it), and four times as often while quiet."""
        interval = self.cfg.heartbeat_interval_s
        next_tick = 0.0
        while True:
            wait = max(0.0, min(interval / 4, next_tick - time.monotonic()))
            asleep = time.monotonic()
            if self._stop.wait(wait):
                return
            try:
                self._after_own_pause(time.monotonic() - asleep - wait)
                if time.monotonic() < next_tick and not self.quiet:
                    continue
                next_tick = time.monotonic() + interval
                self._tick()
            except Exception as e:  # the store itself may be gone; keep watching
                self._store_out = True
                log.warning("llmtrain watchdog (rank %s): %s: %s", self.rank,
                            type(e).__name__, e)

    def _tick(self) -> None:
        began = time.monotonic()
        if self.fence is not None:
            # a rank that was cut off and replaced, back on the network: it may not beat,
            # declare or answer in the job that went on without it (one fenced event, then
            # the process ends; its agent sees the rank replaced)
            try:
                self.fence.stop_if_superseded("the watchdog's heartbeats and reports")
            except RuntimeError:  # Fenced
                os._exit(1)
        long, key = self.limit is not None, self._long_key()
        if key != self._long_counted_in:  # a new membership counts afresh
            self._counted_long, self._long_counted_in = False, key
        if long != self._counted_long:  # how many ranks are in a long phase, for the others
            self.store.add(key, 1 if long else -1)
            self._counted_long = long
        self.plane.publish(
            {"step": self.step, "phase": self.phase, "wall": time.time(), **beat_fields(),
             "progress_age": time.monotonic() - self.progress, "long": long,
             "at": positions(self._recorder()["entries"], time.time_ns(), self._judged_from_ns)
             if self.quiet else None})
        self._after_store_stall(began)
        if self.plane.leader:  # a summary of beats the store held back would name them silent
            beats = self._read_in_time(lambda: self.plane.beats(self.plane.members))
            if beats is not None:
                self.plane.summarize(beats)
        if (event := self.store.genuine("event")) is not None:  # a forged one: reported
            self._respond(json.loads(event), leader=False)
        self._after_store_stall(began)  # any of this tick's requests may have met it
        found = self._detect()
        if found:
            kind, reason = found
            self._declare(reason, kind)
        if time.monotonic() >= self._next_window:
            self._next_window += self.cfg.straggler_window_s
            self.plane.publish_arrivals(self._recorder()["entries"])
            if self.plane.leader:
                self.plane.reduce_arrivals()
            if self.rank == 0:
                self._find_stragglers()

    def _after_own_pause(self, late: float) -> None:
        """When this thread woke ``late`` seconds after it asked to, longer than makes a
        beat stale, this process did not run meanwhile: its machine paused (a VM's
        snapshot or live migration, a long memory reclaim), or the process was stopped and
        continued (a Slurm job suspended and resumed: SIGSTOP, then SIGCONT). Its peers, most likely paused with it, could not beat either, and its
        own training thread did not run: nothing that passed meanwhile is judged. Peers'
        silences, this rank's waits inside collectives and its own lack of progress count
        from now. (A 29 s VM pause on a test machine had each of two ranks, once resumed,
        name the other as hung: a cold restart of a healthy job.)"""
        if late <= self.plane.stale_s:
            return
        self._judge_from_now()
        log.warning("llmtrain watchdog (rank %s): this process did not run for %.1f s (its "
                    "machine paused, or it was stopped): nothing is judged on that time",
                    self.rank, late)
        self.events.emit("process_paused", seconds=round(late, 3), step=self.step,
                         host=HOST)

    def _judge_from_now(self, stalled_s: float | None = None) -> None:
        """Nothing that passed before now is judged: peers' silences count from now, and
        after a pause of this process (``stalled_s`` None) its own waits inside
        collectives and its own lack of progress too. After the store stalled for
        ``stalled_s``, which this thread cannot tell apart from a pause that fell inside a
        request, its own waits count from now only where the stall was longer than half
        the hang timeout: a shorter pause makes a rank look hung only where it was halfway
        there already, and a store merely slow at every request must not keep this rank
        from ever judging its own progress."""
        now_ns = time.time_ns()
        self.plane.since_ns = max(self.plane.since_ns, now_ns)
        if stalled_s is None or stalled_s > self.timeout / 2:
            self._judged_from, self._judged_from_ns = time.monotonic(), now_ns

    def _progress_age(self) -> float:
        """Seconds since this rank's last progress, counted from :meth:`_judge_from_now`'s
        latest call at the earliest."""
        return time.monotonic() - max(self.progress, self._judged_from)

    def _after_store_stall(self, began: float) -> None:
        """When the store did not answer for a while this tick (it stalled or restarted),
        every peer's watchdog waited on it as this one did, so their beats are old through
        no fault of theirs: their silence counts from now, as from a new generation's
        start. (A chaos run's 30 s stall met the check for the event key, after this was
        looked at once: both ranks named the other silent, and a warm recovery evicted a
        healthy rank.)"""
        took = time.monotonic() - began
        if self._store_out or took > self.cfg.heartbeat_interval_s:
            self._judge_from_now(stalled_s=took)
            self._store_out = False

    def _detect(self) -> tuple[str, str] | None:
        """(kind, reason) of a hang or desync seen from here, or None."""
        age = self._progress_age()
        if age > self.progress_timeout and not self._peer_in_long_phase(age):
            return "hang", (f"rank {self.rank} made no progress for {age:.0f} s (last: "
                            f"{self.phase} {self.step}; hang timeout "
                            f"{self.progress_timeout:.0f} s)")
        if self.phase == "recover":
            # In a warm recovery a silent peer is what the recovery is about: its agreement
            # names the lost ranks, and its budget (warm.budget_s) bounds the wait for the
            # spares that replace them, however slowly they join.
            return None
        # rank 0 watches every rank (through the node summaries), rank 1 watches rank 0
        if self.rank == 1:
            beats = self._read_in_time(lambda: self.plane.beats([0]))
            for r, beat in (beats or {}).items():
                silent = time.time() - beat["wall"]
                if silent > self.timeout:
                    return "hang", silence(r, silent, beat["step"], beat["phase"])
                if silent > self.plane.stale_s and self.quiet:  # while this rank waits?
                    world = self._seen_with(r, beat)
                    found = awaited(world, self.plane.stale_s, self.cfg.not_arrived_factor)
                    if found:
                        return "hang", found[0]
                    self._note_starved(world)
        if self.rank != 0:
            return None
        world = self._read_in_time(self.plane.world)
        if world is None:
            return None
        found = verdict(world, self.timeout, self.cfg.not_arrived_factor,
                        self.cfg.not_arrived_floor_s, self.plane.stale_s)
        if found is None:
            self._note_starved(world)
        return found

    def _note_starved(self, world: World) -> None:
        """Silent ranks that others wait for in a collective, which a peer on their host saw
        running (:mod:`llmtrain.reliability.liveness`): starved, not stopped, so not named
        hung; a ``starved`` event and a warning each, once per silence."""
        found = awaited(world, self.plane.stale_s, self.cfg.not_arrived_factor, starved=True)
        for r in (found[1] if found else []):
            since = world.silent[r][1:]  # (its last beat's step and phase)
            if self._starved.get(r) == since:
                continue
            self._starved[r] = since
            self.events.emit("starved", starved_rank=r, silent_s=round(world.silent[r][0], 3),
                             step=self.step, reason=found[0])
            log.warning("llmtrain watchdog (rank %s): %s; the hang timeout (%.0f s) judges "
                        "it if it stays silent", self.rank, found[0], self.timeout)

    def _read_in_time(self, read):
        """``read()``, or None when the store took longer than a heartbeat interval to
        answer it: then the peers' beats it returns are as old as the store's stall
        through no fault of theirs (their ticks waited on it too), so their silence
        counts from now, and nothing is judged on them. A stall that began inside this
        read is not seen by the check after publishing (a chaos run's store stopped for
        6 s had a healthy rank 0 declared silent for 6 s and evicted)."""
        asked = time.monotonic()
        got = read()
        took = time.monotonic() - asked
        if took > self.cfg.heartbeat_interval_s:
            self._judge_from_now(stalled_s=took)
            return None
        return got

    def _seen_with(self, rank: int, beat: dict) -> World:
        """``rank``'s silence and where this rank waits (from its flight recorder),
        summarized as rank 0 summarizes the job's."""
        now = time.time()
        own = {"wall": now, "step": self.step, "phase": self.phase,
               "at": positions(self._recorder()["entries"], time.time_ns(), self._judged_from_ns)}
        world = World()
        world.add(summarize({rank: {**beat, "at": None}, self.rank: own}, now,
                            self.plane.stale_s, self.plane.liveness), now)
        return world

    def _peer_in_long_phase(self, age: float) -> bool:
        """Waiting for a rank in a declared long phase is no hang (until that phase's own
        limit). One counter in the store, read only once the learned timeout has passed."""
        if age > max(self.cfg.phase_timeout_s, self.cfg.hang_timeout_s):
            return False
        return self.store.add(self._long_key(), 0) > 0

    def _long_key(self) -> str:
        """The store's count of ranks in a long phase, one per membership of the job: a
        rank lost while in one (killed in a save, cut off by a partition) leaves its count
        behind in its membership's key, where no later membership reads it (one count for
        the whole round excused every later hang until phase_timeout_s)."""
        return ("long_phases" if self.fence is None
                else f"long_phases/{self.fence.membership()}")

    # -- stragglers: who arrives late at collectives ----------------------------------

    def _find_stragglers(self) -> None:
        """Rank 0: the slowest ranks from the flight recorders' arrival times
        (:meth:`ControlPlane.stragglers`). Every window is a ``straggler_scores`` event of a
        fixed size (the report's heatmap); a rank slow two windows running is a
        ``straggler`` event."""
        scores = self.plane.stragglers()
        if scores is None:
            return
        self.events.emit("straggler_scores", step=self.step, **asdict(scores))
        top = dict(scores.top)
        self._slowdowns = {**{r: scores.p50 for r in self._slowdowns}, **top}
        self._streaks = {r: self._streaks.get(r, 0) + 1 for r, s in top.items()
                         if s > self.cfg.straggler_factor}
        for r, streak in self._streaks.items():
            if streak >= 2:
                beat = self.plane.beats([r]).get(r, {"step": self.step})
                self.events.emit("straggler", straggler_rank=r, host=beat.get("host"),
                                 slowdown=top[r], collectives=scores.collectives,
                                 step=beat["step"])
                log.warning("llmtrain watchdog: rank %s on %s is a straggler, %.1fx slower "
                            "than the others", r, beat.get("host"), top[r])

    # -- hangs ------------------------------------------------------------------------

    def collective_failed(self, error: BaseException) -> None:
        """From the training thread: a collective raised (e.g. PyTorch's desync check);
        diagnose it like a hang. Does not return."""
        self.error = f"{type(error).__name__}: {error}"
        self._declare(f"rank {self.rank}: a collective failed after step {self.step}: "
                      f"{str(error).splitlines()[0][:300]}", kind="collective_error")

    def _declare(self, reason: str, kind: str = "hang") -> None:
        event = {"id": f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
                 "kind": kind, "reason": reason, "leader": self.rank,
                 "detected_wall": time.time(),
                 "progress_age": time.monotonic() - self.progress}
        claimed = json.loads(self.store.claim("event", json.dumps(event)))
        self._respond(claimed, leader=claimed["id"] == event["id"])

    def _respond(self, event: dict, leader: bool) -> None:
        """Dump, (leader) analyze, report and decide; then leave with the retryable exit
        code, or, where the decision evicted other ranks (warm), go on watching."""
        if not self._responding.acquire(blocking=False):
            while True:  # the other thread of this rank is already at it
                time.sleep(3600)
        try:
            verdict = self._decide(event, leader)
        except (RuntimeError, OSError) as e:  # (c10d's store errors are RuntimeErrors)
            # the store went away meanwhile (it lived in a rank that has left: a job whose
            # agents' endpoint was not known): nobody can evict anyone, so the hang ends cold
            log.warning("llmtrain watchdog (rank %s): the store failed while this rank awaited "
                        "the hang's verdict (%s: %s): it leaves for a restart", self.rank,
                        type(e).__name__, str(e).splitlines()[0][:200])
            verdict = {"evicted": [], "cut": []}
        evicted = verdict["evicted"]
        while self.rank in evicted:  # its agent kills this process (or it is cut off)
            time.sleep(3600)
        if evicted:
            # warm: the stuck collective fails once the evicted ranks' connections close
            # (killed by their agents, or, cut off, this rank shuts its ends of them), and
            # the warm path takes over; until it does, this rank counts as recovering
            sockets.cut(set(verdict["cut"]))
            self.beat(self.step, "recover", long=True)
            self._responding.release()
            return
        self.events.close()
        try:
            self.on_exit()
        except Exception as e:  # noqa: BLE001 - the store may be out: leaving comes first
            log.warning("rank %d leaves without telling the agents (%s: %s)", self.rank,
                        type(e).__name__, str(e).splitlines()[0][:200])
        os._exit(ExitCode.RETRYABLE)

    def _decide(self, event: dict, leader: bool) -> dict[str, list]:
        """This rank's dump; the leader's report and verdict (who is evicted, which
        connections the others cut), which the others await (none, past the dump timeout
        and a minute: nobody is evicted)."""
        url = join(self.diagnostics, event["id"])
        dump = {"rank": self.rank, "host": HOST, "pid": os.getpid(),
                "step": self.step, "phase": self.phase, "error": self.error,
                "progress_age_s": time.monotonic() - self.progress,
                **self._recorder(), "stacks": thread_stacks()}
        write_atomic(join(url, f"rank-{self.rank:05d}.json"), json.dumps(dump).encode())
        self.store.set(f"dumped/{event['id']}/{self.rank}", "1")
        done = f"done/{event['id']}"
        if leader:
            self.store.set(done, json.dumps(self._evicted(event, self._report(event, url))))
        no_word = not leader and self._await([done], self.cfg.dump_timeout_s + 60)
        said = None if no_word else self.store.genuine(done)
        return json.loads(said) if said else {"evicted": [], "cut": []}

    def _evicted(self, event: dict, culprits: list[int]) -> dict[str, list]:
        """The verdict: the ranks a hang's leader has leave for the warm path to replace
        (none when the event goes cold: a desync or failed collective, no stuck rank
        named, or every rank stuck), and the connection ends the others must cut."""
        stuck = sorted(set(culprits))
        if (self.evict is None or event["kind"] != "hang" or not stuck
                or len(stuck) >= self.world_size):
            return {"evicted": [], "cut": []}
        # Every live rank has dumped and waits for the verdict: nobody needs the event any
        # more, and a spare that starts watching must not find it.
        self.store.delete_key("event")
        unreachable = self.evict(stuck, self.store.underlying_store)
        self.events.emit("evicted", id=event["id"], ranks=stuck, unreachable=list(unreachable))
        return {"evicted": stuck, "cut": [e for ends in unreachable.values() for e in ends]}

    def _silent_ranks(self) -> set[int]:
        """Ranks whose heartbeat stopped (none for the control plane's ``stale_s``: the
        watchdog thread beats even while its main thread waits in a collective, so only a
        stopped or dead process falls that far behind). Not the hang timeout: a rank
        stopped just after its last progress is only about one timeout silent when the
        hang is seen."""
        limit = min(self.timeout, self.plane.stale_s)
        fresh = {r for r, beat in self.plane.beats(range(self.world_size)).items()
                 if time.time() - beat["wall"] <= limit}
        return set(range(self.world_size)) - fresh

    def _await(self, keys: list[str], seconds: float) -> list[str]:
        """Waits up to ``seconds`` for ``keys``; returns those still missing."""
        deadline = time.monotonic() + seconds
        while True:
            missing = [k for k in keys if not self.store.check([k])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)

    def _report(self, event: dict, url: str) -> list[int]:
        """Analyzes the dumps, writes the report and the event; returns the culprits."""
        silent = self._silent_ranks()  # stopped or dead: no dump will come from them
        self._await([f"dumped/{event['id']}/{r}" for r in range(self.world_size)
                     if r not in silent], self.cfg.dump_timeout_s)
        report = flightrec.analyze(flightrec.load_dumps(url), self.world_size)
        detected_after = event["progress_age"]
        flightrec.write_report(url, report, {"event": event["id"], "reason": event["reason"],
                                             "leader": self.rank, "timeout_s": self.timeout})
        reported_after = detected_after + time.time() - event["detected_wall"]
        self.events.emit(event["kind"], id=event["id"], reason=event["reason"],
                         verdict=report.verdict,
                         culprits=report.culprits, collective=report.collective,
                         report=join(url, "report.md"), timeout_s=self.timeout,
                         detected_after_s=detected_after, reported_after_s=reported_after)
        log.error("llmtrain watchdog: %s\n  verdict: %s\n  report: %s", event["reason"],
                  report.verdict, join(url, "report.md"))
        return report.culprits



def start_watchdog(cfg: ReliabilityConfig, run_dir: str, events: EventLog, rank: int,
                   world_size: int, local_world_size: int, *, namespace: str | None,
                   on_exit: Callable[[], None], evict: Evict | None,
                   fence: Fence | None) -> WatchdogLike:
    """This rank's watchdog, started (see :class:`Watchdog` for ``on_exit``, ``evict`` and
    ``fence``: ``evict`` None when there is no warm path, and every hang goes cold); its
    heartbeats go to the store under ``namespace`` (None: the attempt's)."""
    if not cfg.watchdog:
        return NoWatchdog()
    store = open_store("watchdog", timedelta(seconds=30), namespace)
    watchdog = Watchdog(cfg, store, run_dir, events, rank, world_size,
                        local_world_size, on_exit=on_exit,
                        evict=evict, fence=fence)
    watchdog.start()
    return watchdog
