"""The Prometheus exporter every rank runs: training, checkpoint, watchdog, health, goodput.

Each rank serves ``/metrics`` on ``metrics.port`` + its local rank (an ephemeral port when
that one is taken, so several jobs or test "nodes" can share a host) and writes a
file-based service-discovery entry for itself into ``metrics.targets_dir``, which
``monitoring/prometheus.yml`` reads. Every series carries ``run``, ``rank``,
``local_rank`` and ``host`` (not ``job``: Prometheus sets that to the scrape job).

Most values arrive as events: the exporter listens to the rank's EventLog, so the
checkpoint manager, the watchdog and the health monitor need no knowledge of it. Counts
that must survive restarts (hangs, checkpoint failures, the last commit) are re-read from
the run's event log when the exporter starts.
"""

from __future__ import annotations

import errno
import json
import os
import time
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from llmtrain.config import MetricsConfig
from llmtrain.events import EventLog, read_events
from llmtrain.fsio import join, write_atomic
from llmtrain.metrics.goodput import Breakdown, IntervalAdvice

# name -> (type, help, extra labels)
_DEFS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "llmtrain_step": ("gauge", "last completed optimizer step", ()),
    "llmtrain_last_step_timestamp_seconds": ("gauge", "unix time the last step completed", ()),
    "llmtrain_loss": ("gauge", "training loss, mean over ranks", ()),
    "llmtrain_tokens_per_second": ("gauge", "tokens per second, whole job", ()),
    "llmtrain_step_seconds": ("histogram", "time per optimizer step on this rank's host", ()),
    "llmtrain_mfu_ratio": ("gauge", "model FLOPs utilization (0-1), when the peak is known", ()),
    "llmtrain_memory_peak_bytes": ("gauge", "peak device (or host RSS) memory", ()),
    "llmtrain_learning_rate": ("gauge", "current learning rate", ()),
    "llmtrain_world_size": ("gauge", "ranks in the job now", ()),
    "llmtrain_restart_count": ("gauge", "torchrun's restart count of this attempt", ()),
    "llmtrain_membership_changes": ("gauge", "world-size changes seen in the run", ()),
    "llmtrain_startup_seconds": ("gauge", "this attempt's start-up, by phase", ("phase",)),
    "llmtrain_checkpoint_blocking_seconds": ("histogram", "training stalled per save", ()),
    "llmtrain_checkpoint_save_seconds": ("histogram", "save start to commit", ()),
    "llmtrain_checkpoint_bytes": ("gauge", "size of the last committed checkpoint", ()),
    "llmtrain_checkpoint_last_committed_step": ("gauge", "step of the newest commit", ()),
    "llmtrain_checkpoint_last_committed_timestamp_seconds": (
        "gauge", "unix time of the newest commit", ()),
    "llmtrain_checkpoint_failures_total": ("counter", "failed saves in the run", ()),
    "llmtrain_checkpoint_retention_failures_total": (
        "counter", "retention passes that failed in the run (old checkpoints left)", ()),
    "llmtrain_checkpoint_load_seconds": ("gauge", "time the last resume took", ()),
    "llmtrain_checkpoint_passed_over_total": (
        "counter", "checkpoints a resume (for an older one) or a retention pass could not "
        "read and passed over, left in place", ()),
    "llmtrain_fence_unreachable_total": (
        "counter", "outages of the rendezvous store seen by this rank's fence (its "
        "checkpoint writes refused meanwhile)", ()),
    "llmtrain_heartbeat_timestamp_seconds": ("gauge", "unix time of this rank's last beat", ()),
    "llmtrain_hangs_total": ("counter", "hangs diagnosed in the run", ()),
    "llmtrain_desyncs_total": ("counter", "collective mismatches diagnosed in the run", ()),
    "llmtrain_warm_recoveries_total": ("counter", "lost ranks replaced on the warm path "
                                       "(counted by the lowest surviving rank)", ()),
    "llmtrain_snapshot_replication_failures_total": (
        "counter", "snapshot replications to the buddy that failed in this process "
        "(none replicates again before the next recovery)", ()),
    "llmtrain_warm_recovery_seconds": ("gauge", "the last warm recovery: failure to first "
                                       "step (part=total), and its parts", ("part",)),
    "llmtrain_straggler_slowdown": ("gauge", "how many times slower than the others a rank "
                                    "reaches collectives", ("peer_rank",)),
    "llmtrain_health_check_severity": ("gauge", "0 ok, 1 unknown, 2 warn, 3 fatal",
                                       ("check", "gpu")),
    "llmtrain_gpu_temperature_celsius": ("gauge", "GPU temperature", ("gpu",)),
    "llmtrain_gpu_power_watts": ("gauge", "GPU power draw", ("gpu",)),
    "llmtrain_gpu_ecc_uncorrectable_errors": ("gauge", "uncorrectable ECC errors",
                                              ("gpu", "scope")),
    "llmtrain_gpu_throttle_active": ("gauge", "1 while a clock throttle reason is active",
                                     ("gpu", "reason")),
    "llmtrain_gpu_pcie_link_width": ("gauge", "current PCIe link width", ("gpu",)),
    "llmtrain_gpu_pcie_link_width_max": ("gauge", "the device's maximum PCIe width", ("gpu",)),
    "llmtrain_goodput_ratio": ("gauge", "ETTR: productive time / wall time, whole run", ()),
    "llmtrain_wall_seconds": ("gauge", "wall time of the run, every attempt", ()),
    "llmtrain_productive_seconds": ("gauge", "productive time of the run", ()),
    "llmtrain_badput_seconds": ("gauge", "lost time of the run by cause", ("category",)),
    "llmtrain_checkpoint_interval_optimal_seconds": ("gauge", "Young/Daly optimal interval", ()),
    "llmtrain_ettr_expected": ("gauge", "ETTR the Young/Daly model expects", ()),
}
METRICS: dict[str, str] = {name: kind for name, (kind, _, _) in _DEFS.items()}
LABELS = ("run", "rank", "local_rank", "host")
SEVERITY = {"ok": 0, "unknown": 1, "warn": 2, "fatal": 3}
_STEP_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 25, 60, float("inf"))
_SAVE_BUCKETS = (.01, .05, .1, .5, 1, 5, 10, 30, 60, 300, float("inf"))


