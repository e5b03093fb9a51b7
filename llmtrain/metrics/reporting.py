"""What a run tells people while it trains: the console (rank 0), the Prometheus endpoint
(every rank, when on), the goodput account and the run's event log, each fed its share
by one reporter the loop calls."""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.config import Settings
from llmtrain.distributed.process_group import WorldInfo
from llmtrain.events import EventLog
from llmtrain.metrics import goodput
from llmtrain.metrics.console import ConsoleReporter, StepReport
from llmtrain.metrics.goodput import (GoodputLedger, IntervalAdvice, launch_time,
                                      process_start_time)
from llmtrain.metrics.goodput_account import GoodputAccount
from llmtrain.metrics.prometheus import start_exporter
from llmtrain.process_origin import handed_over_at

# Dense bf16 peak FLOP/s per GPU, by a substring of the device name (FP8 doubles it).
# The first name found in the device's wins: the PCIe and NVL H100s are slower.
_PEAK_BF16_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
                    "A100": 312e12, "B200": 2250e12}


@dataclass
class RunInfo:
    """What the run's reports say of what it trains: the model's name and parameter
    count, the tokens (or samples) one optimizer step consumes and the FLOPs each costs
    (for throughput and MFU; 0: unknown), the samples a step consumes and the
    micro-batches each rank splits them into (0: unknown), whether the matmuls run in FP8
    (the device's peak doubles), the settings the ``run_start`` event records, and what
    each checkpoint's manifest says of the run (its config, model and data). ``name``
    empty and ``params`` 0: taken from the model once it is built."""
    name: str = ""  # empty: the model's class name
    params: int = 0
    tokens_per_step: int = 0
    flops_per_token: float = 0.0
    samples_per_step: int = 0
    micro_batches: int = 0
    fp8: bool = False
    config: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)


