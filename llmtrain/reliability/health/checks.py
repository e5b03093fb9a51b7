"""GPU and node health: bad hardware never joins the job, failing hardware leaves it.

Most interruptions of large jobs are hardware (Llama 3: 78%): GPUs falling off the bus,
uncorrectable memory errors, failed row remapping, degraded links. Each check reads NVML
through ``pynvml`` (or the scripted stand-in with the same calls, on machines without
GPUs) and returns a :class:`Finding` naming the host, the GPU (index, UUID, PCI bus id) and
what to do. A field the driver does not report is "unknown", never healthy.

Severities: ok, unknown (not checkable here), warn (an event and a metric; the job goes
on), fatal (the node must leave the job: the gate exits EXCLUDE_NODE before the node joins;
the monitor stops the rank with EXCLUDE_NODE after a last checkpoint).

Critical XIDs (from NVIDIA's XID catalog), fatal unless ``health.xid_fatal`` says otherwise:
  48   double-bit ECC error: memory returned wrong data; the GPU needs a reset
  64   ECC page retirement / row remapper could not record an error: the memory is unsafe
  74   NVLink error: a link went down; collectives over it fail or hang
  79   GPU has fallen off the bus: the device is gone until the node is reset
  95   uncontained ECC error: every process on the GPU was affected; reset required
  119, 120  GSP (GPU System Processor) RPC timeout / error: the GPU stops responding
and warnings (``health.xid_warn``):
  63   row remapping / page retirement recorded: fine until the next reset applies it
  92   high single-bit ECC rate: memory degrading, plan a replacement
  94   contained ECC error: only the affected process died; the GPU is usable
Application XIDs (13, 31, 43: bad kernels or memory accesses) are not hardware and ignored.
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
from llmtrain.reliability.health.nvml import UNKNOWN, read_gpu, readings, recovery_name
from llmtrain.reliability.health.nvml_scripted import ScriptedNVML

log = logging.getLogger(__name__)

SEVERITIES = ("ok", "unknown", "warn", "fatal")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}
# Throttle reasons that mean the GPU is being slowed by a fault, not by normal power limits.
_BAD_THROTTLE = ("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal")
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


def _parse_xids(text: str) -> set[int]:
    return {int(x) for x in text.split(",") if x.strip()}


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


def _pid_visible(pid: int) -> bool:
    """Whether ``pid`` is a process of this PID namespace. NVML reports the host's PIDs:
    in a container without the host's PID namespace they are not (not even this
    process's own), so a process holding memory there cannot be called a stray."""
    return os.path.exists(f"/proc/{pid}")


