"""The trainer: builds every component from a JobConfig and runs the training loop."""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from llmtrain import fault_points
from llmtrain.checkpoint import hf
from llmtrain.checkpoint.manager import CheckpointManager
from llmtrain.checkpoint.snapshots import (Schedule, Snapshots, SnapshotError,
                                           restore_python_rng, shares_cores,
                                           state_tensors)
from llmtrain.checkpoint.state import TrainState
from llmtrain.config import ConfigError, JobConfig
from llmtrain.data import TokenDataset, check_vocab, shard_urls
from llmtrain.data.sampler import BatchIterator, GlobalSampler
from llmtrain.distributed.parallelize import fp8_all_gather, parallelize, precompute_fp8_scales
from llmtrain.distributed.process_group import (WorldInfo, abandon, build_mesh, connect_store,
                                                init_process_group, open_store, shutdown)
from llmtrain.events import EventLog, EventTail
from llmtrain.exit_codes import ExitCode
from llmtrain.fsio import probe_writable
from llmtrain.metrics import goodput
from llmtrain.metrics.console import ConsoleReporter, StepReport
from llmtrain.metrics.goodput import GoodputLedger, launch_time, process_start_time
from llmtrain.metrics.prometheus import Exporter
from llmtrain.model import Transformer, count_params, flops_per_token
from llmtrain.reliability.health.checks import HealthChecker, open_backend
from llmtrain.reliability.health.exclusion import exclude_host
from llmtrain.reliability.health.monitor import HealthMonitor, rank_gpu
from llmtrain.reliability.integrity import (Integrity, TrainingDiverged, learned_skips,
                                           replica_groups)
from llmtrain.reliability.watchdog import Watchdog, configure_diagnostics
from llmtrain.recovery.fence import Fence
from llmtrain.recovery.warm import (ColdPath, Plan, WarmPath, evict, outside_store,
                                    publish_endpoints, round_of)
from llmtrain.stop_request import StopRequestWatch, clear_request

# Dense bf16 peak FLOP/s per GPU, by a substring of the device name (FP8 doubles it).
# The first name found in the device's wins: the PCIe and NVL H100s are slower.
_PEAK_BF16_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
                    "A100": 312e12, "B200": 2250e12}


# Rollbacks from the same stretch of steps before the fault counts as persistent.
_MAX_ROLLBACKS = 3

# How long ranks stopped by a peer's failed health check wait before exiting.
_PEER_STOP_GRACE_S = 2.0


def _peak_flops(cfg: JobConfig, device: torch.device) -> float | None:
    if cfg.metrics.peak_tflops:
        return cfg.metrics.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in _PEAK_BF16_FLOPS.items() if k in name), None)
    return peak * 2 if peak and cfg.parallelism.fp8 != "none" else peak


def _memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _check_writable(field: str, url: str) -> None:
    """Fails before any process group starts if ``url`` cannot take files."""
    try:
        probe_writable(url, f".llmtrain-write-test-{os.getpid()}")
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"{field}={url!r} is not writable ({type(e).__name__}: {e}); "
                          f"give a writable local path or fsspec URL") from None


def _lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup to the peak, then cosine decay to ``min_ratio`` of it."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


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


