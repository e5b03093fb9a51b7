"""The in-training health monitor: this rank's GPU (and, on local rank 0, the node)
re-checked every ``health.interval_s`` and on NVML XID events while the job runs."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict, replace
from typing import Callable, Protocol

from llmtrain.config import HealthConfig
from llmtrain.reliability.health.checks import Backend, Finding, HealthChecker, open_backend

log = logging.getLogger(__name__)


class HealthWatch(Protocol):
    """This rank's health while it trains, as the run control asks it, watched
    (:class:`HealthMonitor`) or not (:class:`NoHealthMonitor`): see :func:`start_monitor`."""

    def fatal_finding(self) -> Finding | None:
        """The first fatal finding (this rank's GPU failed), or None."""

    def close(self) -> None: ...


class HealthMonitor:
    """A thread that re-runs this rank's GPU checks (and, on local rank 0, the node's).

    A change of any check's severity becomes a ``health`` event; every pass feeds the
    metrics. The first fatal finding is kept for the training loop
    (:meth:`fatal_finding`), which stops this rank with EXCLUDE_NODE once the checkpoint
    policy has had its chance.
    """

    def __init__(self, checker: HealthChecker, gpus: list[int], *, interval_s: float,
                 node_checks: bool, events, on_pass: Callable[[list, dict], None] | None = None,
                 on_fatal: Callable[[Finding], None] | None = None):
        """``on_fatal``: called once, on the monitor's thread, with the first fatal
        finding of a pass after the first (the first pass runs before training starts,
        whose first step end sees it)."""
        self.checker, self.gpus, self.interval_s = checker, gpus, interval_s
        self.node_checks, self.events, self.on_pass = node_checks, events, on_pass
        self.on_fatal = on_fatal
        self._fatal: Finding | None = None
        self.last: dict[tuple[str, int | None], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmtrain-health", daemon=True)

    def start(self) -> None:
        if self.checker.backend is not None and self.gpus:
            self.checker.watch_xids(self.gpus)
        self.check()
        self._thread.start()

    def _run(self) -> None:
        told = self._fatal is not None
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
                if self._fatal is not None and not told and self.on_fatal is not None:
                    self.on_fatal(self._fatal)  # raised: told at the next pass
                    told = True
            except Exception as e:  # noqa: BLE001 - a broken check must not kill training
                log.warning("llmtrain health: check failed: %s: %s", type(e).__name__, e)

    def check(self) -> list[Finding]:
        findings, values = (self.checker.gpus(self.gpus) if self.gpus and self.checker.backend
                            else ([], {}))
        if self.node_checks:
            findings += self.checker.node()
        findings = [_while_training(f) for f in findings]
        for f in findings:
            key = (f.check, f.gpu)
            if self.last.get(key, "ok") != f.severity:
                self.events.emit("health", **asdict(f))
            self.last[key] = f.severity
            if f.severity == "fatal" and self._fatal is None:
                self._fatal = f
                log.error("llmtrain health: %s", f.sentence())
        if self.on_pass is not None:
            self.on_pass(findings, values)
        return findings

    def fatal_finding(self) -> Finding | None:
        """The first fatal finding of any pass (this rank's GPU failed), or None."""
        return self._fatal

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


class NoHealthMonitor:
    """``health.monitor = false``: nothing is watched, nothing ever fails."""

    def fatal_finding(self) -> Finding | None:
        return None

    def close(self) -> None:
        pass


def _while_training(f: Finding) -> Finding:
    """Another process on the GPU keeps a node out of a job (the gate) but does not stop
    one that runs: it may be a tool or this job's own helper (a checkpoint process), and
    training goes on beside it."""
    if f.check == "stray_processes" and f.severity == "fatal":
        return replace(f, severity="warn", message=f"{f.message} (while training: a warning)")
    return f


def rank_gpu(backend: Backend | None, device) -> int | None:
    """The NVML index of this rank's GPU: NVML counts every GPU on the node, while CUDA
    counts only the visible ones, so match by UUID. On CPU the local rank stands in."""
    if backend is None:
        return None
    if device.type == "cuda":
        import torch
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        nvml = backend.nvml
        for i in range(nvml.nvmlDeviceGetCount()):
            if uuid in str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))):
                return i
    local = int(os.environ.get("LOCAL_RANK", 0))
    return local if local < backend.nvml.nvmlDeviceGetCount() else None


def start_monitor(cfg: HealthConfig, device, *, host: str, local_rank: int, events,
                  on_pass: Callable[[list, dict], None],
                  on_fatal: Callable[[Finding], None] | None = None) -> HealthWatch:
    """Watches this rank's GPU (and, on local rank 0, the node) while training;
    ``on_fatal`` is told of a GPU that fails while it trains, at once, on the monitor's
    thread (:class:`HealthMonitor`)."""
    if not cfg.monitor:
        return NoHealthMonitor()
    backend = open_backend(cfg)
    gpu = rank_gpu(backend, device)
    monitor = HealthMonitor(HealthChecker(cfg, backend, host=host), [] if gpu is None else [gpu],
                            interval_s=cfg.interval_s, node_checks=local_rank == 0,
                            events=events, on_pass=on_pass, on_fatal=on_fatal)
    monitor.start()
    return monitor