class HealthChecker:
    """Runs the checks for some GPUs of this node, and the node's own checks."""

    def __init__(self, cfg: HealthConfig, backend: Backend | None, *, host: str | None = None,
                 storage: dict[str, str] | None = None,
                 pid_visible: Callable[[int], bool] = _pid_visible):
        """``pid_visible``: whether a PID that NVML reports is a process of this PID
        namespace (the stray-process check's only use of it)."""
        self.cfg, self.backend, self.pid_visible = cfg, backend, pid_visible
        self.host = host or socket.gethostname()
        self.storage = storage or {}  # check name -> URL, e.g. {"run_storage": run_dir}
        self.xid_fatal, self.xid_warn = _parse_xids(cfg.xid_fatal), _parse_xids(cfg.xid_warn)
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
        c = self.cfg
        out: list[Finding] = []

        def add(check: str, severity: str, message: str) -> None:
            out.append(Finding(check, severity, message, self.host, gpu=s["index"],
                               uuid=None if s["uuid"] is UNKNOWN else s["uuid"],
                               pci_bus_id=None if s["pci_bus_id"] is UNKNOWN else s["pci_bus_id"]))

        def unknown(check: str, what: str) -> None:
            add(check, "unknown", f"NVML does not report {what} for this GPU/driver; not checked")

        # Uncorrectable ECC: volatile counts are since the last driver load, aggregate for
        # the GPU's life. SRAM errors cannot be remapped, so any is fatal.
        v, agg = s["ecc_volatile"], s["ecc_aggregate"]
        if v is UNKNOWN:
            unknown("ecc_volatile", "uncorrectable ECC errors (ECC off?)")
        elif v > 0:
            split = ", ".join(f"{loc.upper()} {s[f'ecc_volatile_{loc}']}" for loc in ("dram", "sram")
                              if s[f"ecc_volatile_{loc}"] is not UNKNOWN)
            add("ecc_volatile", "fatal", f"{v} uncorrectable ECC error(s) since the driver "
                f"loaded{f' ({split})' if split else ''}: results on this GPU cannot be "
                f"trusted; drain the node and reset the GPU")
        else:
            add("ecc_volatile", "ok", "no uncorrectable ECC errors since the driver loaded")
        if agg is UNKNOWN:
            unknown("ecc_aggregate", "lifetime uncorrectable ECC errors")
        else:
            sram = s["ecc_aggregate_sram"]
            if sram is not UNKNOWN and sram > 0:
                add("ecc_aggregate", "fatal", f"{sram} uncorrectable SRAM ECC error(s) in the "
                    f"GPU's life: SRAM cannot be remapped; replace the GPU (RMA)")
            elif agg > c.max_aggregate_uce:
                add("ecc_aggregate", "warn", f"{agg} uncorrectable ECC error(s) in the GPU's "
                    f"life (threshold {c.max_aggregate_uce}): memory is degrading; plan a "
                    f"replacement")
            else:
                add("ecc_aggregate", "ok", f"{agg} lifetime uncorrectable ECC error(s)")
        # Page retirement (before Ampere) and row remapping (Ampere on).
        if s["retired_pages_pending"] is UNKNOWN and s["remapped_rows"] is UNKNOWN:
            unknown("row_remap", "row remapping or page retirement")
        if s["retired_pages_pending"] is True:
            add("retired_pages", "warn", "retired pages are pending: reset the GPU to retire "
                "them before it sees more memory errors")
        if s["remapped_rows"] is not UNKNOWN:
            corr, unc, pending, failure = s["remapped_rows"]
            if failure:
                add("row_remap", "fatal", f"row remapping failed ({unc} rows remapped for "
                    f"uncorrectable errors): no spare rows left; replace the GPU (RMA)")
            elif pending:
                add("row_remap", "warn", "row remapping is pending: reset the GPU to apply it; "
                    "until then the bad rows are still in use")
            else:
                add("row_remap", "ok", f"{corr + unc} rows remapped, none pending")
        # XIDs
        fatal = sorted({x for x in xids if x in self.xid_fatal})
        warn = sorted({x for x in xids if x in self.xid_warn})
        if fatal:
            add("xid", "fatal", f"critical XID {', '.join(map(str, fatal))} reported "
                f"({_xid_meaning(fatal[0])}); drain the node and reset the GPU")
        elif warn:
            add("xid", "warn", f"XID {', '.join(map(str, warn))} reported "
                f"({_xid_meaning(warn[0])})")
        else:
            add("xid", "ok", "no critical XIDs")
        # PCIe: the width is what a degraded link shows; the generation drops at idle to
        # save power, so a low generation alone is only noted.
        width, max_width = s["pcie_width"], s["pcie_width_max"]
        if width is UNKNOWN or max_width is UNKNOWN:
            unknown("pcie_link", "the PCIe link width")
        elif width < max_width:
            add("pcie_link", c.pcie_degraded, f"PCIe link at x{width}, the device supports "
                f"x{max_width} (gen {_show(s['pcie_gen'])} of {_show(s['pcie_max_gen'])}): host "
                f"transfers and GPUDirect run at a fraction of their speed; reseat or replace "
                f"the riser/cable")
        else:
            add("pcie_link", "ok", f"PCIe x{width} gen {_show(s['pcie_gen'])}")
        # Throttling and temperature
        throttle, temp = s["throttle"], s["temperature_c"]
        if throttle is UNKNOWN:
            unknown("throttle", "clock throttle reasons")
        else:
            bad = [r for r in _BAD_THROTTLE if throttle.get(r)]
            if bad:
                add("throttle", "warn", f"clocks slowed by {', '.join(bad)}"
                    f"{f' at {temp} C' if temp is not UNKNOWN else ''}: this GPU will be a "
                    f"straggler; check cooling and power")
            else:
                add("throttle", "ok", "no hardware or thermal slowdown")
        if temp is UNKNOWN:
            unknown("temperature", "the GPU temperature")
        elif temp >= c.max_temperature_c:
            add("temperature", "warn", f"{temp} C, at or above {c.max_temperature_c} C: "
                f"check the node's cooling")
        else:
            add("temperature", "ok", f"{temp} C")
        # NVLink
        links = s["nvlink"]
        active = {l["link"] for l in links if l["active"]} if links is not UNKNOWN else set()
        was_active = self.nvlink_active.setdefault(s["index"], set())
        was_active |= active
        if links is UNKNOWN or not links:
            add("nvlink", "ok", "no NVLink links reported (a PCIe-only GPU)")
        elif not was_active:  # a PCIe card without a bridge reports every port inactive
            add("nvlink", "ok", f"no NVLink link active of {len(links)} (no bridge or fabric "
                f"in use)")
        else:
            down = [l["link"] for l in links if not l["active"]]
            noisy = [l["link"] for l in links if any(
                l[k] is not UNKNOWN and l[k] > c.nvlink_error_threshold
                for k in ("replay", "recovery", "crc_flit"))]
            if down:
                add("nvlink", "fatal", f"NVLink link(s) {down} down: collectives over them "
                    f"fail or fall back to slow paths; drain the node")
            elif noisy:
                add("nvlink", "warn", f"NVLink link(s) {noisy} over {c.nvlink_error_threshold} "
                    f"replay/recovery/CRC errors: the link is degrading")
            else:
                add("nvlink", "ok", f"{len(links)} NVLink link(s) active")
        # Stray processes: before the job starts, memory held by anyone is someone else's.
        procs = s["processes"]
        if procs is UNKNOWN:
            unknown("stray_processes", "the processes using the GPU")
        else:
            others = [(pid, mib) for pid, mib in procs if pid != os.getpid()]
            stray = [(pid, mib) for pid, mib in others if self.pid_visible(pid)]
            hidden = [p for p in others if p not in stray]
            foreign = (f"GPU memory held by {_pids(hidden)} in another PID namespace (in a "
                       f"container, NVML reports the host's PIDs, this process's own among "
                       f"them): whose it is cannot be told here")
            if stray:
                add("stray_processes", c.stray_processes, "processes holding GPU memory: " +
                    _pids(stray) + "; a previous job did not exit; kill them or reset the GPU" +
                    (f"; {foreign}" if hidden else ""))
            elif hidden:
                add("stray_processes", "unknown", foreign)
            else:
                add("stray_processes", "ok", "no other processes on the GPU")
        action = s["recovery_action"]
        if action is UNKNOWN:
            unknown("recovery_action", "a recovery action (driver 550+)")
        elif action != pynvml.NVML_GPU_RECOVERY_ACTION_NONE:
            add("recovery_action", "fatal", f"the driver asks for recovery action "
                f"{recovery_name(action)}: drain the node and do it")
        else:
            add("recovery_action", "ok", "the driver asks for no recovery")
        return out

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
            fs, path = probe_writable(url, f".llmtrain-health-{self.host}-{os.getpid()}")
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


def _show(v: Any) -> str:
    return "?" if v is UNKNOWN else str(v)


_XID_MEANINGS = {48: "double-bit ECC error", 63: "row remapping/page retirement recorded",
                 64: "row remapper failed to record an error", 74: "NVLink error",
                 79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate",
                 94: "contained ECC error", 95: "uncontained ECC error",
                 119: "GSP RPC timeout", 120: "GSP error"}


def _pids(procs: list[tuple[int, float]]) -> str:
    return ", ".join(f"pid {pid} ({mib:.0f} MiB)" for pid, mib in procs)


def _xid_meaning(xid: int) -> str:
    return _XID_MEANINGS.get(xid, "see NVIDIA's XID catalog")


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