class Trainer:
    def __init__(self, cfg: JobConfig, plan: dict | None = None):
        """``plan``: a warm spare's assignment (it takes a lost rank's place)."""
        entered = time.time()
        self.cfg = cfg
        self.world = WorldInfo.from_env()
        cfg.validate(self.world.world_size)
        t = cfg.training
        fault_points.install(cfg.reliability.faults, self.world.rank)
        self.accum_steps = cfg.accumulation_steps(self.world.world_size)
        self.is_logger = self.world.rank == 0

        _check_writable("training.run_dir", t.run_dir)
        if cfg.checkpoint.enable:
            _check_writable("checkpoint.url", cfg.checkpoint_url)
        self.events = EventLog(t.run_dir, self.world.rank)
        self.ledger = GoodputLedger(self.events, enabled=self.is_logger)
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if plan is None:  # a warm spare joins the running attempt; its waiting costs nothing
            self.ledger.attempt(world_size=self.world.world_size, host=self.world.host,
                                restart_count=restart)
            if not restart:  # the agent's start, rendezvous and spawn (a restart's: "restart")
                self.ledger.record("startup", "launch", launch_time(), process_start_time())
            self.ledger.record("startup", "imports", process_start_time(), entered)
        self.exporter = None
        if cfg.metrics.prometheus:
            self.exporter = Exporter(cfg.metrics, t.run_dir, rank=self.world.rank,
                                     local_rank=self.world.local_rank, host=self.world.host,
                                     world_size=self.world.world_size)
            self.exporter.start()
            self.events.listeners.append(self.exporter.observe)

        with self.ledger.span("startup", "data"):
            # Data first: a missing or truncated shard fails before any process group starts.
            check_vocab(cfg.data, cfg.model.vocab_size)
            dataset = TokenDataset(shard_urls(cfg.data, t.run_dir), cfg.data.seq_len)
            sampler = GlobalSampler(len(dataset), t.global_batch_size, cfg.data.seed,
                                    self.world.rank, self.world.world_size)
            # Pinned only where a GPU will take the batches (pinning needs CUDA).
            self.data = BatchIterator(dataset, sampler, t.micro_batch_size,
                                      prefetch=cfg.data.prefetch,
                                      pin_memory=torch.cuda.is_available()
                                      and cfg.parallelism.device != "cpu")

        if cfg.reliability.watchdog:
            configure_diagnostics(cfg.reliability, t.run_dir)
        with self.ledger.span("startup", "store_connect"):
            job = connect_store(self.world, cfg.reliability) if plan is None else None
            self.warm = self._warm_path(job, plan)
            store = job if plan is None else self.warm.group_store()
            self.fence = Fence(outside_store(timedelta(seconds=cfg.reliability.fence_timeout_s)),
                               self.events, cfg.reliability.fence_timeout_s)
            # the round's name: the warm path's, or agreed through the round's own store
            self.round_id = self.warm.round_id if self.warm else (
                round_of(job) if self.fence.store is not None else "")
        if plan is not None:
            fault_points.point("spare_assigned", plan["step"])
            self.warm.assemble(time.monotonic() + cfg.warm.budget_s)
        self._form_group(store, "startup" if plan is None else "restart")
        self.integrity = Integrity(
            cfg.integrity, events=self.events, device=self.device, rank=self.world.rank,
            world_size=self.world.world_size, replicas=replica_groups(self.mesh.mesh),
            global_batch_size=t.global_batch_size,
            # a spare learns them from its buddy's replica, not from a collective
            learned_skips=learned_skips(t.run_dir) if plan is None else set())
        self.checked_step = -1  # the last step whose state was checked
        self.recovered: dict | None = None  # a warm recovery, until its first step is done
        self.rollbacks: list[int] = []  # steps rolled back from, since the run got past them
        self.sdc_named: list[int] = []  # ranks whose replica diverged, when they must go

        self.step = 0
        self.grad_norm: torch.Tensor | None = None
        self.preempted = False
        self.excluded = False
        self.tokens_per_step = t.global_batch_size * cfg.data.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_flops = _peak_flops(cfg, self.device)
        self.console = ConsoleReporter(cfg.metrics, t.steps)
        self.goodput_at = 0.0
        # What the goodput accounting reads, followed incrementally (rank 0 only uses it).
        self.ledger_tail = EventTail(t.run_dir, keep=goodput.INPUTS)
        self.ledger_events: list[dict] = []
        self.watchdog = None
        with self.ledger.span("startup", "components"):
            if cfg.reliability.watchdog:
                store = open_store("watchdog", timedelta(seconds=30),
                                   self.warm and self.warm.round_id)
                self.watchdog = Watchdog(
                    cfg.reliability, store, t.run_dir, self.events, self.world.rank,
                    self.world.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", 0)),
                    # the agents must restart everyone, not wait for a warm verdict
                    on_exit=self.warm.give_up if self.warm else lambda: None,
                    evict=self.warm and partial(
                        evict, outside_store(timedelta(seconds=30), store.underlying_store),
                        wait_s=cfg.warm.evict_wait_s),
                    fence=self.fence if self.warm else None)
                self.watchdog.start()
            self.state = TrainState(self.model, self.optimizer, self.scheduler, self.data,
                                    self.world.rank, self.device)
            self.checkpoints = self.stop_requests = None
            if cfg.checkpoint.enable:
                if self.is_logger:  # one look-out is enough: the ranks vote on what it saw
                    self.stop_requests = StopRequestWatch(t.run_dir).start()
                self.checkpoints = CheckpointManager(
                    cfg.checkpoint, cfg.checkpoint_url, events=self.events, device=self.device,
                    manifest_base={"config_digest": cfg.digest(), "model": cfg.model.name,
                                   "model_config": asdict(cfg.model),
                                   "mesh": list(cfg.mesh_shape(self.world.world_size))},
                    fence=self.fence.check, requests=self.stop_requests)
            self.health = self._start_health_monitor() if cfg.health.monitor else None
            self.snapshots = None
            if self.warm is not None:
                w, c = cfg.warm, cfg.checkpoint
                # never further apart than checkpoints: warm must not redo more than cold
                most = (min(w.snapshot_max_every, c.interval_steps)
                        if c.enable and c.interval_steps else w.snapshot_max_every)
                self.snapshots = Snapshots(
                    Schedule(w.snapshot_every, w.snapshot_budget, most),
                    self.world.rank, buddy=self.warm.buddy, ward=self.warm.ward,
                    events=self.events,
                    shares_cores=shares_cores(self.device, self.warm.local_world_size))
                replication = dist.new_group(backend="gloo")
        if plan is not None:  # a warm spare: the lost rank's state comes from its buddy
            self.restore(Plan(**{k: v for k, v in plan.items() if k != "rank"}), replication)
        elif self.checkpoints is not None and cfg.checkpoint.resume:
            self.beat("resume", long=True)
            with self.ledger.span("checkpoint_load", "resume"):
                self.step = self.checkpoints.resume(self.state)
            if self.step and self.is_logger:
                self.console.line(f"resumed from the checkpoint of step {self.step} "
                                  f"in {cfg.checkpoint_url}")
        if self.snapshots is not None:
            self.snapshots.start(replication, self.control_group(), self.step)
            publish_endpoints(self.warm.store, self.world.rank)  # every group is formed
        if self.is_logger:
            self.events.emit("run_start", config=cfg.to_dict(), world_size=self.world.world_size,
                             params=count_params(cfg.model), device=str(self.device))
            self.console.line(
                f"llmtrain: {cfg.model.name} model, {count_params(cfg.model) / 1e6:.1f}M params, "
                f"{self.world.world_size} rank(s) on {self.device.type} "
                f"({dist.get_backend()}), {self.accum_steps} micro-batch(es) per step, "
                f"run dir {t.run_dir}")

    def _membership(self, gen: int) -> str:
        """The fence's name for the job's membership in warm generation ``gen``."""
        return f"{self.round_id}/g{gen}"

    def _form_group(self, store: dist.Store, category: str = "startup") -> None:
        """The parts bound to the job's process group: built at start, and again by the
        survivors of a lost rank in each new generation of the group (warm path)."""
        cfg, t = self.cfg, self.cfg.training
        # every member names the membership before it can form: no rank trains before
        self.fence.join(self._membership(self.warm.gen if self.warm else 0))
        with self.ledger.span(category, "process_group"):
            self.device = init_process_group(cfg.parallelism, cfg.reliability, self.world, store)
        if self.device.type == "cpu":
            # Denormals run CPU math (and torchao's FP8 emulation) 50x slower late in
            # training, when gradients get small; flushing them costs no accuracy.
            torch.set_flush_denormal(True)
        with self.ledger.span(category, "device_mesh"):
            self.mesh = build_mesh(self.device, cfg.mesh_shape(self.world.world_size),
                                   cfg.reliability.collective_timeout_s)

        # Built on meta and sharded before any storage exists, so no rank ever holds the
        # whole model; each then draws only its shards, the same weights at any world size.
        with self.ledger.span(category, "model_meta"):
            torch.manual_seed(t.seed)
            with torch.device("meta"):
                model = Transformer(cfg.model)
        with self.ledger.span(category, "shard"):
            self.model = parallelize(model, self.mesh, cfg.parallelism)
            self.fp8_scales = fp8_all_gather(cfg.parallelism, self.device.type,
                                             self.mesh.shape[-1])
        with self.ledger.span(category, "materialize"):
            self.model.to_empty(device=self.device)
            self.model.init_weights(t.seed)
            # Each rank reads its shards' rows only; a re-formed group restores from memory.
            if cfg.checkpoint.init_from and category == "startup":
                hf.load(self.model, cfg.checkpoint.init_from, cfg.model)
        with self.ledger.span(category, "optimizer"):
            self.optimizer = self._build_optimizer()
            o = cfg.optim
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(
                o.warmup_steps, o.decay_steps or t.steps, o.min_lr_ratio))

    def _warm_path(self, job: dist.Store | None, plan: dict | None) -> WarmPath | None:
        """This rank's part in warm recoveries (None when off, or without a store outside
        the workers to meet in)."""
        w = self.cfg.warm
        if not w.enable:
            return None
        store = outside_store(timedelta(seconds=w.budget_s))
        if store is None:
            self.events.emit("warm_path_off", rank=self.world.rank,
                             reason="no rendezvous store outside the workers "
                                    "(run under llmtrain launch)")
            return None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if plan is not None:
            return WarmPath(w, store, plan["round_id"], self.world.rank,
                            self.world.world_size, plan["local_world_size"], gen=plan["gen"])
        return WarmPath(w, store, round_of(job), self.world.rank, self.world.world_size,
                        local_world)

    def _start_health_monitor(self) -> HealthMonitor:
        """Watches this rank's GPU (and, on local rank 0, the node) while training."""
        backend = open_backend(self.cfg.health)
        gpu = rank_gpu(backend, self.device)
        monitor = HealthMonitor(
            HealthChecker(self.cfg.health, backend, host=self.world.host),
            [] if gpu is None else [gpu], interval_s=self.cfg.health.interval_s,
            node_checks=self.world.local_rank == 0, events=self.events,
            on_pass=self.exporter.health if self.exporter is not None else None)
        monitor.start()
        return monitor

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Norm gains and other vectors are not decayed: shrinking them only hurts.
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        # Fused: one kernel per step, and it takes the integrity verdict as ``found_inf``.
        return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                 fused=True)

    # -- one step ---------------------------------------------------------------------

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, then one optimizer step.
        Returns this rank's mean loss (a tensor, so reading it costs no sync)."""
        step = self.step + 1
        if self.fp8_scales:  # of the weights as they are now: stepped, resumed or restored
            precompute_fp8_scales(self.model)
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            self.beat("forward", step)
            loss = self.loss(inputs, targets, step)
            self.beat("backward", step)
            (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
            if i == 0 and self.integrity.recompute_due(step):
                self.recompute(step, own=loss.detach())
        self.beat("optimizer", step)
        self.grad_norm = self.clip_gradients()
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
        if self.checkpoints is not None and not self.checkpoints.staged():
            # a first save pins its host buffers: seconds for a GPU's state, not a hang
            self.beat("checkpoint_staging", step, long=True)
            with self.ledger.span("checkpoint_stall", f"staging before step {step}"):
                self.checkpoints.wait_staged()

    def skip_step(self, step: int) -> torch.Tensor:
        """A step of ``integrity.skip_steps`` (or one a rollback learned): its batch is
        consumed, the schedule moves on, nothing is trained; as a judged-bad step does."""
        self.scheduler.step()
        if self.is_logger:
            self.events.emit("step_skipped", step=step, reason="skip_steps")
        return torch.full((), math.nan, device=self.device)  # NCCL reduces GPU tensors only

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        # Asynchronous from pinned memory; the batch is never written to, so nothing can race.
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        return fault_points.point("loss", step, loss)

    def recompute(self, step: int, own: torch.Tensor) -> None:
        """Computes the next rank's first micro-batch here too: a rank whose arithmetic is
        wrong disagrees with both neighbours; it is named, and excluded if so configured."""
        inputs, targets = self.data.peer_micro_batch((self.world.rank + 1) % self.world.world_size)
        with torch.no_grad():
            peer = self.loss(inputs, targets, step)
        named = self.integrity.compare_recompute(step, own, peer)
        if named and self.is_logger:
            self.console.line(f"integrity: rank(s) {named} computed step {step}'s losses "
                              f"differently from their neighbours (faulty arithmetic)")
        if named and self.cfg.integrity.on_sdc == "exclude":
            self.sdc_named = named
            if self.world.rank in named:
                self.exclude_node(f"its arithmetic disagreed with both neighbours' at step "
                                  f"{step} (silent data corruption)", source="integrity")

    def clip_gradients(self) -> torch.Tensor | None:
        """The global gradient norm (when clipping or integrity needs it), clipped to."""
        max_norm = self.cfg.optim.max_grad_norm
        if not (max_norm or self.cfg.integrity.enable):
            return None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # sums the shards' partial norms across ranks
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), max_norm, norm)
        return norm

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> Summary:
        t = self.cfg.training
        log_every = self.cfg.metrics.log_every
        start = last_time = time.perf_counter()
        first_step = last_step = self.step
        first_loss = loss = float("nan")
        self.ledger.steps_done(self.step)  # productive time starts here
        while self.step < t.steps:
            try:
                step = self.step + 1
                step_start = time.perf_counter()
                with self.diagnosed():
                    if fault_points.armed():  # strike after the last save's copy, in order
                        self.wait_staged(step)
                    fault_points.point("step", step, self.model)
                    micro_batches = self.data.next_step()
                    local_loss = (self.skip_step(step) if step in self.integrity.skips
                                  else self.train_step(micro_batches))
                self.step = step
                self.beat("step")
                if self.recovered:
                    self.report_warm_recovery()
                now = time.perf_counter()
                if self.exporter is not None:
                    self.exporter.step_done(step, now - step_start)
                if step == first_step + 1:
                    self.report_startup()
                    if self.checkpoints is not None:  # the optimizer's state exists now
                        self.checkpoints.prepare(self.state, step)
                due = step % log_every == 0 or step in (first_step + 1, t.steps)
                if (due or self.integrity.check_due(step)) and self.review(step):
                    last_step, last_time = self.step, time.perf_counter()
                    continue  # rolled back: the loop goes on from the checkpoint's step
                if self.sdc_named:
                    break
                if self.snapshots is not None and self.snapshots.due(step):
                    self.take_snapshot(step)
                if due:
                    # The only host sync of the step (integrity's verdicts were read with it).
                    loss = self.integrity.loss if self.cfg.integrity.enable else \
                        self.global_mean(local_loss)
                    now = time.perf_counter()
                    self.report(step, loss, (now - last_time) / (step - last_step))
                    last_step, last_time = step, now
                    if math.isnan(first_loss):
                        first_loss = loss
                if self.checkpoint(step):
                    break
            except (RuntimeError, OSError) as e:
                # a rank cut off from the job while it re-formed says no more (Fenced)
                self.fence.check("a report of its failure")
                if not self.recover_warm(e):
                    raise
                last_step, last_time = self.step, time.perf_counter()
        self.ledger.steps_done(self.step)
        if ((self.checkpoints is not None and self.checkpoints.stopped_by_peer)
                or (self.sdc_named and not self.excluded)):
            # Let the failed node's rank exit first, so the launcher sees its EXCLUDE_NODE
            # rather than stopping it in favor of our RETRYABLE.
            time.sleep(_PEER_STOP_GRACE_S)
        wall = time.perf_counter() - start
        tokens = (self.step - first_step) * self.tokens_per_step
        return self.finish(Summary(
            steps=self.step, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
            first_loss=first_loss, final_loss=loss, memory_gb=_memory_gb(self.device),
            stopped=self.checkpoints is not None and self.checkpoints.finishing))

    def review(self, step: int, save: bool = False) -> bool:
        """Reads the integrity verdicts and, when due (always before a save), checks the
        state; rolls back when the policy says so. True when it did."""
        bad = self.integrity.read()
        if bad and self.integrity.review(bad, step):
            return self.roll_back(f"{bad[0].reason} at step {bad[0].step}", bad[-1].step)
        if not (save or self.integrity.check_due(step)) or self.checked_step == step:
            return False
        self.checked_step = step
        check = self.integrity.check_state(step, self.model, self.grad_norm)
        if check.diverged and self.is_logger:
            self.console.line(f"integrity: rank(s) {check.diverged} held a corrupted replica "
                              f"at step {step} (the replay after the rollback says so)")
        if check.diverged and self.cfg.integrity.on_sdc == "exclude":
            self.sdc_named = check.diverged
            if self.world.rank in check.diverged:
                self.exclude_node(f"its replica of the model diverged from the others' at "
                                  f"step {step} (silent data corruption)", source="integrity")
        if check.ok:
            return False
        what = (f"non-finite parameters on rank(s) {check.nonfinite_ranks}"
                if check.nonfinite_ranks else
                f"replicas differ: rank(s) {check.suspects or check.split}")
        return self.roll_back(f"{what} at step {step}", None)

    def roll_back(self, reason: str, bad_step: int | None) -> bool:
        """Back to the newest committed checkpoint (each was checked before it was saved),
        skipping the bad step's batches; True when the state was rolled back. Without a
        checkpoint, a bad step (never applied) is only skipped; a bad state stops the run."""
        skipped = self.integrity.learn_skips(bad_step) if bad_step else []
        self.rollbacks = [s for s in self.rollbacks if s >= self.step] + [self.step]
        if len(self.rollbacks) > _MAX_ROLLBACKS:
            raise TrainingDiverged(
                f"{reason}, again after {_MAX_ROLLBACKS} rollbacks without getting past "
                f"step {self.step}: the fault is not transient; check the named ranks' GPUs "
                f"(llmtrain health) and exclude their nodes")
        step = 0
        if self.checkpoints is not None:
            self.checkpoints.wait()
            self.beat("resume", long=True)
            with self.ledger.span("checkpoint_load", "rollback"):
                step = self.checkpoints.resume(self.state)
        if self.is_logger:
            self.events.emit("rollback", step=self.step, to_step=step or None, reason=reason,
                             skip=skipped)
            self.console.line(f"integrity: {reason}; " + (
                f"rolled back to the checkpoint of step {step}" if step else
                "no checkpoint to roll back to") + (f", skipping step(s) {skipped}" if skipped else ""))
        if not step and bad_step is None:
            raise TrainingDiverged(f"the training state is bad ({reason}) and there is no "
                                   f"checkpoint to roll back to; restart the run")
        if step:
            self.step, self.checked_step = step, -1
            if self.snapshots is not None:  # newer than the state now: never restored
                self.snapshots.own.held.clear()
        return bool(step)

    # -- the warm path ----------------------------------------------------------------

    def _snapshot_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What a snapshot holds, in order; and the RNG states among it (copies: CPU, and
        this rank's GPU)."""
        rngs = [torch.get_rng_state()]
        if self.device.type == "cuda":
            rngs.append(torch.cuda.get_rng_state(self.device))
        return state_tensors(self.model, self.optimizer, [*rngs, self.integrity.history]), rngs

    def take_snapshot(self, step: int) -> None:
        tensors, _ = self._snapshot_tensors()
        self.snapshots.take(step, tensors, {
            "scheduler": self.scheduler.state_dict(), "data": self.data.state_dict(),
            "lr": [g["lr"] for g in self.optimizer.param_groups],
            "judged": self.integrity.judged, "skips": sorted(self.integrity.skips)})

    def recover_warm(self, error: BaseException) -> bool:
        """A collective failed: with the other survivors, re-forms the group with warm
        spares in the lost ranks' places and restores every rank's state from memory.
        False when the cold path must take over (the reason is logged)."""
        if self.warm is None or isinstance(error, TrainingDiverged):
            return False
        detected, failed_at = time.time(), self.step
        interval = self.snapshots.schedule.interval  # the one in force: start() resets it
        deadline = time.monotonic() + self.cfg.warm.budget_s
        self.beat("recover", long=True)
        self.events.emit("failure", step=self.step, error=f"{type(error).__name__}: {error}"[:500],
                         path="warm")
        plan = None
        try:
            # an exchange with the lost peer may never end: it is left behind, not awaited
            self.snapshots.stop(self.cfg.warm.settle_s)
            plan = self.warm.agree(self.snapshots.holdings(), deadline)
            if self.world.rank not in plan.lost:  # the spares may name it first
                self.fence.expect(self._membership(plan.gen))
            agreed = time.time()
            if self.checkpoints is not None:
                self.checkpoints.wait(max(0.0, deadline - time.monotonic()))
            abandon()
            if self.watchdog is not None:
                self.watchdog.new_generation()
            self.warm.enter(plan.gen)
            self.warm.assemble(deadline)
            self._form_group(self.warm.group_store(), category="restart")
            if self.checkpoints is not None:
                self.checkpoints.bind_groups()
            replication = dist.new_group(backend="gloo")
            formed = time.time()
            self.restore(plan, replication)
        except (ColdPath, SnapshotError, TimeoutError, RuntimeError) as e:
            self.events.emit("warm_recovery_failed", step=self.step,
                             reason=f"{type(e).__name__}: {e}"[:500])
            if plan is not None:  # a plan was made and failed
                self.warm.give_up()
            return False
        self.snapshots.start(replication, self.control_group(), self.step)
        publish_endpoints(self.warm.store, self.world.rank)
        restored = time.time()
        self.ledger.record("restart", "warm", detected, restored)
        self.ledger.restart_at(self.step)
        if self.world.rank == min(set(range(self.world.world_size)) - set(plan.lost)):
            # reported once the first step after it is done: the whole cost of the fault
            self.recovered = {"gen": plan.gen, "lost": plan.lost, "step": plan.step,
                              "spares": plan.spares, "failed_at": failed_at,
                              "snapshot_interval": interval, "marks": {
                                  "failure_detected": detected, "agreed": agreed,
                                  "group_formed": formed, "restored": restored}}
        return True

    def control_group(self):
        """A gloo group for the training thread's votes: the checkpoint manager's, else a
        group of its own (each more group is a full mesh of connections to form)."""
        if self.checkpoints is not None:
            return self.checkpoints.control_group
        return dist.new_group(backend="gloo") if self.cfg.warm.snapshot_budget else None

    def report_warm_recovery(self) -> None:
        marks = {**self.recovered.pop("marks"), "first_step": time.time()}
        names = list(marks)
        parts = {f"{a}->{b}": marks[b] - marks[a] for a, b in zip(names, names[1:])}
        total = marks["first_step"] - marks["failure_detected"]
        self.events.emit("warm_recovery", **self.recovered, marks=marks, parts_s=parts,
                         total_s=total)
        self.console.line(f"warm recovery: rank(s) {self.recovered['lost']} replaced by "
                          f"spare(s), the state of step {self.recovered['step']} restored from "
                          f"memory; training again {total:.2f}s after the failure")
        self.recovered = None

    def restore(self, plan: Plan, replication) -> None:
        """Every rank's state at ``plan.step`` from memory: survivors from their own
        snapshot, a spare from its buddy's replica; all verified by checksum first, and all
        ranks agree that each did, or none goes on (SnapshotError: the cold path)."""
        ok = torch.ones(1)
        snap = None
        try:
            for lost, source in plan.sources.items():
                if source == self.world.rank:
                    self.snapshots.send_replica(plan.step, int(lost), replication)
            if str(self.world.rank) in plan.sources:
                snap = Snapshots.receive(plan.sources[str(self.world.rank)], replication)
            else:
                snap = self.snapshots.own.at(plan.step)
                snap.verify()
        except SnapshotError as e:
            self.events.emit("snapshot_corrupt", rank=self.world.rank, step=plan.step,
                             error=str(e), when="restore")
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=replication)
        if not ok.item():
            raise SnapshotError(f"a snapshot of step {plan.step} failed its check "
                                f"(see the snapshot_corrupt events)")
        tensors, rngs = self._snapshot_tensors()
        header = snap.restore_into(tensors)
        torch.set_rng_state(rngs[0])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(rngs[1], self.device)
        restore_python_rng(header)
        self.scheduler.load_state_dict(header["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, header["lr"]):
            group["lr"] = lr  # the schedule's state does not carry the rate it last set
        self.data.load_state_dict(header["data"])
        self.integrity.restart_at(header["judged"], header["skips"])
        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.data,
                                self.world.rank, self.device)
        self.step = self.checked_step = plan.step

    @contextmanager
    def diagnosed(self):
        """A collective that fails PyTorch's desync check is diagnosed like a hang."""
        try:
            yield
        except RuntimeError as e:
            if self.watchdog is None or "mismatch between collectives" not in str(e):
                raise
            self.watchdog.collective_failed(e)

    def checkpoint(self, step: int) -> bool:
        """Saves when due (always after the last step, and before stopping for a failed
        health check anywhere); True when the run must stop now."""
        unhealthy = self.health is not None and self.health.fatal is not None
        if unhealthy and not self.excluded:  # first, so the record exists however it ends
            self.exclude_node(self.health.fatal.sentence(), findings=[asdict(self.health.fatal)])
        if unhealthy and self.warm is not None:
            self.warm.leave()
            return True  # leave now, unsaved: the survivors go on warm with a spare
        if self.checkpoints is None:
            return unhealthy
        due, stop = self.checkpoints.due(step, stop_vote=unhealthy)
        last = step == self.cfg.training.steps
        if due or last:
            if self.cfg.integrity.enable and self.review(step, save=True):
                return False  # never save a state that failed its check
            final = stop or last
            # a sync save, and one that waits for the previous save's write (13 GB of a 1B
            # model's state took longer than the 5 s learned timeout on an H100), cannot beat
            waits = self.cfg.checkpoint.mode == "sync" or self.checkpoints.writing()
            self.beat("checkpoint", long=final or waits)
            self.ledger.steps_done(step)
            with self.ledger.span("checkpoint_stall", f"save step {step}"):
                self.checkpoints.save(step, self.state, final=final,
                                      checked=self.cfg.integrity.enable)
            self.beat("step")
        self.preempted = stop and not self.checkpoints.finishing
        return stop

    @property
    def exit_code(self) -> ExitCode:
        """EXCLUDE_NODE for the rank whose hardware failed, RETRYABLE for ranks stopped
        early (a signal, or a peer's failure), else CLEAN."""
        if self.excluded:
            return ExitCode.EXCLUDE_NODE
        return ExitCode.RETRYABLE if self.preempted or self.sdc_named else ExitCode.CLEAN

    def exclude_node(self, reason: str, source: str = "monitor", findings=()) -> None:
        """Takes this node out of the run: its GPU failed a check, or its replica diverged."""
        self.excluded = True
        exclude_host(self.cfg.training.run_dir, self.world.host, reason,
                     findings=list(findings), rank=self.world.rank)
        self.events.emit("node_excluded", host=self.world.host, reason=reason,
                         source=source, step=self.step)
        print(f"llmtrain: rank {self.world.rank} stops with EXCLUDE_NODE: {reason}",
              file=sys.stderr, flush=True)

    def beat(self, phase: str, step: int | None = None, long: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(self.step if step is None else step, phase, long)

    def global_mean(self, value: torch.Tensor) -> float:
        """The mean over all ranks (every rank holds an equal share of the batch)."""
        value = value.detach().clone()
        dist.all_reduce(value)
        return value.item() / self.world.world_size

    def report_startup(self) -> None:
        """The start-up timeline, once the first step is done: where a restart's time goes;
        after a restart, rank 0 also logs the recovery's parts."""
        phases = dict(self.ledger.timeline)
        since_launch = time.time() - launch_time()
        self.events.emit("startup", phases=phases, since_launch_s=since_launch,
                         pid=os.getpid(), host=self.world.host)
        if self.exporter is not None:
            for name, seconds in phases.items():
                self.exporter.set("llmtrain_startup_seconds", seconds, phase=name)
        if not self.is_logger:
            return
        parts = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in phases.items())
        self.console.line(f"start-up: {parts}; first step done {since_launch:.1f}s after launch")
        self.beat("events", long=True)
        self.ledger_events += self.ledger_tail.read()
        restart = goodput.recovery(self.ledger_events, time.time())
        if restart:
            self.events.emit("recovery", **restart)
            self.console.line(f"recovered in {restart['total_s']:.1f}s from the failure: " +
                              ", ".join(f"{k} {v:.2f}s" for k, v in restart["parts_s"].items()))

    def report(self, step: int, loss: float, step_time: float) -> None:
        if not self.is_logger:
            return
        self.ledger.steps_done(step)
        tokens_per_s = self.tokens_per_step / step_time
        mfu = (self.flops_per_token * tokens_per_s / self.world.world_size / self.peak_flops
               if self.peak_flops else None)
        r = StepReport(step=step, loss=loss, tokens_per_s=tokens_per_s, step_time_s=step_time,
                       lr=self.scheduler.get_last_lr()[0], mfu=mfu,
                       grad_norm=None if self.grad_norm is None else self.grad_norm.item(),
                       memory_gb=_memory_gb(self.device))
        self.events.emit("step", **asdict(r))
        self.console.step(r)
        if self.exporter is not None and self.watchdog is not None:
            self.exporter.stragglers(self.watchdog.slowdowns)
        self.account_goodput()

    def account_goodput(self, final: bool = False) -> None:
        """Rank 0: where the run's time went so far, across restarts, read back from the
        event log (at most every ``metrics.goodput_every_s``), and the checkpoint interval
        that time suggests."""
        if not final and time.monotonic() - self.goodput_at < self.cfg.metrics.goodput_every_s:
            return
        self.beat("events", long=True)  # reading the log may take long: peers wait for it
        self.goodput_at = time.monotonic()
        self.ledger_events += self.ledger_tail.read()
        b = goodput.account(self.ledger_events, now=time.time())
        advice = goodput.advise(b, self.cfg.metrics.assumed_mtbf_s)
        if self.exporter is not None:
            self.exporter.goodput(b, advice)
        if final:
            self.events.emit("goodput", **b.as_dict(),
                             optimal_interval_s=advice and advice.optimal_interval_s,
                             expected_ettr=advice and advice.expected_ettr,
                             mtbf_s=advice and advice.mtbf_s)
        elif advice and self.cfg.checkpoint.auto_interval and self.checkpoints is not None:
            old = self.checkpoints.interval_seconds
            if not old or abs(advice.optimal_interval_s - old) > 0.1 * old:
                self.checkpoints.interval_seconds = advice.optimal_interval_s
                self.events.emit("checkpoint_interval", seconds=advice.optimal_interval_s,
                                 previous=old, **asdict(advice))

    def finish(self, s: Summary) -> Summary:
        if self.is_logger and not s.tokens:
            self.console.line(f"nothing to do: the run is already at step {s.steps} of "
                              f"{self.cfg.training.steps}")
        elif self.is_logger:
            self.events.emit("run_end", **asdict(s))
            if s.stopped or s.steps == self.cfg.training.steps:
                clear_request(self.cfg.training.run_dir)  # done with, or moot
            self.account_goodput(final=True)
            ended = "done, stopped on request" if s.stopped else "done"
            self.console.line(
                f"{ended}: {s.steps} steps, {s.tokens / 1e6:.2f}M tokens in {s.wall_s:.1f} s "
                f"({s.tokens_per_s:,.0f} tok/s); loss {s.first_loss:.3f} -> {s.final_loss:.3f}; "
                f"peak memory {s.memory_gb:.2f} GB per rank")
        return s

    def close(self, failed: bool = False) -> None:
        """Stops every component; the time it takes is in the ledger too (as "other").
        ``failed``: training ended by an exception (a collective error, a timeout, a stop
        for bad state); the process groups are then abandoned, their NCCL communicators
        aborted, since destroying them can wait for ever on a collective a peer never ends."""
        started = time.time()
        self.data.close()
        if self.health is not None:
            self.health.close()
        if self.exporter is not None:
            self.exporter.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.stop_requests is not None:
            self.stop_requests.close()
        if self.snapshots is not None:
            self.snapshots.stop(timeout=10.0)
        (abandon if failed else shutdown)()
        self.ledger.record("other", "shutdown", started, time.time())
        self.events.close()