class MetricsExport(Protocol):
    """What the reporter tells the metrics, exported (:class:`Exporter`) or not
    (:class:`NoExporter`): see :func:`start_exporter`."""

    def health(self, findings: list, readings: dict) -> None: ...

    def step_done(self, step: int, seconds: float) -> None: ...

    def stragglers(self, slowdowns: dict[int, float]) -> None: ...

    def set(self, name: str, value: float, **labels) -> None: ...

    def goodput(self, b: Breakdown, advice: IntervalAdvice | None) -> None: ...

    def close(self) -> None: ...


class NoExporter:
    """``metrics.prometheus = false``: every figure goes nowhere."""

    def health(self, findings: list, readings: dict) -> None:
        pass

    def step_done(self, step: int, seconds: float) -> None:
        pass

    def stragglers(self, slowdowns: dict[int, float]) -> None:
        pass

    def set(self, name: str, value: float, **labels) -> None:
        pass

    def goodput(self, b: Breakdown, advice: IntervalAdvice | None) -> None:
        pass

    def close(self) -> None:
        pass


class Exporter:
    def __init__(self, cfg: MetricsConfig, run_dir: str, *, rank: int, local_rank: int,
                 host: str, world_size: int):
        self.cfg, self.run_dir, self.rank = cfg, run_dir, rank
        self.base = {"run": cfg.run_name or run_dir.rstrip("/").rsplit("/", 1)[-1],
                     "rank": str(rank), "local_rank": str(local_rank), "host": host}
        self.local_rank, self.host = local_rank, host
        self.registry = CollectorRegistry()
        self.m = {}
        for name, (kind, doc, extra) in _DEFS.items():
            cls = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[kind]
            kwargs = {}
            if kind == "histogram":
                kwargs["buckets"] = (_SAVE_BUCKETS if "checkpoint" in name else _STEP_BUCKETS)
            # Series appear on first use: a rank that never knows a value (only rank 0
            # has the job's loss) exports nothing rather than a misleading 0.
            self.m[name] = cls(name, doc, LABELS + extra, registry=self.registry, **kwargs)
        # what every step sets, its series looked up at the first (a lookup takes the
        # metric's lock; made earlier, a heartbeat at 0 would read as long stale)
        self._each_step: list | None = None
        self.server = None
        self.port: int | None = None
        self.target_url: str | None = None
        # Counts start at 0, so that increase() sees the first one: on rank 0 the run-wide
        # ones and retention's (rank 0 applies it); on every rank those any rank may count
        # (a warm recovery is counted by the lowest survivor, whichever rank that is)
        zeroed = ("llmtrain_snapshot_replication_failures_total",
                  "llmtrain_warm_recoveries_total", "llmtrain_fence_unreachable_total")
        if rank == 0:
            zeroed += ("llmtrain_hangs_total", "llmtrain_desyncs_total",
                       "llmtrain_checkpoint_failures_total",
                       "llmtrain_checkpoint_retention_failures_total",
                       "llmtrain_checkpoint_passed_over_total")
        for name in zeroed:
            self.series(name)
        self.set("llmtrain_world_size", world_size)
        self.set("llmtrain_restart_count", int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        port = self.cfg.port + self.local_rank if self.cfg.port else 0
        try:
            self.server, _ = start_http_server(port, self.cfg.address, self.registry)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            self.server, _ = start_http_server(0, self.cfg.address, self.registry)
        self.port = self.server.server_port
        self._write_target()
        self._replay_history()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.target_url:
            try:
                import fsspec
                fs, path = fsspec.core.url_to_fs(self.target_url)
                fs.rm_file(path)
            except OSError:
                pass

    def _write_target(self) -> None:
        """A file_sd entry, so Prometheus finds every rank without a static list."""
        addr = self.cfg.address if self.cfg.address not in ("", "0.0.0.0", "::") else self.host
        targets_dir = self.cfg.targets_dir or join(self.run_dir, "monitoring/targets")
        self.target_url = join(targets_dir, f"{self.host}-{self.local_rank}.json")
        # The target carries the series' own labels, so that `up` names the rank and host
        # of an exporter that stopped answering (the scrape job honors them).
        entry = [{"targets": [f"{addr}:{self.port}"], "labels": self.base}]
        write_atomic(self.target_url, json.dumps(entry).encode())

    def _replay_history(self) -> None:
        """Run-wide counts from earlier attempts, so a restart does not reset them. Rank 0
        reads the whole log (the run-wide verdicts any rank may have written), every other
        rank only its own files: at every start of every rank, N ranks each reading all N
        ranks' logs would put N² reads on the run's storage."""
        try:
            events = read_events(self.run_dir,
                                 writer=None if self.rank == 0 else f"rank-{self.rank}")
        except FileNotFoundError:
            return
        for e in events:
            # this rank's own history, and on rank 0 the run-wide verdicts
            mine = e["rank"] == self.rank or (self.rank == 0 and e["event"] in
                                             ("hang", "collective_error"))
            # (not snapshot replication failures: each process replicates afresh)
            if mine and e["event"] in ("hang", "collective_error", "checkpoint_failed",
                                       "checkpoint_retention_failed", "checkpoint_committed",
                                       "checkpoint_passed_over", "fence_unreachable"):
                self.observe(e)
        if self.rank == 0:  # a run-wide count (rank 0 starts every attempt)
            sizes = [e["world_size"] for e in events if e["event"] == "attempt_start"]
            self.set("llmtrain_membership_changes",
                     sum(a != b for a, b in zip(sizes, sizes[1:])))

    # -- updates ------------------------------------------------------------------------

    def series(self, name: str, **labels):
        return self.m[name].labels(**self.base, **labels)

    def set(self, name: str, value: float, **labels) -> None:
        self.series(name, **labels).set(value)

    def step_done(self, step: int, seconds: float) -> None:
        now = time.time()
        if self._each_step is None:
            self._each_step = [self.series(name) for name in (
                "llmtrain_step", "llmtrain_last_step_timestamp_seconds",
                "llmtrain_heartbeat_timestamp_seconds", "llmtrain_step_seconds")]
        last_step, ended, heartbeat, step_seconds = self._each_step
        last_step.set(step)
        ended.set(now)
        heartbeat.set(now)
        step_seconds.observe(seconds)

    def stragglers(self, slowdowns: dict[int, float]) -> None:
        """The watchdog's slowest ranks (and, at the median, those that were)."""
        for peer, slowdown in slowdowns.items():
            self.set("llmtrain_straggler_slowdown", slowdown, peer_rank=str(peer))

    def health(self, findings: list, readings: dict) -> None:
        """The health monitor's latest pass: each check's severity and the GPU readings."""
        for f in findings:
            self.set("llmtrain_health_check_severity", SEVERITY[f.severity], check=f.check,
                     gpu="" if f.gpu is None else str(f.gpu))
        for gpu, r in readings.items():
            g = str(gpu)
            for name, key in (("llmtrain_gpu_temperature_celsius", "temperature_c"),
                              ("llmtrain_gpu_power_watts", "power_w"),
                              ("llmtrain_gpu_pcie_link_width", "pcie_width"),
                              ("llmtrain_gpu_pcie_link_width_max", "pcie_width_max")):
                if r.get(key) is not None:
                    self.set(name, r[key], gpu=g)
            for scope in ("volatile", "aggregate"):
                if r.get(f"ecc_{scope}") is not None:
                    self.set("llmtrain_gpu_ecc_uncorrectable_errors", r[f"ecc_{scope}"],
                             gpu=g, scope=scope)
            for reason, active in (r.get("throttle") or {}).items():
                self.set("llmtrain_gpu_throttle_active", int(active), gpu=g, reason=reason)

    def observe(self, e: dict) -> None:
        """One event from the EventLog."""
        kind = e["event"]
        if kind == "step":
            self.set("llmtrain_loss", e["loss"])
            self.set("llmtrain_tokens_per_second", e["tokens_per_s"])
            self.set("llmtrain_learning_rate", e["lr"])
            self.set("llmtrain_memory_peak_bytes", e["memory_gb"] * 2**30)
            if e.get("mfu") is not None:
                self.set("llmtrain_mfu_ratio", e["mfu"])
        elif kind == "checkpoint_staged":
            self.series("llmtrain_checkpoint_blocking_seconds").observe(e["blocking_s"])
        elif kind == "checkpoint_committed":
            if "total_s" in e:
                self.series("llmtrain_checkpoint_save_seconds").observe(e["total_s"])
            if e.get("bytes") is not None:
                self.set("llmtrain_checkpoint_bytes", e["bytes"])
            self.set("llmtrain_checkpoint_last_committed_step", e["step"])
            self.set("llmtrain_checkpoint_last_committed_timestamp_seconds", e["ts"])
        elif kind == "checkpoint_loaded":
            self.set("llmtrain_checkpoint_load_seconds", e["seconds"])
            self.set("llmtrain_checkpoint_last_committed_step", e["step"])
        elif kind == "checkpoint_failed":
            self.series("llmtrain_checkpoint_failures_total").inc()
        elif kind == "checkpoint_retention_failed":
            self.series("llmtrain_checkpoint_retention_failures_total").inc()
        elif kind == "checkpoint_passed_over":
            self.series("llmtrain_checkpoint_passed_over_total").inc()
        elif kind == "fence_unreachable":
            self.series("llmtrain_fence_unreachable_total").inc()
        elif kind == "snapshot_replication_failed":
            if not e.get("stale"):  # a thread a recovery left behind is expected to fail
                self.series("llmtrain_snapshot_replication_failures_total").inc()
        elif kind == "hang":
            self.series("llmtrain_hangs_total").inc()
        elif kind == "collective_error":
            self.series("llmtrain_desyncs_total").inc()
        elif kind == "warm_recovery":
            self.series("llmtrain_warm_recoveries_total").inc()
            self.set("llmtrain_warm_recovery_seconds", e["total_s"], part="total")
            for part, seconds in e["parts_s"].items():
                self.set("llmtrain_warm_recovery_seconds", seconds, part=part)

    def goodput(self, b: Breakdown, advice: IntervalAdvice | None) -> None:
        self.set("llmtrain_goodput_ratio", b.ettr)
        self.set("llmtrain_wall_seconds", b.wall_s)
        self.set("llmtrain_productive_seconds", b.productive_s)
        for category, seconds in b.badput_s.items():
            self.set("llmtrain_badput_seconds", seconds, category=category)
        if advice is not None:
            self.set("llmtrain_checkpoint_interval_optimal_seconds", advice.optimal_interval_s)
            self.set("llmtrain_ettr_expected", advice.expected_ettr)


def start_exporter(cfg: MetricsConfig, run_dir: str, events: EventLog, *, rank: int,
                   local_rank: int, host: str, world_size: int) -> MetricsExport:
    """This rank's exporter, serving and listening to ``events`` (``metrics.prometheus``
    on), else one that exports nothing."""
    if not cfg.prometheus:
        return NoExporter()
    exporter = Exporter(cfg, run_dir, rank=rank, local_rank=local_rank, host=host,
                        world_size=world_size)
    exporter.start()
    events.listeners.append(exporter.observe)
    return exporter
