"""Warm recovery, as the training loop sees it: snapshots while training, and on a failed
collective, a new generation of the group with the state restored from memory.

The loop asks three things: ``maybe_snapshot(step)`` after each step, ``recover(error)``
when a collective fails (the restored step, or None: the cold path takes over), and
``leave()`` when this rank's GPU failed. :class:`NoWarmRecovery`
(:mod:`llmtrain.recovery.interface`) answers them when the warm path is off (or cannot
work: no store outside the workers), so the loop has one shape.

What a snapshot holds is the run's state registry (:mod:`llmtrain.state_registry`): this
rank's model and optimizer shards as bytes, and every registered item in the header, the
same items a checkpoint holds (:mod:`llmtrain.recovery.registry_snapshots`). A spare
restores a lost rank's from its buddy's replica.

With no spare waiting, the survivors of lost nodes shrink (``warm.shrink``): ``recover``
raises :class:`Resized`, the worker builds its trainer anew at the smaller world size
(:mod:`llmtrain.launch.worker`) in the same process, and the new trainer fills its state
from the snapshots and replicas the survivors hold, resharded in memory
(:mod:`llmtrain.recovery.reshard`). A job below its size grows the same way
(``warm.grow``): when rank 0 sees a node's worth of spares waiting, the ranks vote to take
them in at a step boundary (:mod:`llmtrain.control`), copy the state of that step into
memory, and re-form with the spares, whose shards are resharded from the others' copies
(not while a checkpoint's write is in flight: the grow waits for a later vote).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from llmtrain import fault_points
from llmtrain.checkpoint.interface import Checkpointing
from llmtrain.checkpoint.snapshots import (Schedule, Snapshot, SnapshotError, Snapshots,
                                           shares_cores)
from llmtrain.config import ConfigError, Settings
from llmtrain.distributed.failure import (NCCL_WARM_PROVEN, FailureWatch, abort_groups,
                                          broke_a_collective, nccl_problems)
from llmtrain.distributed.flight_recorder import native_threads, stuck_collective, thread_stacks
from llmtrain.distributed.group_names import OFF_THREAD
from llmtrain.distributed.process_group import (WorldInfo, backend_for, device_type,
                                                resolve_device, side_group)
from llmtrain.distributed.signed_store import SignedStore
from llmtrain.events import EventLog
from llmtrain.exit_codes import ExitCode, FatalError
from llmtrain.metrics.goodput import GoodputLedger
from llmtrain.recovery.background_look import BackgroundLook
from llmtrain.recovery.eviction import evict, publish_endpoints
from llmtrain.recovery.fence import Fence, round_of
from llmtrain.recovery.interface import Evict, NoWarmRecovery, Recovery, Resized, membership
from llmtrain.recovery.pool import spares_ready, spares_waiting
from llmtrain.recovery.presence import hold_presence
from llmtrain.recovery.registry_snapshots import (capture_state, load_items, load_shared_items,
                                                  restore_snapshot, take_snapshot)
from llmtrain.recovery.reshard import Mesh, reshard
from llmtrain.recovery.roll_call import mark_gone, owner
from llmtrain.recovery.sockets import connections
from llmtrain.recovery.warm import ColdPath, Plan, WarmPath, outside_store
from llmtrain.state_registry import StateRegistry

log = logging.getLogger(__name__)

# Noted on an error the warm path already reported as a ``failure`` event.
_REPORTED = "llmtrain: reported as a failure event; the warm path could not recover from it"


def mark_reported(error: BaseException) -> None:
    """Notes on ``error`` that the warm path reported it as a ``failure`` event (the
    start of the recovery clock): whoever ends the run on it must not report it again."""
    error.add_note(_REPORTED)


def was_reported(error: BaseException) -> bool:
    """Whether the warm path already reported ``error`` as a ``failure`` event."""
    return _REPORTED in getattr(error, "__notes__", ())


class Job(Protocol):
    """What a recovery asks of the trainer."""
    registry: StateRegistry
    checkpoints: Checkpointing  # writing(): a save's write in flight

    def leave_group(self, deadline: float, stuck_s: float) -> None:
        """Ends this generation: waits for checkpoint work until ``deadline`` (a write
        still in an I/O collective after ``stuck_s`` is let go of), abandons its groups."""

    def rejoin(self, store: dist.Store) -> dist.ProcessGroup:
        """Forms the next generation on ``store``; returns its control group."""


def world_sizes(world: WorldInfo, fits: Callable[[int], tuple[int, int]],
                tp: int = 1) -> Callable[[int], tuple[int, int] | str] | None:
    """What a shrink or a grow may reach: the mesh ``fits`` gives a number of ranks (as a
    cold restart at that size would), or why not (below the launcher's ``--nnodes``
    minimum; the ConfigError ``fits`` raised; with tensor parallelism, a mesh whose
    replicas are not the same as now: only whole replicas may come and go). None when no
    launcher said its minimum."""
    floor = world.min_nodes
    if floor is None:
        return None

    def shape(ranks: int) -> tuple[int, int] | str:
        if ranks < floor * world.local_world_size:
            return (f"{ranks // world.local_world_size} node(s) are fewer than --nnodes "
                    f"allows ({floor})")
        try:
            mesh, now = fits(ranks), fits(world.world_size)
        except ConfigError as e:
            return str(e)
        if tp > 1 and mesh[1] != now[1]:
            return (f"with parallelism.tp={tp} only whole replicas come and go, but "
                    f"{ranks} ranks would shard over dp_shard={mesh[1]} instead of "
                    f"{now[1]}; set parallelism.dp_shard={now[1]} and "
                    f"parallelism.dp_replicate=-1")
        return mesh
    return shape


class WarmRecovery:
    """This rank's part in warm recoveries: its snapshots, its buddy's replica of them,
    and the agreement with the other survivors (:mod:`llmtrain.recovery.warm`)."""

    GONE_WAIT_S = 2.0  # a stuck rank's wait to say it is gone, before it exits anyway

    def __init__(self, cfg: Settings, path: WarmPath, job: Job, *, world: WorldInfo,
                 events: EventLog, ledger: GoodputLedger, fence: Fence,
                 held: dict[int, Snapshot] | None = None):
        """``held``: after a shrink, the snapshots this process held (old rank ->
        snapshot), which the new generation's state is resharded from."""
        w, c = cfg.warm, cfg.checkpoint
        self.held = held or {}
        self.cfg, self.path, self.job, self.world = w, path, job, world
        self.events, self.ledger, self.fence = events, ledger, fence
        self._spares_look: BackgroundLook | None = None  # rank 0's, made at its first vote
        self.round_id = path.round_id
        self.timeout_s = cfg.reliability.collective_timeout_s
        self.tp = cfg.parallelism.tp  # the same at every size: whole replicas come and go
        # never further apart than checkpoints: warm must not redo more than cold
        most = (min(w.snapshot_max_every, c.interval_steps)
                if c.enable and c.interval_steps else w.snapshot_max_every)
        device = resolve_device(cfg.parallelism, world.local_rank)
        self.snapshots = Snapshots(
            Schedule(w.snapshot_every, w.snapshot_budget, most), world.rank,
            buddy=path.buddy, ward=path.ward, events=events,
            shares_cores=shares_cores(device, path.local_world_size))
        self.replication: dist.ProcessGroup | None = None  # the generation's, once formed
        self.control: dist.ProcessGroup | None = None  # the generation's, once started
        self.left = False  # this generation's groups were left (never twice)
        self.left_early = False  # the health monitor marked this rank gone (its GPU failed)
        self.on_gpu = device.type == "cuda"
        self.recovered: dict | None = None  # the last recovery, until its first step is done
        self.watch: FailureWatch | None = None  # this generation's
        # A wait that the failure should have ended by now, and that nothing will: this
        # rank's collective (_leave_if_stuck), or its checkpoint write's (leave_group).
        self.stuck_s = w.budget_s / 4

    def membership(self) -> str:
        return membership(self.round_id, self.path.gen)

    def namespace(self) -> str | None:
        return self.round_id  # the watchdog's keys outlive generations

    def evictor(self) -> Evict | None:
        return self.evict

    def evict(self, ranks: list[int], via: dist.Store) -> dict[int, list[str]]:
        """Has a hang's stuck ranks leave, for spares to replace: the watchdog asks,
        through ``via``, its own connection to the rendezvous store (no other is opened)."""
        return evict(outside_store(timedelta(seconds=30), via), ranks,
                     wait_s=self.cfg.evict_wait_s)

    def spare_store(self, plan: Plan) -> dist.Store:
        """A spare's way in (its place in ``plan``): once every member of the generation
        has come, its store."""
        fault_points.point("spare_assigned", plan.step)
        self.path.assemble(time.monotonic() + self.cfg.budget_s, plan)
        fault_points.point("spare_arrived", plan.step)
        return self.path.group_store()

    def group_formed(self) -> None:
        """A generation's groups are forming: the replication's is one of them."""
        self.replication = side_group(self.timeout_s, f"{OFF_THREAD}snapshot_replication")
        self.formed = time.time()

    def start(self, step: int, control: dist.ProcessGroup) -> None:
        """Replicates snapshots from ``step`` on, every group of the generation formed;
        watches for the generation's failure (see FailureWatch). A generation a
        warm recovery made takes its first snapshot at its first step: until then its
        newcomers hold none of their own, nor a replica of their wards', and a second
        failure within the interval went cold (a node lost 1 step after a spare joined
        could not shrink the job)."""
        self.control, self.left = control, False
        self.snapshots.start(self.replication, control, step, soon=self.path.gen > 0)
        publish_endpoints(self.path.store, self.world.rank)
        stir = self.path.stirring()

        def woken(store: SignedStore) -> None:  # on the watch's thread and connection
            stir(store)
            abort_groups()
        since = int(self.formed * 1e9)  # the generation's collectives
        then = None if dist.get_backend() == "nccl" else (
            lambda store, disarmed: self._leave_if_stuck(store, disarmed, since))
        self.watch = FailureWatch(lambda: outside_store(FailureWatch.WAIT),
                                  self.path.failed_key(), on_failure=woken, then=then)

    def _leave_if_stuck(self, store: SignedStore, disarmed: threading.Event,
                        since_ns: int) -> None:
        """On gloo, on the failure watch's thread once it woke: the training thread meets
        the failure within moments (its collective with a lost peer fails), and its
        recovery disarms the watch. If that has not happened within a quarter of
        ``warm.budget_s``, and the flight recorder shows the thread still inside a
        collective it entered before the failure, nothing may end that wait but the
        group's timeout (``reliability.collective_timeout_s``). Seen in chaos runs with
        tensor parallelism: a rank whose TP peer left (its GPU failed, and it shut its
        connections) waited on in their all-reduce; the decider counted it lost after
        half of ``warm.budget_s``, with its buddy blocked behind it, and the job went cold
        (102 s). gloo's source shows how: when a connection closes, the operations it
        fails are the ones still queued, not a send already partly written nor a message
        already partly read (TP all-reduces move whole activations; see
        docs/recovery.md). The rank then says
        it is gone and exits: a spare takes its place, and a peer blocked on it is freed
        as its connections close. A rank computing far from its next collective comes,
        and is left alone."""
        woke = time.time_ns()
        if disarmed.wait(self.stuck_s):
            return
        stuck = stuck_collective(since_ns, woke)
        if stuck is None or disarmed.is_set():  # it computes, or met the failure just now
            return
        waited = (time.time_ns() - stuck["entered_ns"]) / 1e9
        # what ended nothing, for whoever reads why: where the training thread waits, and
        # whether each connection's close or reset from its peer ever arrived
        stack = thread_stacks().get(threading.main_thread().name, "")
        held, threads = connections(), native_threads()
        log.error("rank %d is stuck in %s #%s on %s, entered %.1f s ago, before its "
                  "generation failed, which nothing has ended since: it leaves, for a spare "
                  "to take its place. Its connections: %s. Its native threads: %s. Its "
                  "training thread:\n%s", self.world.rank, stuck["op"], stuck["seq"],
                  stuck["pg"], waited,
                  "; ".join(f"{c['local']}->{c['peer']} {c['state']} unread {c['unread']} "
                            f"unsent {c['unsent']}" for c in held), threads, stack)
        self.events.emit("collective_stuck", host=self.world.host, waited_s=round(waited, 3),
                         collective={k: stuck[k] for k in ("pg", "seq", "op")},
                         stack=stack[-4000:], connections=held, threads=threads)
        self.events.close()

        def say_gone() -> None:
            with contextlib.suppress(RuntimeError, OSError):  # the store is out
                mark_gone(store, self.world.rank)
        saying = threading.Thread(target=say_gone, daemon=True, name="llmtrain-gone")
        saying.start()
        saying.join(self.GONE_WAIT_S)  # a store that stalls must not keep it: its agent
        os._exit(ExitCode.RETRYABLE)  # marks it gone too, once the process has ended

    def maybe_snapshot(self, step: int) -> None:
        if self.snapshots.due(step):
            take_snapshot(self.snapshots, step, self.job.registry)

    def forget_snapshots(self) -> None:
        """The state went back (a rollback): snapshots of the abandoned steps are never
        restored."""
        self.snapshots.forget_own()

    def leave(self) -> bool:
        """This rank leaves on purpose (its GPU failed), unsaved, at a step's end: the
        survivors go on. On gloo its connections to them are cut now, when none of its
        training collectives is in flight, so their next one fails at once rather than
        when this process has closed."""
        if not self.left_early:
            self.path.leave()
        if dist.get_backend() == "gloo":
            self.path.cut_from_peers()
        return True

    def leave_early(self) -> None:
        """The health monitor's thread saw this rank's GPU fail: the rank is marked gone
        now, rather than at the step's end. On NCCL that wakes its peers blocked in the
        step's collectives (their failure watch aborts them; read from torch's source,
        never run with two or more ranks: see warm_path_unproven). A collective of this
        rank's that fails after it is then its own failure: it leaves, never reports as
        a survivor.

        On gloo on the CPU this rank's connections are not cut here. The cut came at any
        point of the step, so it could sever a message mid-transfer, which gloo may never
        fail: a TP chaos run's buddy of the failed rank waited in their HSDP all-reduce
        until it left as stuck, and the job went cold. There a GPU failure is a scripted
        one and the step goes on: this rank cuts its connections at the step's end
        (:meth:`leave`), and its peers fail cleanly at their next collective. With gloo
        pinned on GPUs a failing GPU may never end its step, so the cut comes now, at
        that risk (never run with two or more ranks)."""
        self.left_early = True
        self.path.leave()
        if self.on_gpu and dist.get_backend() == "gloo":
            log.warning("rank %d: its GPU failed on gloo: its connections are cut now, mid-"
                        "step (a path never run with two or more ranks)", self.world.rank)
            self.path.cut_from_peers()

    def give_up(self) -> None:
        self.path.give_up()

    def can_grow(self) -> bool:
        """Rank 0's look at each vote it casts: a node's worth of spares waits, ready,
        while the job runs below the launcher's ``--nnodes`` maximum. The pool is read
        off the training thread (:class:`BackgroundLook`): every rank waits for rank 0's
        vote, and a store that stalled froze them all, or raised into the vote, which
        took the error for a lost peer and sent the job cold."""
        top, per_node = self.world.max_nodes, self.path.local_world_size
        if not (self.cfg.grow and top is not None and self.path.shapes is not None
                and self.world.world_size < top * per_node):
            return False
        if self._spares_look is None:
            self._spares_look = BackgroundLook(
                lambda: spares_ready(self.path.store, per_node), self.cfg.budget_s)
        return self._spares_look.latest()

    def grow(self, step: int) -> None:
        """Every rank voted to grow after ``step``: with a plan (rank 0 claimed the
        spares), each copies the state of ``step`` into memory, leaves the group, and
        raises Resized, for the worker to build the larger trainer; without one (the
        spares went meanwhile), training goes on as it was. While a checkpoint's write is
        in flight on any rank, the grow waits for a later vote: leaving the group would
        wait for the write (on slow storage, past ``warm.budget_s``) or lose it."""
        decided, deadline = time.time(), time.monotonic() + self.cfg.budget_s
        if self._writing_anywhere():
            self.events.emit_once("grow_postponed", step=step,
                                  reason="a checkpoint write is in flight: the grow waits "
                                         "for a vote after it ends")
            return
        try:
            plan = self.path.grow(step, deadline)
        except ColdPath as e:
            plan = None
            self.events.emit("grow_failed", step=step, reason=str(e))
        if plan is None:
            return
        snap = capture_state(step, self.world.rank, self.job.registry)
        self.snapshots.stop(self.cfg.settle_s)
        self._leave(deadline)
        plan.marks = {"grow_decided": decided, "agreed": time.time(), "failed_at": step,
                      "snapshot_interval": self.snapshots.schedule.interval}
        raise Resized({**asdict(plan), "rank": self.world.rank}, {self.world.rank: snap})

    def _writing_anywhere(self) -> bool:
        """Whether a checkpoint's write is in flight on any rank; every rank asks at once,
        on the generation's control group."""
        writing = torch.tensor([int(self.job.checkpoints.writing())])
        dist.all_reduce(writing, op=dist.ReduceOp.MAX, group=self.control)
        return bool(writing.item())

    def _leave(self, deadline: float) -> None:
        """Leaves this generation's groups, once (an error raised while leaving is not
        left again by the recovery it reaches). Its failure watch is disarmed first: a
        late mark of this generation's failure (a preempted leaver's agent saying it is
        gone) must not abort the next generation's groups."""
        if self.watch is not None:
            self.watch.disarm()
        if not self.left:
            self.left = True
            self.job.leave_group(deadline, self.stuck_s)

    def let_go(self, step: int, signalled: bool, group: dist.ProcessGroup) -> None:
        """A preemption's save of ``step`` is committed. With no spare waiting to take
        the preempted nodes' places, the other ranks go on without them in memory (a
        shrink at a step boundary: no restart, nothing read) where they hold every shard,
        as the nodes of an HSDP job's whole replicas do; raises Resized on them. Returns
        on the preempted ranks, which stop, and on every rank when the others cannot go
        on alone (then all stop, and the job restarts cold at the smaller size)."""
        decided, rank = time.time(), self.world.rank
        mine = torch.tensor([int(signalled),
                             spares_waiting(self.path.store) if rank == 0 else 0])
        everyone = [torch.zeros_like(mine) for _ in range(self.world.world_size)]
        dist.all_gather(everyone, mine, group=group)
        leaving = [r for r, flags in enumerate(everyone) if flags[0]]
        plan = ("a spare waits: the job restarts with it" if everyone[0][1] else
                self.path.without(leaving, step))
        if isinstance(plan, str):
            if rank == 0:
                self.events.emit("preempt_shrink_refused", step=step, leaving=leaving,
                                 reason=plan)
            return
        if rank in leaving:
            return
        snap = capture_state(step, self.world.rank, self.job.registry)
        self.snapshots.stop(self.cfg.settle_s)
        self.fence.expect(membership(self.round_id, plan.gen))
        self._leave(time.monotonic() + self.cfg.budget_s)
        plan.marks = {"preempt_decided": decided, "agreed": time.time(), "failed_at": step,
                      "snapshot_interval": self.snapshots.schedule.interval}
        raise Resized({**asdict(plan), "rank": plan.kept.index(rank)}, {rank: snap})

    def recover(self, error: BaseException, step: int) -> int | None:
        """A collective failed: with the other survivors, re-forms the group with warm
        spares in the lost ranks' places and restores every rank's state from memory.
        Returns the restored step; None when the cold path must take over (logged), or
        when the failure was this rank's own: then it leaves, for a spare to replace it.
        With no spare for a lost node, raises :class:`Resized` when the survivors shrink."""
        if isinstance(error, FatalError):  # diverged: a restart would do the same
            return None
        detected, interval = time.time(), self.snapshots.schedule.interval
        deadline = time.monotonic() + self.cfg.budget_s
        local = not broke_a_collective(error) or self.left_early
        self.events.emit("failure", host=self.world.host, step=step,
                         error=f"{type(error).__name__}: {error}"[:500],
                         path="warm", cause="local" if local else "peer")
        mark_reported(error)
        if self.watch is not None:
            self.watch.disarm()  # this generation's groups are left below, by this thread
        if local:
            self.leave_locally(deadline)
            return None
        plan = None
        try:
            # not awaited: an exchange with the lost peer may never end, and one between
            # two survivors (each other's buddy and ward) delayed both their reports past
            # the decider's settle_s, who counted them lost. Once stopped, the thread
            # keeps nothing (the holdings reported are final); it ends with the group
            self.snapshots.stop(0.0)
            gloo = dist.get_backend() == "gloo"
            plan = self.path.agree(self.snapshots.holdings(), deadline,
                                   leave=lambda: self.leave_broken(deadline, gloo))
            if self.world.rank in plan.dropped:  # its node's replica goes: it leaves too
                log.warning("rank %d leaves: the job shrinks without its node, which lost "
                            "rank(s) %s (a node's ranks go whole)", self.world.rank,
                            plan.lost)
                return None
            if self.world.rank not in plan.lost:  # the spares may name it first
                self.fence.expect(membership(self.round_id, plan.gen))
            agreed = time.time()
            if plan.kind == "shrink":
                raise self.shrunk(plan, {"failure_detected": detected, "agreed": agreed},
                                  failed_at=step)
            self.path.enter(plan.gen)
            self.path.assemble(deadline, plan)
            control = self.job.rejoin(self.path.group_store())
            formed = time.time()
            self.restore(plan, deadline)
        except (ColdPath, SnapshotError, TimeoutError, RuntimeError) as e:
            self.events.emit("warm_recovery_failed", step=step,
                             reason=f"{type(e).__name__}: {e}"[:500])
            if plan is not None:  # a plan was made and failed
                self.path.give_up()
            return None
        self.start(plan.step, control)
        restored = time.time()
        self.ledger.record("restart", "warm", detected, restored)
        self.ledger.restart_at(plan.step)
        if self.world.rank == min(set(range(self.world.world_size)) - set(plan.lost)):
            # reported once the first step after it is done: the whole cost of the fault
            self.recovered = {"gen": plan.gen, "lost": plan.lost, "joined": plan.lost,
                              "step": plan.step, "kind": plan.kind, "spares": plan.spares,
                              "failed_at": step,
                              "snapshot_interval": interval, "marks": {
                                  "failure_detected": detected, "agreed": agreed,
                                  "group_formed": formed, "restored": restored}}
        return plan.step

    def leave_broken(self, deadline: float, gloo: bool) -> None:
        """Leaves the broken generation; on gloo, also shuts this rank's connections to
        its peers, so that one blocked on this rank fails and reports in time."""
        self._leave(deadline)
        if gloo:
            self.path.cut_from_peers()

    def shrunk(self, plan: Plan, marks: dict[str, float], failed_at: int) -> Resized:
        """This survivor's part in ``plan`` (a shrink): its new rank, and the snapshots
        of ``plan.step`` it holds that the new generation is resharded from."""
        rank = self.world.rank
        held = {rank: self.snapshots.own.at(plan.step)}
        ward = self.snapshots.ward
        if ward is not None and plan.providers.get(str(ward)) == plan.kept.index(rank) \
                and ward not in plan.kept:
            held[ward] = self.snapshots.replicas.at(plan.step)
        if any(snap is None for snap in held.values()):  # the agreement said we hold it
            raise SnapshotError(f"rank {rank} lost its snapshot of step {plan.step}")
        marks = {**marks, "failed_at": failed_at,
                 "snapshot_interval": self.snapshots.schedule.interval}
        plan.marks = marks
        return Resized({**asdict(plan), "rank": plan.kept.index(rank)}, held)

    def leave_locally(self, deadline: float) -> None:
        """This rank's own step failed (out of memory, an I/O error, a CUDA fault), not a
        collective: it must not report as a survivor, or its peers, blocked in the
        collective it never joined, would be counted lost in its stead. It says it is gone
        and leaves its groups at once (its peers' collectives then fail, and they replace
        it with a spare); the error ends the process."""
        self.snapshots.stop(0.0)
        self.path.leave()
        self._leave(min(deadline, time.monotonic() + self.cfg.settle_s))

    def join_as_spare(self, plan: Plan) -> int:
        """A spare's start, once its groups are formed: the lost rank's state from its
        buddy's replica; or the start of a rank of a shrunk or grown job, from what the
        ranks hold. Returns the step it restored."""
        self.restore(plan, time.monotonic() + self.cfg.budget_s)
        # rank 0 times it (a grow's spares were told of it before the ranks' marks existed)
        if plan.kind in ("shrink", "grow") and self.world.rank == 0:
            restored = time.time()
            first = next(iter(plan.marks.values()))  # the failure seen, or the grow voted
            self.ledger.record("restart", f"warm {plan.kind}", first, restored)
            self.ledger.restart_at(plan.step)
            marks = {k: plan.marks[k] for k in list(plan.marks)[:2]}
            self.recovered = {"gen": plan.gen, "lost": plan.lost, "step": plan.step,
                              "dropped": plan.dropped,
                              "joined": [n for n, old in enumerate(plan.kept) if old < 0],
                              "kind": plan.kind, "world_size": plan.world_size,
                              "failed_at": plan.marks["failed_at"],
                              "snapshot_interval": plan.marks["snapshot_interval"],
                              "marks": {**marks, "group_formed": self.formed,
                                        "restored": restored}}
        return plan.step

    def restore(self, plan: Plan, deadline: float) -> None:
        """Every rank's state at ``plan.step`` from memory: survivors from their own
        snapshot, a spare from its buddy's replica; all verified by checksum first, and all
        ranks agree that each did, or none goes on (SnapshotError: the cold path)."""
        if plan.kind in ("shrink", "grow"):
            try:
                self._reshard(plan)
            except SnapshotError:
                self.path.give_up()  # every survivor's agent restarts it: cold
                raise
            return
        rank, got = self.world.rank, {}

        def fetch() -> None:
            for lost, source in plan.sources.items():
                if source == rank:
                    self.snapshots.send_replica(plan.step, int(lost), self.replication)
            if str(rank) in plan.sources:
                got["snap"] = Snapshots.receive(plan.sources[str(rank)], self.replication,
                                                timeout_s=max(0.0, deadline - time.monotonic()))
            else:
                got["snap"] = self.snapshots.own.at(plan.step)
                got["snap"].verify()
        self._checked_everywhere(plan.step, "restore", fetch)
        restore_snapshot(got["snap"], self.job.registry)

    def _checked_everywhere(self, step: int, when: str, check: Callable[[], None]) -> None:
        """Runs ``check`` here, which raises SnapshotError for a snapshot that fails its
        checksum (or never came); every rank agrees that each passed, or all raise."""
        ok = torch.ones(1)
        try:
            check()
        except SnapshotError as e:
            self.events.emit("snapshot_corrupt", rank=self.world.rank, step=step,
                             error=str(e), when=when)
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.replication)
        if not ok.item():
            raise SnapshotError(f"a snapshot of step {step} failed its check "
                                f"(see the snapshot_corrupt events)")

    def _reshard(self, plan: Plan) -> None:
        """A shrunk generation's state, from the snapshots its ranks hold, each verified
        by checksum first."""
        self._checked_everywhere(plan.step, "reshard",
                                 lambda: [snap.verify() for snap in self.held.values()])
        registry, own = self.job.registry, plan.kept[self.world.rank]
        newcomers = frozenset(n for n, old in enumerate(plan.kept) if old < 0)
        header = reshard(self.held, {int(o): n for o, n in plan.providers.items()},
                         Mesh(*plan.old_mesh, tp=self.tp), Mesh(*plan.mesh, tp=self.tp),
                         registry.entries(),
                         own=own if own >= 0 else None, group=self.replication,
                         newcomers=newcomers)
        self.held = {}  # in the state now: the buffers go
        if own >= 0:
            load_items(header, registry)
        else:  # a newcomer: rank 0's shared items; its own (RNGs) stay as they were built
            load_shared_items(header, registry)

    def first_step_done(self) -> str | None:
        """After a recovery's first step: its event, and the line that says it."""
        if self.recovered is None:
            return None
        rec, self.recovered = self.recovered, None
        marks = {**rec.pop("marks"), "first_step": time.time()}
        # the nodes: the lost ranks' in the failed generation, the new ranks' in this one
        rec["hosts_lost"] = self.path.hosts(rec["lost"], rec["gen"] - 1)
        rec["hosts_joined"] = self.path.hosts(rec["joined"], rec["gen"])
        names = list(marks)
        parts = {f"{a}->{b}": marks[b] - marks[a] for a, b in zip(names, names[1:])}
        total = marks["first_step"] - marks[names[0]]
        if rec["kind"] == "grow":  # no failure: not a recovery
            self.events.emit("warm_grow", **rec, marks=marks, parts_s=parts, total_s=total)
            return (f"warm grow: spare(s) joined at step {rec['step']}, the job goes on as "
                    f"{rec['world_size']} ranks, the new shards resharded from memory; "
                    f"training again {total:.2f}s after the vote to grow")
        self.events.emit("warm_recovery", **rec, marks=marks, parts_s=parts, total_s=total)
        if rec["kind"] == "shrink":
            return (f"warm shrink: rank(s) {rec['lost']} lost with no spare waiting; the "
                    f"survivors go on as {rec['world_size']} ranks from the state of step "
                    f"{rec['step']}, resharded from memory; training again {total:.2f}s "
                    f"after the failure")
        return (f"warm recovery: rank(s) {rec['lost']} replaced by spare(s), the state of "
                f"step {rec['step']} restored from memory; training again {total:.2f}s "
                f"after the failure")

    def close(self, timeout_s: float) -> None:
        self.snapshots.stop(timeout=timeout_s)


