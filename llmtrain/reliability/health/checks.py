"""GPU and node health: bad hardware never joins the job, failing hardware leaves it.

Most interruptions of large jobs are hardware (Llama 3: 78%): GPUs falling off the bus,
uncorrectable memory errors, failed row remapping, degraded links. Each check reads NVML
through ``pynvml`` (or the scripted stand-in with the same calls, on machines without
GPUs) and returns a :class:`Finding` naming the host, the GPU (index, UUID, PCI bus id) and
what to do. A field the driver does not report is "unknown", never healthy.

Severities: ok, unknown (not checkable here), warn (an event and a metric; the job goes
on), fatal (the node must leave the job: the gate exits EXCLUDE_NODE before the node joins;
the monitor stops the rank with EXCLUDE_NODE after a last checkpoint).

The GPU checks, one function per finding, and the XIDs they judge are in
:mod:`llmtrain.reliability.health.gpu_checks`.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import re
import socket
import logging
import subprocess
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Callable

import pynvml

from llmtrain.config import ConfigError, HealthConfig
from llmtrain.fsio import is_local, probe_writable
from llmtrain.reliability.health.gpu_checks import GPU_CHECKS, GpuContext, pid_visible
from llmtrain.reliability.health.nvml import UNKNOWN, read_gpu, readings
from llmtrain.reliability.health.nvml_scripted import ScriptedNVML

log = logging.getLogger(__name__)

SEVERITIES = ("ok", "unknown", "warn", "fatal")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}
_XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+),?(.*)")


@dataclass
class Finding:
    check: str
    severity: str
    message: str
    host: str
    gpu: int | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    value: float | None = None  # the measure judged, where one number says it (link)

    def sentence(self) -> str:
        where = self.host if self.gpu is None else (
            f"{self.host} GPU {self.gpu} ({self.uuid}, PCI {self.pci_bus_id})")
        return f"{self.severity.upper()} {self.check} on {where}: {self.message}"


def worst(findings: list[Finding]) -> str:
    return max((f.severity for f in findings), key=_RANK.__getitem__, default="ok")


# -- backends --------------------------------------------------------------------------


@dataclass
class Backend:
    """What the checks talk to: an object with pynvml's calls, and the kernel log."""
    nvml: Any
    kind: str

    def kernel_log(self) -> list[str] | None:
        """Kernel messages (for XIDs from before we started); None when unreadable."""
        if isinstance(self.nvml, ScriptedNVML):
            return self.nvml.kernel_log()
        try:
            out = subprocess.run(["dmesg", "--time-format", "iso"], capture_output=True,
                                 text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.splitlines() if out.returncode == 0 else None


def open_backend(cfg: HealthConfig) -> Backend | None:
    """NVML when the library loads; else the scripted states when a script is given;
    else None: a machine without GPUs (CPU mode)."""
    script = cfg.script or os.environ.get("LLMTRAIN_NVML_SCRIPT", "")
    if cfg.backend in ("auto", "nvml"):
        try:
            pynvml.nvmlInit()
            return Backend(pynvml, "nvml")
        except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as e:
            if cfg.backend == "nvml":
                raise ConfigError(f"health.backend='nvml' but NVML cannot load ({e}); is the "
                                  f"NVIDIA driver installed? Use health.backend='auto' on "
                                  f"machines without GPUs") from None
    if cfg.backend in ("auto", "scripted") and script:
        if not os.path.exists(script):
            raise ConfigError(f"health.script={script!r} does not exist; give the path of a "
                              f"JSON or TOML file of scripted GPU states")
        nvml = ScriptedNVML(script)
        nvml.nvmlInit()
        return Backend(nvml, "scripted")
    if cfg.backend == "scripted":
        raise ConfigError("health.backend='scripted' needs health.script (or the "
                          "LLMTRAIN_NVML_SCRIPT environment variable)")
    return None


# -- the checks ------------------------------------------------------------------------


def _bus(pci: str) -> str:
    """"00000000:18:00.0" and the kernel's "0000:18:00" both give "18:00"."""
    parts = pci.lower().split(".")[0].split(":")
    return ":".join(parts[-2:])


def kernel_xids(lines: list[str], window_s: float, now: float) -> list[tuple[str, int, str]]:
    """(PCI bus, XID, text) of the kernel's NVRM Xid lines from the last ``window_s``."""
    found = []
    for line in lines:
        m = _XID_LINE.search(line)
        if not m:
            continue
        stamp = line.split(" ", 1)[0]
        try:
            if now - datetime.fromisoformat(stamp.replace(",", ".")).timestamp() > window_s:
                continue
        except ValueError:
            pass  # no ISO timestamp: we cannot tell its age, so it counts
        found.append((_bus(m.group(1)), int(m.group(2)), m.group(3).strip()))
    return found


class HealthChecker:
    """Runs the checks for some GPUs of this node, and the node's own checks."""

    def __init__(self, cfg: HealthConfig, backend: Backend | None, *, host: str | None = None,
                 storage: dict[str, str] | None = None,
                 pid_visible: Callable[[int], bool] = pid_visible):
        """``pid_visible``: whether a PID that NVML reports is a process of this PID
        namespace (the stray-process check's only use of it)."""
        self.cfg, self.backend, self.pid_visible = cfg, backend, pid_visible
        self.host = host or socket.gethostname()
        self.storage = storage or {}  # check name -> URL, e.g. {"run_storage": run_dir}
        self.event_set = None
        self.xids: dict[int, list[int]] = {}  # XIDs seen through NVML events, per GPU
        # NVLink links seen active, per GPU: once one is, any link down is a fault
        self.nvlink_active: dict[int, set[int]] = {}
        self.plugins = [_load_plugin(p) for p in cfg.plugins.split(",") if p.strip()]
        self.tcp: list[tuple[float, int, int]] = []  # (when, TCP segments sent, resent)

    # -- GPUs --

    def gpu_count(self) -> int:
        return self.backend.nvml.nvmlDeviceGetCount() if self.backend else 0

    def watch_xids(self, gpus: list[int]) -> bool:
        """Registers for XID events, so a monitor sees each one as it happens.

        MIG, vGPU and some drivers refuse event registration (NotSupported, NoPermission):
        then the monitor goes on reading XIDs from the kernel log at each pass, and this
        returns False instead of failing the trainer's start.
        """
        nvml = self.backend.nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
            for i in gpus:
                nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(i),
                                              nvml.nvmlEventTypeXidCriticalError, event_set)
        except pynvml.NVMLError as e:
            log.warning("llmtrain health: NVML XID events unavailable (%s); XIDs are read from "
                        "the kernel log at each check instead", e)
            return False
        self.event_set = event_set
        return True

    def _poll_xids(self) -> None:
        """The XID events NVML has for the watched GPUs, by GPU index (an event names its
        GPU by a handle, which cannot be a key)."""
        nvml = self.backend.nvml
        while True:
            try:
                e = nvml.nvmlEventSetWait_v2(self.event_set, 0)
                gpu = nvml.nvmlDeviceGetIndex(e.device)
            except pynvml.NVMLError:  # none left; or a GPU is lost: its reading says so
                return
            self.xids.setdefault(gpu, []).append(e.eventData)

    def gpus(self, indices: list[int] | None = None) -> tuple[list[Finding], dict[int, dict]]:
        """Findings for the given GPUs (all by default) and their readings for metrics."""
        if self.backend is None:
            return [Finding("gpus", "ok", "no GPUs (CPU mode); GPU checks skipped",
                            self.host)], {}
        nvml = self.backend.nvml
        count = nvml.nvmlDeviceGetCount()
        findings = [self._count_finding(count)] if indices is None else []
        kernel = self.backend.kernel_log() if self.event_set is None else []
        if kernel is None:
            findings.append(Finding("xid", "unknown", "the kernel log is not readable here, so "
                                    "XIDs from before this check are not seen (run as root or "
                                    "allow dmesg)", self.host))
        recent = kernel_xids(kernel or [], self.cfg.xid_window_s, time.time())
        if self.event_set is not None:
            self._poll_xids()
        results: dict[int, dict] = {}
        for i in (range(count) if indices is None else indices):
            try:
                s = read_gpu(nvml, i)
            except pynvml.NVMLError as e:
                findings.append(Finding("gpu_lost", "fatal", f"NVML cannot reach GPU {i} "
                                        f"({e}): it has fallen off the bus or is not present; "
                                        f"drain the node and reset or replace the GPU",
                                        self.host, gpu=i))
                continue
            xids = list(self.xids.get(i, []))
            if s["pci_bus_id"] is not UNKNOWN:
                xids += [x for bus, x, _ in recent if bus == _bus(s["pci_bus_id"])]
            findings += self._gpu_findings(s, xids)
            results[i] = readings(s)
        return findings, results

    def _count_finding(self, count: int) -> Finding:
        expected = self.cfg.expected_gpus
        if expected == -1:
            expected = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        if expected and count < expected:
            return Finding("gpu_count", "fatal", f"{count} GPU(s) visible to NVML, {expected} "
                           f"expected: a GPU has fallen off the bus or failed to initialize "
                           f"(XID 79); drain the node and reset it", self.host)
        return Finding("gpu_count", "ok", f"{count} GPU(s)" +
                       (f", {expected} expected" if expected else ""), self.host)

    def _gpu_findings(self, s: dict, xids: list[int]) -> list[Finding]:
        """The findings of every check of :data:`GPU_CHECKS` on one GPU's reading."""
        seen = self.nvlink_active.setdefault(s["index"], set())
        if s["nvlink"] is not UNKNOWN:
            seen |= {link["link"] for link in s["nvlink"] if link["active"]}
        ctx = GpuContext(self.cfg, tuple(xids), frozenset(seen), self.pid_visible)
        where = {"gpu": s["index"], "uuid": None if s["uuid"] is UNKNOWN else s["uuid"],
                 "pci_bus_id": None if s["pci_bus_id"] is UNKNOWN else s["pci_bus_id"]}
        return [Finding(name, *verdict, self.host, **where) for name, check in GPU_CHECKS
                if (verdict := check(s, ctx)) is not None]

    # -- the node --

    def node(self) -> list[Finding]:
        out = [self._storage(check, url) for check, url in self.storage.items()]
        out.append(self._shm())
        out.append(self._clock())
        out.append(self._link())
        for plugin in self.plugins:
            out += plugin(self.cfg, self.host)
        return out

    def _storage(self, check: str, url: str) -> Finding:
        try:
            fs, path = probe_writable(url, f".llmtrain-health-{self.host}-{os.getpid()}",
                                      create=False)  # a check leaves no run dir behind
        except Exception as e:  # noqa: BLE001 - any failure means the node cannot save
            return Finding(check, "fatal", f"{url} is not writable from this node "
                           f"({type(e).__name__}: {e}): checkpoints would fail; check the "
                           f"mount", self.host)
        if not is_local(fs):
            return Finding(check, "ok", f"{url} writable (free space not reported by this "
                           f"store)", self.host)
        st = os.statvfs(path)
        free_gb = st.f_bavail * st.f_frsize / 1e9
        if free_gb < self.cfg.min_free_gb:
            return Finding(check, "warn", f"{url} has {free_gb:.2f} GB free, below "
                           f"health.min_free_gb={self.cfg.min_free_gb}: the next checkpoint "
                           f"may not fit; free space or move the run", self.host)
        return Finding(check, "ok", f"{url} writable, {free_gb:.1f} GB free", self.host)

    def _shm(self) -> Finding:
        try:
            st = os.statvfs("/dev/shm")
        except OSError as e:
            return Finding("shm", "fatal", f"/dev/shm is not available ({e}): NCCL and "
                           f"DataLoader workers need it", self.host)
        size_gb = st.f_blocks * st.f_frsize / 1e9
        if size_gb < self.cfg.min_shm_gb:
            return Finding("shm", "fatal", f"/dev/shm is {size_gb:.2f} GB, below "
                           f"health.min_shm_gb={self.cfg.min_shm_gb}: NCCL fails with "
                           f"'unhandled system error'; give containers --shm-size or "
                           f"--ipc=host", self.host)
        return Finding("shm", "ok", f"/dev/shm {size_gb:.1f} GB", self.host)

    def _clock(self) -> Finding:
        now = time.time()
        if now < 1_704_067_200:  # 2024-01-01: a clock before it was never set
            return Finding("clock", "fatal", f"the system clock reads "
                           f"{time.strftime('%Y-%m-%d', time.gmtime(now))}: it was never set; "
                           f"timeouts, certificates and logs will be wrong", self.host)
        state = _kernel_clock_state()
        if state is None:
            return Finding("clock", "unknown", "cannot ask the kernel whether the clock is "
                           "synchronized", self.host)
        if state == 5:  # TIME_ERROR: the kernel's clock is not synchronized
            return Finding("clock", "warn", "the kernel reports the clock is not "
                           "synchronized (NTP/PTP not running): event times across nodes "
                           "may disagree", self.host)
        return Finding("clock", "ok", "clock synchronized", self.host)

    def _link(self) -> Finding:
        """The share of the TCP segments this node sent over the last
        ``health.link_window_s`` that it had to send again: a lossy link (a bad cable, NIC
        or switch port, a congested fabric) shows there first, most on the node whose
        sends are lost. The counters are the network namespace's: a node's own on a
        cluster (and in chaos runs)."""
        now = _tcp_counters()
        if now is None:
            return Finding("link", "unknown", "/proc/net/snmp has no TCP counters here",
                           self.host)
        t = time.monotonic()
        self.tcp.append((t, *now))
        while len(self.tcp) > 2 and self.tcp[1][0] <= t - self.cfg.link_window_s:
            self.tcp.pop(0)  # keep the newest sample a window old, as the base
        if len(self.tcp) == 1:
            return Finding("link", "ok", "TCP counters sampled; judged from the next pass on",
                           self.host)
        _, sent_before, resent_before = self.tcp[0]
        sent, resent = now[0] - sent_before, now[1] - resent_before
        if sent < self.cfg.link_min_segments:
            return Finding("link", "ok", f"{sent} TCP segments sent in the last "
                           f"{t - self.tcp[0][0]:.0f} s: too few to judge", self.host)
        ratio = resent / sent
        if ratio > self.cfg.max_retransmit_ratio:
            return Finding("link", "warn", f"{ratio:.1%} of the {sent} TCP segments sent in "
                           f"the last {t - self.tcp[0][0]:.0f} s were sent again (above "
                           f"health.max_retransmit_ratio={self.cfg.max_retransmit_ratio}): a "
                           f"lossy or congested link; check this node's NIC, cable and "
                           f"switch port", self.host, value=ratio)
        return Finding("link", "ok", f"{ratio:.2%} of {sent} TCP segments sent again",
                       self.host, value=ratio)

    def run(self) -> tuple[list[Finding], dict[int, dict]]:
        findings, values = self.gpus()
        return findings + self.node(), values


