"""The trainer: builds the run's components in order, then runs the loop a step at a time.

Each concern is a component with a small interface and a do-nothing variant, so the loop
calls it without asking whether it is on: run control (:mod:`llmtrain.control`),
checkpoints, warm recovery (:mod:`llmtrain.recovery.coordinator`), the integrity guard,
the watchdog, the health monitor and reporting. What a failure must not lose is in one
state registry (:mod:`llmtrain.state_registry`), which checkpoints and snapshots share.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain import fault_points, sharded_model
from llmtrain.checkpoint.manager import checkpoints_for
from llmtrain.checkpoint.snapshots import Snapshot
from llmtrain.checkpoint.state import TrainState
from llmtrain.config import JobConfig
from llmtrain.control import RunControl
from llmtrain.data.sampler import training_batches
from llmtrain.distributed.compile_cache import compile_cache_for
from llmtrain.distributed.parallelize import precompute_fp8_scales
from llmtrain.distributed.failure import abandon, shutdown
from llmtrain.distributed.process_group import (WorldInfo, build_mesh, connect_store,
                                                global_mean, init_process_group, side_group)
from llmtrain.distributed.signed_store import report_forged_to
from llmtrain.events import EventLog
from llmtrain.fsio import require_writable
from llmtrain.metrics.goodput import GoodputLedger
from llmtrain.metrics.reporting import Reporter, memory_gb
from llmtrain.optim import clip_gradients
from llmtrain.recovery.coordinator import warm_recovery
from llmtrain.recovery.fence import Fence
from llmtrain.recovery.warm import Plan, outside_store
from llmtrain.reliability.guard import IntegrityGuard
from llmtrain.reliability.health.monitor import start_monitor
from llmtrain.reliability.integrity import Integrity
from llmtrain.reliability.watchdog import configure_diagnostics, start_watchdog
from llmtrain.state_registry import RngState, SchedulerState, StateRegistry


@dataclass
class Summary:
    steps: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    first_loss: float
    final_loss: float
    memory_gb: float
    stopped: bool = False  # ended early on a stop request (llmtrain stop)
    complete: bool = False  # ended at training.steps: a later start extends the run


class Trainer:
    def __init__(self, cfg: JobConfig, plan: dict | None = None,
                 held: dict[int, Snapshot] | None = None):
        """``plan``: a warm spare's assignment (it takes a lost rank's place), or a shrunk
        survivor's, with the snapshots it ``held`` (see :class:`Resized`)."""
        entered = time.time()
        self.cfg, self.world = cfg, WorldInfo.from_env()
        cfg.validate(self.world.world_size)
        t, rank = cfg.training, self.world.rank
        fault_points.install(cfg.reliability.faults, rank)
        require_writable("training.run_dir", t.run_dir)
        if cfg.checkpoint.enable:
            require_writable("checkpoint.url", cfg.checkpoint_url)
        self.events = EventLog(t.run_dir, rank)
        report_forged_to(self.events)  # a control key in the store nobody with the secret wrote
        self.ledger = GoodputLedger(self.events, enabled=rank == 0)
        if plan is None:  # a warm spare joins the running attempt; its waiting costs nothing
            self.ledger.launched(world_size=self.world.world_size, host=self.world.host,
                                 entered=entered)
        self.reporter = Reporter(cfg, self.world, self.events, self.ledger,
                                 spare=plan is not None)
        # loads on a thread while the group forms; the first step waits for it
        self.compile_cache = compile_cache_for(cfg, rank, self.world.local_rank, self.events)
        with self.ledger.span("startup", "data"):  # first: a bad shard fails before a group
            self.data = training_batches(cfg, rank, self.world.world_size)
        if cfg.reliability.watchdog:
            configure_diagnostics(cfg.reliability, t.run_dir)
        with self.ledger.span("startup", "store_connect"):
            job_store = connect_store(self.world, cfg.reliability) if plan is None else None
            timeout = cfg.reliability.fence_timeout_s
            self.fence = Fence(outside_store(timedelta(seconds=timeout)), self.events, timeout)
            self.recovery = warm_recovery(cfg, self, world=self.world, job_store=job_store,
                                          plan=plan, events=self.events, ledger=self.ledger,
                                          fence=self.fence, held=held)
        self.registry = StateRegistry()
        self.state = TrainState(self.registry, rank, self.world.world_size)
        store = job_store if plan is None else self.recovery.spare_store(plan["step"])
        self.control_group = self.form_group(store, "startup" if plan is None else "restart")
        self.integrity = Integrity.for_run(cfg, self.events, self.device, self.mesh,
                                           spare=plan is not None)
        for item in (self.data, RngState(self.device), self.integrity):
            self.registry.register(item)
        with self.ledger.span("startup", "components"):
            self.watchdog = start_watchdog(
                cfg.reliability, t.run_dir, self.events, rank, self.world.world_size,
                namespace=self.recovery.namespace, fence=self.fence,
                evict=self.recovery.evict,
                on_exit=self.recovery.give_up)  # the agents must restart all, not wait
            self.health = start_monitor(cfg.health, self.device, host=self.world.host,
                                        local_rank=self.world.local_rank, events=self.events,
                                        on_pass=self.reporter.health_pass)
            self.control = RunControl(cfg.control, self.control_group, run_dir=t.run_dir,
                                      rank=rank, host=self.world.host, events=self.events,
                                      health=self.health, can_grow=self.recovery.can_grow)
            self.checkpoints = checkpoints_for(cfg, self.world.world_size, events=self.events,
                                               device=self.device, fence=self.fence.check,
                                               control_group=self.control_group)
            self.guard = IntegrityGuard(self.integrity, checkpoints=self.checkpoints,
                                        recovery=self.recovery, control=self.control,
                                        reporter=self.reporter, watchdog=self.watchdog,
                                        ledger=self.ledger, events=self.events)
        self.step = self._first_state(plan)
        with self.ledger.span("startup", "compile_cache"):
            self.compile_cache.ready()
        self.recovery.start(self.step, self.control_group)
        self.reporter.run_start(self.device, cfg.accumulation_steps(self.world.world_size))

    # -- building ---------------------------------------------------------------------

    def form_group(self, store: dist.Store, category: str) -> dist.ProcessGroup:
        """The parts bound to the job's process group, built at start and in each new
        generation (warm path); returns the generation's control group."""
        cfg, span = self.cfg, self.ledger.span
        self.fence.join(self.recovery.membership())  # no rank trains before all name it
        with span(category, "process_group"):
            self.device = init_process_group(cfg.parallelism, cfg.reliability, self.world, store)
        # CPU denormals run math (and torchao's FP8 emulation) 50x slower late in
        # training, when gradients get small; flushing them costs no accuracy.
        torch.set_flush_denormal(self.device.type == "cpu")
        with span(category, "device_mesh"):
            self.mesh = build_mesh(self.device, cfg.mesh_shape(self.world.world_size),
                                   cfg.reliability.collective_timeout_s)
        # a re-formed group restores from memory, not from init_from
        init_from = cfg.checkpoint.init_from if category == "startup" else ""
        self.model, self.optimizer, self.scheduler, self.fp8_scales = sharded_model.build(
            cfg, self.mesh, self.device, lambda part: span(category, part), init_from=init_from)
        self.registry.bind(self.model, self.optimizer, SchedulerState(self.scheduler))
        group = side_group(cfg.reliability.collective_timeout_s)
        self.recovery.group_formed()
        return group

    def _first_state(self, plan: dict | None) -> int:
        """The step training starts after: a spare's from its buddy's replica, else the
        newest checkpoint's (0: none)."""
        if plan is not None:
            return self.guard.restored(self.recovery.join_as_spare(Plan.from_assignment(plan)))
        if not (self.cfg.checkpoint.enable and self.cfg.checkpoint.resume):
            return 0
        self.watchdog.beat(0, "resume", long=True)
        with self.ledger.span("checkpoint_load", "resume"):
            step = self.checkpoints.resume(self.state)
        if step:
            self.reporter.line(f"resumed from the checkpoint of step {step} in "
                               f"{self.cfg.checkpoint_url}")
        return step

    # -- the warm path's side of a new generation (recovery.coordinator.Job) -----------

    def leave_group(self, deadline: float) -> None:
        self.checkpoints.wait(max(0.0, deadline - time.monotonic()))
        abandon()
        self.watchdog.new_generation()

    def rejoin(self, store: dist.Store) -> dist.ProcessGroup:
        self.control_group = self.form_group(store, "restart")
        self.control.bind(self.control_group)
        self.checkpoints.bind_groups(self.control_group)
        return self.control_group

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> Summary:
        """Trains to ``training.steps`` or a stop; a failure the warm path survives is
        survived here, any other raised for the cold path."""
        start, first_step = time.perf_counter(), self.step
        self.reporter.resume_at(self.step)
        self.ledger.steps_done(self.step)  # productive time starts here
        while self.step < self.cfg.training.steps:
            try:
                if self.run_step(first_step):
                    break
            except (RuntimeError, OSError) as e:
                # a rank cut off from the job while it re-formed says no more (Fenced)
                self.fence.stop_if_superseded("a report of its failure")
                restored = self.recovery.recover(e, self.step)
                if restored is None:
                    raise
                self.went_back(self.guard.restored(restored))
        self.ledger.steps_done(self.step)
        self.control.let_the_failed_exit_first()
        return self.finish(time.perf_counter() - start, first_step)

    def run_step(self, first_step: int) -> bool:
        """One step, then what follows it; True when the run must stop."""
        step, began = self.step + 1, time.perf_counter()
        with self.watchdog.diagnosing():
            if fault_points.armed():  # strike after the last save's copy, in order
                self.wait_staged(step)
            fault_points.point("step", step, self.model)
            micro_batches = self.data.next_step()
            if step in self.integrity.skips:
                self.skip_step(step)
                loss = None  # nothing trained: no loss to report
            else:
                loss = self.train_step(micro_batches)
        self.step = step
        self.watchdog.beat(step, "step")
        self.after_first_steps(step, first_step, time.perf_counter() - began)
        t = self.cfg.training
        log = step % self.cfg.metrics.log_every == 0 or step in (first_step + 1, t.steps)
        if log or self.integrity.check_due(step):
            back_to = self.guard.review(step, self.grad_norm, self.state)
            if back_to is not None:
                return self.went_back(back_to)  # rolled back: on from the checkpoint's step
        if self.control.sdc_named:
            return True
        self.recovery.maybe_snapshot(step)
        if log:
            self.report(step, loss)
        return self.save_or_stop(step)

    def after_first_steps(self, step: int, first_step: int, seconds: float) -> None:
        self.reporter.line(self.recovery.first_step_done())
        self.reporter.step_timed(step, seconds)
        if step == first_step + 1:
            self.reporter.startup_done(self.watchdog, step)
            # after it: saving is not part of the start-up
            self.reporter.line(self.compile_cache.first_step_done())
            self.checkpoints.prepare(self.state, step)  # the optimizer's state exists now

    def went_back(self, step: int) -> bool:
        """The state is that of ``step`` again (a rollback or a warm restore)."""
        self.step = step
        self.reporter.resume_at(step)
        return False

    def report(self, step: int, local_loss: torch.Tensor | None) -> None:
        """``local_loss``: None for a skipped step, which has no loss (nor a gradient
        norm) to report."""
        if local_loss is None:
            loss = None
        else:  # the only host sync of the step (integrity's verdicts were read with it)
            loss = self.integrity.loss if self.cfg.integrity.enable else global_mean(local_loss)
        advice = self.reporter.step(step, loss, lr=self.scheduler.get_last_lr()[0],
                                    grad_norm=self.grad_norm, device=self.device,
                                    watchdog=self.watchdog)
        if advice:
            self.checkpoints.adopt_interval(advice.optimal_interval_s, asdict(advice))

    def save_or_stop(self, step: int) -> bool:
        """Saves when due (always after the last step, and before stopping, but never a
        state that failed its check), grows when the ranks voted to, and after a
        preemption's save goes on without the preempted nodes where it can; True when the
        run must stop now."""
        if self.control.unhealthy(step) and self.recovery.leave():
            return True  # leave now, unsaved: the survivors go on warm with a spare
        verdict = self.control.vote(step, time_due=self.checkpoints.time_due(step),
                                    idle=step in self.integrity.skips)
        final = verdict.stop or step == self.cfg.training.steps
        if self.checkpoints.due(step, by_time=verdict.save_by_time, final=final):
            back_to = self.guard.review(step, self.grad_norm, self.state, save=True)
            if back_to is not None:
                return self.went_back(back_to)
            self.save(step, final)
        if verdict.grow and not final:
            self.recovery.grow(step)  # raises Resized: the trainer is built anew, larger
        if verdict.preempt and step < self.cfg.training.steps:  # the others may go on
            self.recovery.let_go(step, self.control.signal is not None, self.control_group)
        return verdict.stop

    def save(self, step: int, final: bool) -> None:
        """Saves the state of ``step`` (the copy blocks, the write goes on behind)."""
        # a sync save, and one that waits for the previous save's write (13 GB of a 1B
        # model's state took longer than the 5 s learned timeout on an H100), cannot beat
        waits = self.cfg.checkpoint.mode == "sync" or (
            self.checkpoints.writing() and self.cfg.checkpoint.if_busy == "wait")
        self.watchdog.beat(step, "checkpoint", long=final or waits)
        self.ledger.steps_done(step)
        with self.ledger.span("checkpoint_stall", f"save step {step}"):
            self.checkpoints.save(step, self.state, final=final,
                                  checked=self.cfg.integrity.enable)
        self.watchdog.beat(step, "step")

    # -- one step ---------------------------------------------------------------------

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, then one optimizer step.
        Returns this rank's mean loss (a tensor, so reading it costs no sync)."""
        step, beat = self.step + 1, self.watchdog.beat
        if self.fp8_scales:  # of the weights as they are now: stepped, resumed or restored
            precompute_fp8_scales(self.model)
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            beat(step, "forward")
            loss = self.loss(inputs, targets, step)
            beat(step, "backward")
            (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
            if i == 0 and self.integrity.recompute_due(step):
                self.recompute(step, own=loss.detach())
        beat(step, "optimizer")
        self.grad_norm = clip_gradients(self.model, self.cfg.optim.max_grad_norm,
                                        need_norm=self.cfg.integrity.enable)
        loss = loss_sum / len(micro_batches)
        # A bad step's verdict stops the update on the device: no host sync.
        self.optimizer.found_inf = self.integrity.judge(step, loss, self.grad_norm)
        self.wait_staged(step)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def wait_staged(self, step: int) -> None:
        """The update may not change the state while a save still copies it out; the
        copy overlaps forward and backward, so this rarely waits."""
        if not self.checkpoints.staged():
            # a first save pins its host buffers: seconds for a GPU's state, not a hang
            self.watchdog.beat(step, "checkpoint_staging", long=True)
            with self.ledger.span("checkpoint_stall", f"staging before step {step}"):
                self.checkpoints.wait_staged()

    def skip_step(self, step: int) -> None:
        """A step of ``integrity.skip_steps`` (or one a rollback learned): its batch is
        consumed, the schedule moves on, nothing is trained; as a judged-bad step does.
        It has no loss and no gradient norm (None: not the last trained step's)."""
        self.grad_norm = None
        self.scheduler.step()
        self.events.emit_once("step_skipped", step=step, reason="skip_steps")

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        # Asynchronous from pinned memory; the batch is never written to, so nothing can race.
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        return fault_points.point("loss", step, loss)

    def recompute(self, step: int, own: torch.Tensor) -> None:
        """Computes the next rank's first micro-batch here too (see IntegrityGuard)."""
        inputs, targets = self.data.peer_micro_batch((self.world.rank + 1) % self.world.world_size)
        with torch.no_grad():
            peer = self.loss(inputs, targets, step)
        self.guard.compare_recompute(step, own, peer)

    # -- the end ----------------------------------------------------------------------

    def finish(self, wall: float, first_step: int) -> Summary:
        tokens = (self.step - first_step) * self.cfg.training.global_batch_size \
            * self.cfg.data.seq_len
        s = Summary(steps=self.step, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                    first_loss=self.reporter.first_loss, final_loss=self.reporter.loss,
                    memory_gb=memory_gb(self.device), stopped=self.control.finishing,
                    complete=self.step == self.cfg.training.steps)
        self.control.run_ended(complete=s.complete)
        self.reporter.run_end(s)
        return s

    exit_code = property(lambda self: self.control.exit_code)

    def close(self, failed: bool = False, timeout_s: float = 30.0) -> None:
        """Stops every component (its time goes in the ledger, as "other"). ``failed``:
        ended by an exception; waits are bounded by ``timeout_s``, and the groups are
        abandoned (NCCL's aborted): destroying them can wait for ever on a dead peer."""
        started, bound = time.time(), timeout_s if failed else None
        try:
            for part in (self.data, self.health, self.reporter, self.watchdog):
                part.close()
            self.control.close(timeout_s)
            self.checkpoints.close(bound)
            self.recovery.close(min(10.0, timeout_s))
        finally:
            (abandon if failed else shutdown)()
            self.ledger.record("other", "shutdown", started, time.time())
            self.events.close()
