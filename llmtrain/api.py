"""llmtrain's reliability for any PyTorch training loop.

A loop gets everything llmtrain's own trainer gets (warm recovery from in-memory
snapshots, with spares or by shrinking and growing; the flight-recorder watchdog; GPU
health checks; the ranks' agreed stop and save; sharded async checkpoints with an atomic
commit; bad-step skips and rollbacks; goodput and Prometheus metrics) through one
``Session``::

    def build(world: llmtrain.World) -> llmtrain.Parts:   # on each new process group
        model = fully_shard(MyModel().to(world.device), mesh=world.mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return llmtrain.Parts(model, optimizer, state={"data": loader_position})

    with llmtrain.start(llmtrain.Settings(run_dir="runs/mine", steps=1000), build) as run:
        while run.running:
            with run.step() as step:                       # a failure inside is recovered
                loss = loss_of(run.parts.model, batch(step))
                loss.backward()
                run.optimizer_step(loss)                   # judged, then applied or skipped
                run.parts.optimizer.zero_grad()
    sys.exit(run.exit_code)

The session owns the process group: it forms it (and the device mesh of
``settings.parallelism``), then calls ``build`` for what depends on it, at the start and
again whenever the warm path re-forms the group (a lost rank replaced, the job shrunk or
grown). What ``build`` returns is what a failure must not lose: the model's and the
optimizer's state (any optimizer's) and every item in ``state`` (anything with
``state_dict()``/``load_state_dict()``, as DCP's ``Stateful``: an LR scheduler, a data
loader's position), saved in checkpoints and snapshots and restored into the new build.
After each step ``Session.action`` says what happened: the loop went on, stopped,
went back to an earlier step (restored), or was rebuilt at another world size (resized);
``run.parts`` and ``run.world`` are always the current ones.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from llmtrain import fault_points
from llmtrain.checkpoint.in_place import release_slots
from llmtrain.checkpoint.manager import checkpoints_for
from llmtrain.checkpoint.state import TrainState
from llmtrain.config import Settings, mesh_shape
from llmtrain.control import RunControl
from llmtrain.distributed.failure import abandon, shutdown
from llmtrain.distributed.process_group import (WorldInfo, build_mesh, connect_store,
                                                global_mean, init_process_group, side_group)
from llmtrain.distributed.signed_store import report_forged_to
from llmtrain.events import EventLog
from llmtrain.exit_codes import ExitCode
from llmtrain.fsio import require_writable
from llmtrain.metrics.goodput import GoodputLedger
from llmtrain.metrics.reporting import Reporter, RunInfo, memory_gb
from llmtrain.optim import clip_to, global_norm, square_norm_share
from llmtrain.parts import Action, Parts, Summary, World, state_items
from llmtrain.placement import SPARE_ENV, place, refuse_if_excluded, spare_assignment, stop_agent
from llmtrain.recovery.coordinator import warm_recovery, was_reported
from llmtrain.recovery.fence import Fence
from llmtrain.recovery.interface import Resized
from llmtrain.recovery.presence import RoundWatch, round_nodes, say_bye
from llmtrain.recovery.warm import Plan, outside_store
from llmtrain.reliability.guard import IntegrityGuard
from llmtrain.reliability.health.monitor import start_monitor
from llmtrain.reliability.integrity import Integrity, TrainingDiverged, optimizer_step
from llmtrain.reliability.watchdog import configure_diagnostics, start_watchdog
from llmtrain.state_registry import RngState, StateRegistry

__all__ = ["Action", "Parts", "RunInfo", "Session", "Settings", "Summary", "World", "start"]

log = logging.getLogger(__name__)

# what a session that goes on at another size waits, at most, for what is left of the
# generation it left (see Session._resize)
RESIZE_CLOSE_S = 1.0


def start(settings: Settings, build: Callable[[World], Parts], *,
          info: RunInfo | None = None,
          fits: Callable[[int], tuple[int, int]] | None = None) -> Session:
    """This process's session, started: cold (resumed from the newest checkpoint that
    verifies), or, in a warm spare a standby launcher started, once the job assigns it a
    lost rank (restored from that rank's snapshot replica). See ``Session`` for the
    parameters.

    Raises:
        ConfigError: ``settings`` cannot work at this world size (the message names the
            field and what to set).
        SystemExit: code 0 in a warm spare whose job ended without needing it; code 76
            (EXCLUDE_NODE) on a node excluded from the run earlier.
    """
    refuse_if_excluded(settings.run_dir)
    if os.environ.get(SPARE_ENV) != "1":
        return Session(settings, info=info, fits=fits).start(build)
    plan = spare_assignment()  # its place in the job: the session is that rank's
    if plan is None:
        log.info("llmtrain: the job ended without needing this warm spare")
        raise SystemExit(ExitCode.CLEAN)
    return Session(settings, info=info, fits=fits, joining=True).join(build, plan)


class Session:
    """One rank's reliability for a training loop: built from ``settings``, then started
    with ``start`` (cold) or ``join`` (a warm spare's or a resized rank's
    start); ``start`` picks. ``info`` says what the run trains, for its reports;
    ``fits(ranks)`` gives the mesh the run trains at with that many ranks or raises
    ConfigError (default: ``settings.parallelism``'s mesh), which is what a shrink or a
    grow may reach.

    Used as a context manager it closes itself: an exception that leaves the block is
    recorded as the rank's failure (the start of the recovery clock) and ends the
    session as failed."""

    world: WorldInfo
    """Who this rank is now: its rank, the world's size, its place on its node, its host
    (a resize changes them)."""
    device: torch.device
    """This rank's device (its GPU under CUDA, else the CPU)."""
    mesh: DeviceMesh
    """The device mesh of the current process group, which ``build`` built the parts on."""
    parts: Parts
    """What ``build`` returned for the current process group: read it after every step."""
    action: Action
    """What the last step ended in."""
    events: EventLog
    """This rank's event log (``events/rank-N.jsonl`` in the run dir)."""

    def __init__(self, settings: Settings, *, info: RunInfo | None = None,
                 fits: Callable[[int], tuple[int, int]] | None = None, joining: bool = False):
        """``joining``: the session joins the running job (``join``, a warm spare's),
        so its start is not a new attempt of the job."""
        self.settings, self.info = settings, info or RunInfo()
        self._fits = fits or (lambda ranks: mesh_shape(settings.parallelism, ranks))
        # where this process's run began, when the job has been resized since (its first
        # step, the time and the first loss): the summary covers every phase
        self._began: tuple[int, float, float] | None = None
        self._setup(joining)

    def _setup(self, joining: bool) -> None:
        """What exists before any group: who this rank is, its event log and reports; a
        new attempt is recorded first, so that whatever the loop does before its start
        (reading its data) counts in it."""
        entered = time.time()
        self.world = world = WorldInfo.from_env()
        s = self.settings
        s.validate(world.world_size)
        self._fits(world.world_size)
        fault_points.install(s.reliability.faults, world.rank)
        require_writable("training.run_dir", s.run_dir)
        if s.checkpoint.enable:
            require_writable("checkpoint.url", s.checkpoint_url)
        self.events = EventLog(s.run_dir, world.rank)
        report_forged_to(self.events)  # a control key in the store nobody with the secret wrote
        self.ledger = GoodputLedger(self.events, enabled=world.rank == 0)
        if not joining:
            self.ledger.launched(world_size=world.world_size, host=world.host, entered=entered)
        self.reporter = Reporter(s, self.info, world, self.events, self.ledger,
                                 before_long_read=self._reading_events)
        if s.reliability.watchdog:
            configure_diagnostics(s.reliability, s.run_dir)
        self.action = Action.GO_ON
        self._step = self._first_step = 0
        self._stopped, self._skipped = False, False
        self._loss: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None
        self._started_at = time.perf_counter()
        self._open = False
        self._exit: ExitCode | None = None  # set when the session ended on a diverged run
        self.summary: Summary | None = None  # the run's, once finished

    # -- the two starts -----------------------------------------------------------------

    def start(self, build: Callable[[World], Parts]) -> Session:
        """A cold start: forms the process group, builds the parts, resumes from the
        newest checkpoint that verifies (if ``checkpoint.resume``)."""
        self._build = build
        with self.ledger.span("startup", "store_connect"):
            job_store = connect_store(self.world, self.settings.reliability)
            self._recovery_for(job_store, None, None)
        self._components(job_store, "startup", spare=False)
        self._begin(self._resume())
        return self

    def join(self, build: Callable[[World], Parts], plan: dict,
             held: dict | None = None) -> Session:
        """A start into the running job: a warm spare's, in the place ``plan`` assigns
        (its state from its buddy's replica), or a rank's after the job shrank or grew
        (its state resharded from the snapshots the ranks ``held``)."""
        self.reporter.joined_running()  # it joined a running attempt: it did not restart
        self._build = build
        with self.ledger.span("startup", "store_connect"):
            self._recovery_for(None, plan, held)
        assigned = Plan.from_assignment(plan)
        self._components(self.recovery.spare_store(assigned), "restart", spare=True)
        self._begin(self.guard.restored(self.recovery.join_as_spare(assigned)))
        return self

    def _recovery_for(self, job_store: dist.Store | None, plan: dict | None,
                      held: dict | None) -> None:
        timeout = self.settings.reliability.fence_timeout_s
        self.fence = Fence(outside_store(timedelta(seconds=timeout)), self.events, timeout)
        self.recovery = warm_recovery(self.settings, self, world=self.world,
                                      job_store=job_store, plan=plan, events=self.events,
                                      ledger=self.ledger, fence=self.fence, fits=self._fits,
                                      held=held)

    def _components(self, store: dist.Store, category: str, spare: bool) -> None:
        s, world, events = self.settings, self.world, self.events
        self.registry = StateRegistry()
        self.state = TrainState(self.registry, world.rank, world.world_size)
        self.control_group = self._form(store, category)
        self.integrity = Integrity.for_run(s.integrity, s.run_dir, events, self.device,
                                           self.mesh, self.info.samples_per_step, spare=spare)
        for item in (RngState(self.device), self.integrity):
            self.registry.register(item)
        with self.ledger.span("startup", "components"):
            self.watchdog = start_watchdog(
                s.reliability, s.run_dir, events, world.rank, world.world_size,
                world.local_world_size, namespace=self.recovery.namespace(), fence=self.fence,
                evict=self.recovery.evictor(),
                on_exit=self.recovery.give_up)  # the agents must restart all, not wait
            self.health = start_monitor(s.health, self.device, host=world.host,
                                        local_rank=world.local_rank, events=events,
                                        on_pass=self.reporter.health_pass,
                                        on_fatal=self._gpu_failed)
            self.control = RunControl(s.control, self.control_group, run_dir=s.run_dir,
                                      rank=world.rank, host=world.host, events=events,
                                      health=self.health, can_grow=self.recovery.can_grow)
            manifest = {"model": self.info.name, **self.info.manifest,
                        "mesh": list(self._fits(world.world_size)), "tp": s.parallelism.tp}
            self.checkpoints = checkpoints_for(s, manifest=manifest, events=events,
                                               device=self.device, fence=self.fence.check,
                                               control_group=self.control_group)
            self.guard = IntegrityGuard(self.integrity, checkpoints=self.checkpoints,
                                        recovery=self.recovery, control=self.control,
                                        reporter=self.reporter, watchdog=self.watchdog,
                                        ledger=self.ledger, events=events)
        self._open = True

    def _form(self, store: dist.Store, category: str) -> dist.ProcessGroup:
        """The process group, the mesh and the parts built on them: at start and in each
        new generation (warm path); returns the generation's control group."""
        s, span = self.settings, self.ledger.span
        self.fence.join(self.recovery.membership())  # no rank trains before all name it
        # a warm generation's members have all come (recovery.spare_store, assemble): one
        # that dies before its group forms costs the warm path's budget at most, not the
        # creation timeout (a grow's survivors waited 300 s for a spare killed as it came)
        timeout_s = (s.reliability.init_timeout_s if category == "startup" else
                     min(s.reliability.init_timeout_s, s.warm.budget_s))
        with span(category, "process_group"):
            # a cold generation's round may lose a node before its ranks come (RoundWatch)
            watching = category == "startup" and self.world.local_rank == 0
            watch = RoundWatch(round_nodes() if watching else set(),
                               lambda: outside_store(timedelta(seconds=5)),
                               self._round_node_lost)
            try:
                fault_points.point("process_group", 0)
                self.device = init_process_group(s.parallelism, s.reliability, self.world,
                                                 store, timeout_s)
            finally:
                watch.stop()
        with span(category, "device_mesh"):
            self.mesh = build_mesh(self.device, self._fits(self.world.world_size),
                                   s.reliability.collective_timeout_s, s.parallelism.tp)
        w = self.world
        self.parts = self._build(World(w.rank, w.world_size, w.local_rank, w.host,
                                       self.device, self.mesh, first=category == "startup",
                                       timed=lambda part: span(category, part)))
        if not self.info.name:
            self.info.name = type(self.parts.model).__name__
        if not self.info.params:
            self.info.params = sum(p.numel() for p in self.parts.model.parameters())
        self.registry.bind(self.parts.model, self.parts.optimizer, *state_items(self.parts))
        group = side_group(s.reliability.collective_timeout_s, "control")
        self.recovery.group_formed()
        return group

    def _round_node_lost(self, nodes: set[str]) -> None:
        """A node of this cold generation's rendezvous round died before the process group
        formed: its ranks will never come. Nothing is trained or held yet, so this rank
        ends RETRYABLE at once, and its agent starts the next round (which drops the dead
        node) instead of waiting out ``reliability.init_timeout_s`` in torch's creation."""
        log.error("llmtrain: rendezvous node(s) %s died before the process group formed; "
                  "rank %d ends for the next round", ", ".join(sorted(nodes)), self.world.rank)
        self.events.emit("round_node_lost", host=self.world.host, nodes=sorted(nodes))
        self.events.close()
        say_bye()
        logging.shutdown()
        os._exit(ExitCode.RETRYABLE)

    def _resume(self) -> int:
        """The newest checkpoint's step (0: none, or resuming is off)."""
        c = self.settings.checkpoint
        if not (c.enable and c.resume):
            return 0
        self.watchdog.beat(0, "resume", long=True)
        with self.ledger.span("checkpoint_load", "resume"):
            step = self.checkpoints.resume(self.state)
        if step:
            self.reporter.line(f"resumed from the checkpoint of step {step} in "
                               f"{self.settings.checkpoint_url}")
        return step

    def _begin(self, step: int) -> None:
        release_slots()  # a prepared worker's pinned load slots, where no load took them
        self._step = self._first_step = step
        self.recovery.start(step, self.control_group)
        self.reporter.run_start(self.device, self.info.micro_batches, self.mesh)
        self.reporter.resume_at(step)
        self.ledger.steps_done(step)  # productive time starts here
        self._started_at = time.perf_counter()

    # -- the warm path's side of a new generation (recovery.coordinator.Job) -----------

    def leave_group(self, deadline: float, stuck_s: float) -> None:
        self.checkpoints.leave(max(0.0, deadline - time.monotonic()), stuck_s)
        abandon()
        self.watchdog.new_generation()

    def rejoin(self, store: dist.Store) -> dist.ProcessGroup:
        self.watchdog.new_generation()  # every member has left the old groups
        self.control_group = self._form(store, "restart")
        self.control.bind(self.control_group)
        self.checkpoints.bind_groups(self.control_group)
        return self.control_group

    # -- the loop -------------------------------------------------------------------

    @property
    def step_done(self) -> int:
        """The last step trained (or restored): the next is this plus one."""
        return self._step

    @property
    def running(self) -> bool:
        """Whether the loop goes on: not stopped, and short of ``settings.steps``."""
        return not self._stopped and self._step < self.settings.steps

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """Around one step, whose number it yields: the watchdog's heartbeat and hang
        diagnosis, the chaos harness's fault points; after the block, the step's
        reports, integrity check, snapshot, vote and save (see ``action``). A failed
        collective inside it (a lost peer) is recovered warm where the warm path can:
        the exception is swallowed and the state is an earlier step's (RESTORED), or the
        job's size changed (RESIZED); otherwise it is raised, for the cold path."""
        step = self._step + 1
        self.action, self._skipped = Action.GO_ON, False
        self._loss = self._grad_norm = None
        began = time.perf_counter()
        try:
            with self.watchdog.diagnosing():
                if fault_points.armed():  # strike after the last save's copy, in order
                    self._wait_staged(step)
                fault_points.point("step", step, self.parts.model)
                yield step
            self._step = step
            self._after(step, time.perf_counter() - began)
        except Resized as resized:
            self._resize(resized)
        except (RuntimeError, OSError) as e:
            # a rank cut off from the job while it re-formed says no more (Fenced)
            self.fence.stop_if_superseded("a report of its failure")
            try:
                restored = self.recovery.recover(e, self._step)
            except Resized as resized:
                self._resize(resized)
                return
            if restored is None:
                raise
            self._went_back(self.guard.restored(restored))

    def _gpu_failed(self, finding) -> None:
        """The health monitor's thread, as it sees this rank's GPU fail: the node is
        excluded and, on the warm path, the rank says it is gone at once, so that its
        peers stop waiting for it in the step's collectives and a spare takes its place,
        whatever the step is doing; its own training thread stops at the step's end (or
        at the collective its peers left), as when it sees the verdict itself."""
        self.control.unhealthy(self._step)
        self.recovery.leave_early()

    def beat(self, phase: str) -> None:
        """Tells the watchdog what the step does now ("forward", "backward", ...): a hang
        report names it."""
        self.watchdog.beat(self._step + 1, phase)

    def skipping(self) -> bool:
        """Whether the step must not train (``integrity.skip_steps``, or a batch a
        rollback learned to skip): the loop consumes its batch and moves its schedule,
        and trains nothing."""
        step = self._step + 1
        if not self.integrity.skips_step(step):
            return False
        self._skipped, self._grad_norm = True, None
        self.events.emit_once("step_skipped", step=step, reason="skip_steps")
        return True

    def recompute_due(self) -> bool:
        """Whether this step's first micro-batch of the next rank is recomputed here
        (``integrity.recompute_every``: see ``compare_recompute``)."""
        return self.integrity.recompute_due(self._step + 1)

    def compare_recompute(self, own: torch.Tensor, peer: torch.Tensor) -> None:
        """This rank's and its neighbour's loss of the neighbour's first micro-batch: a
        rank whose arithmetic is wrong disagrees with both neighbours."""
        self.guard.compare_recompute(self._step + 1, own, peer)

    def optimizer_step(self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None, *,
                       max_norm: float = 0.0) -> None:
        """Judges the step (its loss and global gradient norm: non-finite, or a spike)
        and applies the optimizer's step unless it is bad, once a save's copy of the
        state is done. No host sync with a fused AdamW or SGD; one with any other
        optimizer (see ``llmtrain.reliability.integrity.optimizer_step``).

        Args:
            loss: this rank's mean loss of the step.
            grad_norm: the global gradient norm, if the loop computed it (its own
                ``clip_grad_norm_``); else llmtrain computes it, in the same collective
                as the verdict's exchange of losses (one collective fewer).
            max_norm: clips the gradients to this global norm first (0: no clipping),
                with the norm llmtrain computes: the loop then calls no
                ``clip_grad_norm_`` of its own.

        Raises:
            ValueError: both ``grad_norm`` and ``max_norm`` given (clip in one place).
        """
        step = self._step + 1
        if grad_norm is not None and max_norm:
            raise ValueError("optimizer_step: give grad_norm (the loop clipped) or max_norm "
                             "(llmtrain clips), not both")
        if isinstance(grad_norm, DTensor):  # clip_grad_norm_'s over FSDP2's shards
            grad_norm = grad_norm.full_tensor()
        share = (square_norm_share(self.parts.model, self.device) if grad_norm is None
                 and (max_norm or self.settings.integrity.enable) else None)
        self._loss = loss.detach()
        self.watchdog.beat(step, "optimizer")
        verdict = None
        if self.settings.integrity.enable:
            verdict, grad_norm = self.integrity.judge(step, self._loss, grad_norm, share)
        elif share is not None:
            grad_norm = global_norm(share)
        if max_norm:
            clip_to(self.parts.model, max_norm, grad_norm)
        self._grad_norm = grad_norm
        self._wait_staged(step)
        optimizer_step(self.parts.optimizer, verdict)

    def timed(self, part: str, category: str = "startup") -> contextlib.AbstractContextManager:
        """A block counted in the goodput ledger as ``part`` of ``category`` ("startup",
        "restart", "checkpoint_stall", ...): the start-up timeline shows it."""
        return self.ledger.span(category, part)

    def say(self, text: str | None) -> None:
        """A line on rank 0's console (and the log)."""
        self.reporter.line(text)

    def _wait_staged(self, step: int) -> None:
        """The update may not change the state while a save still copies it out; the
        copy overlaps forward and backward, so this rarely waits."""
        if not self.checkpoints.staged():
            # a first save pins its host buffers: seconds for a GPU's state, not a hang
            self.watchdog.beat(step, "checkpoint_staging", long=True)
            with self.ledger.span("checkpoint_stall", f"staging before step {step}"):
                self.checkpoints.wait_staged()

    def _after(self, step: int, seconds: float) -> None:
        """What follows a trained step: reports, the state's check, a snapshot, the vote,
        a save."""
        self.watchdog.beat(step, "step")
        self.reporter.announce(self.recovery.first_step_done())
        self.reporter.step_timed(step, seconds)
        if step == self._first_step + 1:
            self.reporter.startup_done()
            self.checkpoints.prepare(self.state, step)  # the optimizer's state exists now
        s = self.settings
        log_due = step % s.metrics.log_every == 0 or step in (self._first_step + 1, s.steps)
        if log_due or self.integrity.check_due(step):
            back_to = self.guard.review(step, self._grad_norm, self.state)
            if back_to is not None:  # rolled back: on from the checkpoint's step
                self._went_back(back_to)
                return
        if self.control.named_corrupt():
            return self._stop()
        self.recovery.maybe_snapshot(step)
        if log_due:
            self._report(step)
        if self._save_or_stop(step):
            self._stop()

    def _reading_events(self) -> None:
        """The reporter reads the event log back next, which may take long."""
        self.watchdog.beat(self._step, "events", long=True)

    def _stop(self) -> None:
        self._stopped, self.action = True, Action.STOP

    def _went_back(self, step: int) -> None:
        """The state is that of ``step`` again (a rollback or a warm restore)."""
        self._step, self.action = step, Action.RESTORED
        self.reporter.resume_at(step)

    def _report(self, step: int) -> None:
        if self._skipped:
            loss = None  # nothing trained: no loss to report
        elif self._loss is None:
            return  # the loop gave no loss
        else:  # the only host sync of the step (integrity's verdicts were read with it)
            loss = (self.integrity.last_loss() if self.settings.integrity.enable
                    else global_mean(self._loss))
        advice = self.reporter.step(step, loss,
                                    lr=self.parts.optimizer.param_groups[0]["lr"],
                                    grad_norm=self._grad_norm, device=self.device,
                                    slowdowns=self.watchdog.slowdowns())
        if advice:
            self.checkpoints.adopt_interval(advice.optimal_interval_s, asdict(advice))

    def _save_or_stop(self, step: int) -> bool:
        """Saves when due (always after the last step, and before stopping, but never a
        state that failed its check), grows when the ranks voted to, and after a
        preemption's save goes on without the preempted nodes where it can; True when the
        run must stop now."""
        if self.control.unhealthy(step) and self.recovery.leave():
            return True  # leave now, unsaved: the survivors go on warm with a spare
        verdict = self.control.vote(step, time_due=self.checkpoints.time_due(step),
                                    idle=self._skipped)
        last = self.settings.steps
        final = verdict.stop or step == last
        if self.checkpoints.due(step, by_time=verdict.save_by_time, final=final):
            back_to = self.guard.review(step, self._grad_norm, self.state, save=True)
            if back_to is not None:
                self._went_back(back_to)
                return False
            self._save(step, final)
        if verdict.grow and not final:
            self.recovery.grow(step)  # raises Resized: the parts are built anew, larger
        if verdict.preempt and step < last:  # the others may go on
            self.recovery.let_go(step, self.control.signalled(), self.control_group)
        return verdict.stop

    def _save(self, step: int, final: bool) -> None:
        """Saves the state of ``step`` (the copy blocks, the write goes on behind)."""
        c = self.settings.checkpoint
        # a sync save, and one that waits for the previous save's write (13 GB of a 1B
        # model's state took longer than the 5 s learned timeout on an H100), cannot beat
        waits = c.mode == "sync" or (self.checkpoints.writing() and c.if_busy == "wait")
        self.watchdog.beat(step, "checkpoint", long=final or waits)
        self.ledger.steps_done(step)
        with self.ledger.span("checkpoint_stall", f"save step {step}"):
            self.checkpoints.save(step, self.state, final=final,
                                  checked=self.settings.integrity.enable)
        self.watchdog.beat(step, "step")

    def _resize(self, resized: Resized) -> None:
        """The job goes on at another world size: this session ends as a failed one and
        starts again in this process as the rank the plan names (imports, data files and
        compiled code stay warm), its parts built anew and filled from the snapshots the
        ranks held."""
        plan, held = resized.assignment, resized.held
        if self._began is None:
            self._began = (self._first_step, self._started_at, self.reporter.losses()[0])
        # The generation's groups were left before Resized was raised (the writes in flight
        # waited for then): what is still pending on them (a vote) is void, and may never
        # complete; the usual 30 s wait for it would stall the job (one HSDP shrink took
        # 30.3 s to form its group, where others took 0.2-0.7 s: that wait, as far as seen).
        self._close(failed=True, timeout_s=RESIZE_CLOSE_S)
        # LOCAL_RANK (its GPU) stays: a shrink drops whole nodes, a grow adds them
        os.environ.update(place(plan))
        del resized
        self.parts = None  # the old model and optimizer: freed below
        gc.unfreeze()  # what a start froze (llmtrain.collector) holds the old parts' cycles
        gc.collect()
        self._setup(joining=True)
        self.join(self._build, plan, held)
        gc.freeze()
        self.action = Action.RESIZED

    # -- the end --------------------------------------------------------------------

    @property
    def exit_code(self) -> ExitCode:
        """What the launcher should do with this rank's process: CLEAN, RETRYABLE (stopped
        early: a signal, a peer's failure), EXCLUDE_NODE (its GPU failed) or FATAL (set
        when the session ended on a diverged run)."""
        return self._exit or self.control.exit_code

    def finish(self) -> Summary:
        """The run's end, once the loop is out: waits for the peers that failed to exit
        first, records the run's end and its goodput, and returns its summary (once a
        step: a later call at the same step returns the same)."""
        if self.summary is not None and self.summary.steps == self._step:
            return self.summary
        self.ledger.steps_done(self._step)
        self.control.let_the_failed_exit_first()
        first_loss, final_loss = self.reporter.losses()
        first_step, started_at, earlier_loss = self._began or (self._first_step,
                                                                self._started_at, math.nan)
        first_loss = first_loss if math.isnan(earlier_loss) else earlier_loss
        wall = time.perf_counter() - started_at
        tokens = (self._step - first_step) * self.info.tokens_per_step
        s = Summary(steps=self._step, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                    first_loss=first_loss, final_loss=final_loss,
                    memory_gb=memory_gb(self.device), trained=self._step - first_step,
                    stopped=self.control.stopped_on_request(),
                    complete=self._step == self.settings.steps)
        self.control.run_ended(complete=s.complete)
        self.reporter.run_end(s)
        self.summary = s
        return s

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is None:
            self.finish()
            self.close()
            return
        if isinstance(error, TrainingDiverged):  # a restart would diverge the same way
            self._exit = ExitCode.FATAL
            self.events.emit("fatal", host=self.world.host, step=self._step,
                             error=f"{type(error).__name__}: {error}")
        elif not was_reported(error):
            # The first sign of a failure elsewhere (a dead peer breaks our collective):
            # the start of the recovery clock, unless the warm path reported it already.
            self.events.emit("failure", host=self.world.host, step=self._step,
                             error=f"{type(error).__name__}: {error}"[:500])
        self.close(failed=True)

    def close(self, failed: bool = False, timeout_s: float = 30.0) -> None:
        """Stops every component (its time goes in the ledger, as "other"). ``failed``:
        ended by an exception; waits are bounded by ``timeout_s``, and the groups are
        abandoned (NCCL's aborted): destroying them can wait for ever on a dead peer.
        After a FATAL or EXCLUDE_NODE end, stops this node's torchrun agent, which would
        otherwise restart the workers into the same failure."""
        if not failed:  # an end on purpose: its process is not to be counted gone
            say_bye()
        self._close(failed, timeout_s)
        if self._open:
            stop_agent(self.exit_code)

    def _close(self, failed: bool = False, timeout_s: float = 30.0) -> None:
        started, bound = time.time(), timeout_s if failed else None
        try:
            if self._open:
                for part in (self.health, self.reporter, self.watchdog):
                    part.close()
                self.control.close(timeout_s)
                self.checkpoints.close(bound)
                self.recovery.close(min(10.0, timeout_s))
            else:
                self.reporter.close()
        finally:
            (abandon if failed else shutdown)()
            self.ledger.record("other", "shutdown", started, time.time())
            self.events.close()