def _tcp_counters() -> tuple[int, int] | None:
    """(OutSegs, RetransSegs) of this network namespace, from /proc/net/snmp."""
    try:
        with open("/proc/net/snmp") as f:
            names, values = [line.split()[1:] for line in f if line.startswith("Tcp:")][:2]
    except (OSError, ValueError):
        return None
    tcp = dict(zip(names, map(int, values)))
    return tcp["OutSegs"], tcp["RetransSegs"]


class _Timex(ctypes.Structure):
    _fields_ = [("modes", ctypes.c_uint), ("rest", ctypes.c_byte * 256)]


def _kernel_clock_state() -> int | None:
    """adjtimex(2) with no changes: its return value is the clock state (5: unsynced)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        state = libc.adjtimex(ctypes.byref(_Timex()))
    except (OSError, AttributeError):
        return None
    return None if state < 0 else state


def _load_plugin(spec: str) -> Callable[[HealthConfig, str], list[Finding]]:
    module, _, name = spec.strip().partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"health.plugins: cannot load {spec!r} ({e}); give "
                          f"'module:function' importable on every node") from None


def table(findings: list[Finding]) -> str:
    rows = [("SEVERITY", "CHECK", "GPU", "MESSAGE")] + [
        (f.severity, f.check, "" if f.gpu is None else str(f.gpu), f.message) for f in findings]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]
                     for r in rows)


def to_json(findings: list[Finding], values: dict[int, dict], backend: Backend | None) -> str:
    return json.dumps({"host": socket.gethostname(), "backend": backend.kind if backend else None,
                       "worst": worst(findings), "findings": [asdict(f) for f in findings],
                       "readings": {str(k): v for k, v in values.items()}}, indent=2)