def warm_recovery(settings: Settings, job: Job, *, world: WorldInfo,
                  job_store: dist.Store | None, plan: dict | None, events: EventLog,
                  ledger: GoodputLedger, fence: Fence,
                  fits: Callable[[int], tuple[int, int]],
                  held: dict[int, Snapshot] | None = None) -> Recovery:
    """This rank's recovery: warm when on and a store outside the workers exists to meet
    in (a spare's ``plan`` names its place, or a shrunk survivor's, with the snapshots it
    ``held``), else cold only, said once in an event. ``fits(ranks)``: the mesh the run
    trains at with that many ranks, or ConfigError (what a shrink or a grow may reach)."""
    store = (outside_store(timedelta(seconds=settings.warm.budget_s))
             if settings.warm.enable else None)
    if store is None:
        if settings.warm.enable:
            events.emit("warm_path_off", rank=world.rank,
                        reason="no rendezvous store outside the workers "
                               "(run under llmtrain launch)")
        return NoWarmRecovery(fence.round_name(job_store) or "")
    p = settings.parallelism
    if backend_for(p, device_type(p)) == "nccl" and world.rank == 0:
        problems = nccl_problems()
        if problems or not NCCL_WARM_PROVEN:
            events.emit("warm_path_unproven", backend="nccl", problems=problems,
                        reason="the warm path has run on NCCL only as one rank on one GPU "
                               "(two or more ranks read from torch's source only; its "
                               "shrink, grow and preemption shrink have never run on "
                               "NCCL); a failure it cannot handle goes cold")
    hold_presence(owner(), timedelta(seconds=settings.warm.budget_s))  # dies: known at once
    per_node = plan["local_world_size"] if plan is not None else world.local_world_size
    round_id = plan["round_id"] if plan is not None else (
        fence.round_name(job_store) or round_of(job_store, None))
    path = WarmPath(settings.warm, store, round_id, world.rank, world.world_size, per_node,
                    gen=plan["gen"] if plan is not None else 0,
                    shapes=world_sizes(world, fits, settings.parallelism.tp))
    return WarmRecovery(settings, path, job, world=world, events=events, ledger=ledger,
                        fence=fence, held=held)