def peak_flops(peak_tflops: float, fp8: bool, device: torch.device) -> float | None:
    """The device's peak FLOP/s: ``peak_tflops`` when given, else a known GPU's."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in _PEAK_BF16_FLOPS.items() if k in name), None)
    return peak * 2 if peak and fp8 else peak


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Reporter:
    """What a run tells, and to whom: rank 0's console (:class:`ConsoleReporter`), every
    rank's Prometheus figures (:func:`start_exporter`), rank 0's goodput account
    (:class:`GoodputAccount`) and the run's event log, which ``llmtrain report`` reads.
    The loop calls it at the run's start and end, after each step and once the first is
    done; it works out each step's figures and hands each audience its share.
    ``before_long_read``: called before the event log is read back (the goodput account,
    a restart's recovery), which may take long: the session tells its watchdog."""

    def __init__(self, settings: Settings, info: RunInfo, world: WorldInfo, events: EventLog,
                 ledger: GoodputLedger, before_long_read: Callable[[], None]):
        self.cfg, self.info, self.world, self.events = settings, info, world, events
        self.ledger = ledger
        self._spare = False  # joined a running attempt (a warm spare): it did not restart
        self.is_rank0 = world.rank == 0
        self.console = ConsoleReporter(settings.metrics, settings.steps)
        self.exporter = start_exporter(settings.metrics, settings.run_dir, events,
                                       rank=world.rank, local_rank=world.local_rank,
                                       host=world.host, world_size=world.world_size)
        self.goodput = GoodputAccount(settings.run_dir, events, self.exporter,
                                      every_s=settings.metrics.goodput_every_s,
                                      assumed_mtbf_s=settings.metrics.assumed_mtbf_s,
                                      before_read=before_long_read)
        # the last reported step and when it ended; the first and last losses reported
        self.last_step, self.last_time = 0, time.perf_counter()
        self._first_loss = self._loss = math.nan
        self.peak_flops: float | None = None  # of this rank's device, once it is known

    def joined_running(self) -> None:
        """This rank joined a running attempt (a warm spare, a resized job's rank): it
        did not restart, and reports no cold restart's recovery."""
        self._spare = True

    def losses(self) -> tuple[float, float]:
        """The run's first and last reported losses (NaN before any)."""
        return self._first_loss, self._loss

    def run_start(self, device: torch.device, micro_batches: int, mesh: DeviceMesh) -> None:
        info = self.info
        self.peak_flops = peak_flops(self.cfg.metrics.peak_tflops, info.fp8, device)
        if not self.is_rank0:
            return
        self.events.emit("run_start", config=info.config, world_size=self.world.world_size,
                         params=info.params, device=str(device))
        self.console.run_started(model=info.name, params=info.params,
                                 world_size=self.world.world_size, device=device.type,
                                 backend=dist.get_backend(), micro_batches=micro_batches,
                                 run_dir=self.cfg.run_dir,
                                 mesh=" x ".join(f"{name} {size}" for name, size in
                                                 zip(mesh.mesh_dim_names, mesh.shape))
                                 if mesh.ndim > 1 else "")

    def run_end(self, s) -> None:
        """Rank 0: the run's end (``s``: the session's Summary) as an event, its goodput,
        and a line."""
        if not self.is_rank0:
            return
        if s.trained:
            self.events.emit("run_end", **asdict(s))
            self.goodput.account(final=True)
        self.console.ended(s)

    def line(self, text: str | None) -> None:
        """Rank 0 says ``text`` (nothing when None)."""
        if self.is_rank0 and text:
            self.console.line(text)

    def announce(self, text: str | None) -> None:
        """This rank says ``text``, whichever rank it is: for what one rank alone knows
        to say, as a warm recovery's lowest survivor (rank 0 may be the rank that was
        lost, its place taken by a spare that saw no failure)."""
        if text:
            self.console.line(text)

    def health_pass(self, findings: list, readings: dict) -> None:
        self.exporter.health(findings, readings)

    def step_timed(self, step: int, seconds: float) -> None:
        self.exporter.step_done(step, seconds)

    def startup_done(self) -> None:
        """The start-up timeline, once the first step is done: where a restart's time goes;
        after a restart, rank 0 also reports the recovery's parts."""
        phases = self.ledger.phases()
        since_launch = time.time() - launch_time()
        # a prepared worker (llmtrain.launch.prepared) was started before its attempt
        self.events.emit("startup", phases=phases, since_launch_s=since_launch,
                         pid=os.getpid(), host=self.world.host, local_rank=self.world.local_rank,
                         prepared=handed_over_at() is not None,
                         process_started=process_start_time(os.getpid()))
        for name, seconds in phases.items():
            self.exporter.set("llmtrain_startup_seconds", seconds, phase=name)
        if not self.is_rank0:
            return
        self.console.started_up(phases, since_launch)
        # A warm spare that took rank 0 must not log the last cold restart again (chaos
        # read such a stale `recovery` as the warm recovery's outcome).
        if self._spare:
            return
        restart = goodput.recovery(self.goodput.events_so_far(), time.time())
        if restart:
            self.events.emit("recovery", **restart)
            self.console.recovered(restart["total_s"], restart["parts_s"])

    def resume_at(self, step: int) -> None:
        """Steps are timed from ``step``, now (a start, a rollback, a warm restore)."""
        self.last_step, self.last_time = step, time.perf_counter()

    def step(self, step: int, loss: float | None, *, lr: float,
             grad_norm: torch.Tensor | None, device: torch.device,
             slowdowns: dict[int, float]) -> IntervalAdvice | None:
        """The step's loss and time since the last report; on rank 0 also its line,
        event and figures (``slowdowns``: the watchdog's straggler scores), and, at most
        every ``metrics.goodput_every_s``, the goodput so far and the checkpoint interval
        it suggests. ``loss`` None: the step was skipped (nothing trained), its report
        says so and the run's losses stay as they were."""
        now = time.perf_counter()
        step_time = (now - self.last_time) / (step - self.last_step)
        self.last_step, self.last_time = step, now
        if loss is not None:
            self._loss = loss
            self._first_loss = loss if math.isnan(self._first_loss) else self._first_loss
        if not self.is_rank0:
            return None
        self.ledger.steps_done(step)
        tokens_per_s = self.info.tokens_per_step / step_time
        peak = self.peak_flops
        r = StepReport(step=step, loss=math.nan if loss is None else loss,
                       tokens_per_s=tokens_per_s, step_time_s=step_time, lr=lr,
                       grad_norm=None if grad_norm is None else grad_norm.item(),
                       mfu=(self.info.flops_per_token * tokens_per_s / self.world.world_size
                            / peak if peak else None), memory_gb=memory_gb(device),
                       skipped=loss is None)
        self.events.emit("step", **asdict(r))
        self.console.step(r)
        self.exporter.stragglers(slowdowns)
        return self.goodput.account() if self.goodput.due() else None

    def close(self) -> None:
        self.exporter.close()
