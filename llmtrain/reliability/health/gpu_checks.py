"""The GPU health checks: one small function per finding, and the table that runs them.

Each check reads one GPU's NVML reading (:func:`llmtrain.reliability.health.nvml.read_gpu`)
and what it needs beside it (a :class:`GpuContext`), and returns its verdict, a
``(severity, message)`` pair, or None where it has nothing to say. A field the driver does
not report is UNKNOWN, and its check says "unknown", never healthy.
:class:`~llmtrain.reliability.health.checks.HealthChecker` runs :data:`GPU_CHECKS` in order
and turns each verdict into a ``Finding`` named for the check.

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

import os
from dataclasses import dataclass
from typing import Any, Callable

import pynvml

from llmtrain.config import HealthConfig
from llmtrain.process_origin import waiting_workers
from llmtrain.reliability.health.nvml import UNKNOWN, recovery_name

Reading = dict[str, Any]  # one GPU's fields, as read_gpu returns them
Verdict = tuple[str, str]  # (severity, message)

# Throttle reasons that mean the GPU is being slowed by a fault, not by normal power limits.
_BAD_THROTTLE = ("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal")
_XID_MEANINGS = {48: "double-bit ECC error", 63: "row remapping/page retirement recorded",
                 64: "row remapper failed to record an error", 74: "NVLink error",
                 79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate",
                 94: "contained ECC error", 95: "uncontained ECC error",
                 119: "GSP RPC timeout", 120: "GSP error"}


def pid_visible(pid: int) -> bool:
    """Whether ``pid`` is a process of this PID namespace. NVML reports the host's PIDs:
    in a container without the host's PID namespace they are not (not even this
    process's own), so a process holding memory there cannot be called a stray."""
    return os.path.exists(f"/proc/{pid}")


@dataclass(frozen=True)
class GpuContext:
    """What the checks know of a GPU beside its reading."""
    cfg: HealthConfig
    xids: tuple[int, ...] = ()  # XIDs reported for this GPU (events and the kernel log)
    nvlink_seen: frozenset[int] = frozenset()  # links seen active, this pass or before
    pid_visible: Callable[[int], bool] = pid_visible


def parse_xids(text: str) -> set[int]:
    """The XIDs of a comma-separated list (``health.xid_fatal``, ``health.xid_warn``)."""
    return {int(x) for x in text.split(",") if x.strip()}


def _unknown(what: str) -> Verdict:
    return "unknown", f"NVML does not report {what} for this GPU/driver; not checked"


def _show(v: Any) -> str:
    return "?" if v is UNKNOWN else str(v)


def _pids(procs: list[tuple[int, float]]) -> str:
    return ", ".join(f"pid {pid} ({mib:.0f} MiB)" for pid, mib in procs)


def _xid_meaning(xid: int) -> str:
    return _XID_MEANINGS.get(xid, "see NVIDIA's XID catalog")


def ecc_volatile(s: Reading, ctx: GpuContext) -> Verdict:
    """Uncorrectable ECC errors since the driver loaded: any is fatal."""
    v = s["ecc_volatile"]
    if v is UNKNOWN:
        return _unknown("uncorrectable ECC errors (ECC off?)")
    if v > 0:
        split = ", ".join(f"{loc.upper()} {s[f'ecc_volatile_{loc}']}"
                          for loc in ("dram", "sram") if s[f"ecc_volatile_{loc}"] is not UNKNOWN)
        return "fatal", (f"{v} uncorrectable ECC error(s) since the driver loaded"
                         f"{f' ({split})' if split else ''}: results on this GPU cannot be "
                         f"trusted; drain the node and reset the GPU")
    return "ok", "no uncorrectable ECC errors since the driver loaded"


def ecc_aggregate(s: Reading, ctx: GpuContext) -> Verdict:
    """Uncorrectable ECC errors in the GPU's life: SRAM errors cannot be remapped, so any
    is fatal; DRAM ones above ``health.max_aggregate_uce`` warn."""
    agg, sram = s["ecc_aggregate"], s["ecc_aggregate_sram"]
    if agg is UNKNOWN:
        return _unknown("lifetime uncorrectable ECC errors")
    if sram is not UNKNOWN and sram > 0:
        return "fatal", (f"{sram} uncorrectable SRAM ECC error(s) in the GPU's life: SRAM "
                         f"cannot be remapped; replace the GPU (RMA)")
    if agg > ctx.cfg.max_aggregate_uce:
        return "warn", (f"{agg} uncorrectable ECC error(s) in the GPU's life (threshold "
                        f"{ctx.cfg.max_aggregate_uce}): memory is degrading; plan a replacement")
    return "ok", f"{agg} lifetime uncorrectable ECC error(s)"


def retired_pages(s: Reading, ctx: GpuContext) -> Verdict | None:
    """Page retirement (before Ampere): pending retirements warn; nothing said otherwise
    (the row_remap check says when neither mechanism is reported)."""
    if s["retired_pages_pending"] is True:
        return "warn", ("retired pages are pending: reset the GPU to retire them before it "
                        "sees more memory errors")
    return None


def row_remap(s: Reading, ctx: GpuContext) -> Verdict | None:
    """Row remapping (Ampere on): a failure is fatal, a pending remap warns."""
    if s["remapped_rows"] is UNKNOWN:
        if s["retired_pages_pending"] is UNKNOWN:
            return _unknown("row remapping or page retirement")
        return None  # a GPU of the page-retirement era: retired_pages speaks for it
    corr, unc, pending, failure = s["remapped_rows"]
    if failure:
        return "fatal", (f"row remapping failed ({unc} rows remapped for uncorrectable "
                         f"errors): no spare rows left; replace the GPU (RMA)")
    if pending:
        return "warn", ("row remapping is pending: reset the GPU to apply it; until then the "
                        "bad rows are still in use")
    return "ok", f"{corr + unc} rows remapped, none pending"


def xid(s: Reading, ctx: GpuContext) -> Verdict:
    """The XIDs reported for the GPU, judged by ``health.xid_fatal`` and ``xid_warn``."""
    fatal = sorted({x for x in ctx.xids if x in parse_xids(ctx.cfg.xid_fatal)})
    warn = sorted({x for x in ctx.xids if x in parse_xids(ctx.cfg.xid_warn)})
    if fatal:
        return "fatal", (f"critical XID {', '.join(map(str, fatal))} reported "
                         f"({_xid_meaning(fatal[0])}); drain the node and reset the GPU")
    if warn:
        return "warn", f"XID {', '.join(map(str, warn))} reported ({_xid_meaning(warn[0])})"
    return "ok", "no critical XIDs"


def pcie_link(s: Reading, ctx: GpuContext) -> Verdict:
    """The PCIe link width, which is what a degraded link shows (``health.pcie_degraded``);
    the generation drops at idle to save power, so a low generation alone is only noted."""
    width, max_width = s["pcie_width"], s["pcie_width_max"]
    if width is UNKNOWN or max_width is UNKNOWN:
        return _unknown("the PCIe link width")
    if width < max_width:
        return ctx.cfg.pcie_degraded, (
            f"PCIe link at x{width}, the device supports x{max_width} (gen "
            f"{_show(s['pcie_gen'])} of {_show(s['pcie_max_gen'])}): host transfers and "
            f"GPUDirect run at a fraction of their speed; reseat or replace the riser/cable")
    return "ok", f"PCIe x{width} gen {_show(s['pcie_gen'])}"


def throttle(s: Reading, ctx: GpuContext) -> Verdict:
    """Clocks slowed by a fault (hardware or thermal slowdown, power brake); a power cap
    under load is normal."""
    reasons, temp = s["throttle"], s["temperature_c"]
    if reasons is UNKNOWN:
        return _unknown("clock throttle reasons")
    bad = [r for r in _BAD_THROTTLE if reasons.get(r)]
    if not bad:
        return "ok", "no hardware or thermal slowdown"
    return "warn", (f"clocks slowed by {', '.join(bad)}"
                    f"{f' at {temp} C' if temp is not UNKNOWN else ''}: this GPU will be a "
                    f"straggler; check cooling and power")


def temperature(s: Reading, ctx: GpuContext) -> Verdict:
    """The GPU temperature against ``health.max_temperature_c``."""
    temp, limit = s["temperature_c"], ctx.cfg.max_temperature_c
    if temp is UNKNOWN:
        return _unknown("the GPU temperature")
    if temp >= limit:
        return "warn", f"{temp} C, at or above {limit} C: check the node's cooling"
    return "ok", f"{temp} C"


def nvlink(s: Reading, ctx: GpuContext) -> Verdict:
    """NVLink links down (fatal) or over ``health.nvlink_error_threshold`` errors (warn).
    A PCIe card without a bridge reports every port inactive: no fault until a link has
    been seen active (``ctx.nvlink_seen``)."""
    links, limit = s["nvlink"], ctx.cfg.nvlink_error_threshold
    if links is UNKNOWN or not links:
        return "ok", "no NVLink links reported (a PCIe-only GPU)"
    if not ctx.nvlink_seen:
        return "ok", f"no NVLink link active of {len(links)} (no bridge or fabric in use)"
    down = [link["link"] for link in links if not link["active"]]
    noisy = [link["link"] for link in links if any(
        link[k] is not UNKNOWN and link[k] > limit for k in ("replay", "recovery", "crc_flit"))]
    if down:
        return "fatal", (f"NVLink link(s) {down} down: collectives over them fail or fall "
                         f"back to slow paths; drain the node")
    if noisy:
        return "warn", (f"NVLink link(s) {noisy} over {limit} replay/recovery/CRC errors: the "
                        f"link is degrading")
    return "ok", f"{len(links)} NVLink link(s) active"


def stray_processes(s: Reading, ctx: GpuContext) -> Verdict:
    """Before the job starts, GPU memory held by anyone else is someone else's
    (``health.stray_processes``), except this node's prepared workers waiting for their
    attempts (their CUDA contexts); a process NVML names by a PID of another namespace is
    nobody's we can tell."""
    procs = s["processes"]
    if procs is UNKNOWN:
        return _unknown("the processes using the GPU")
    ours = {os.getpid(), *waiting_workers()}
    others = [(pid, mib) for pid, mib in procs if pid not in ours]
    stray = [(pid, mib) for pid, mib in others if ctx.pid_visible(pid)]
    hidden = [p for p in others if p not in stray]
    foreign = (f"GPU memory held by {_pids(hidden)} in another PID namespace (in a container, "
               f"NVML reports the host's PIDs, this process's own among them): whose it is "
               f"cannot be told here")
    if stray:
        return ctx.cfg.stray_processes, (
            "processes holding GPU memory: " + _pids(stray) + "; a previous job did not exit; "
            "kill them or reset the GPU" + (f"; {foreign}" if hidden else ""))
    if hidden:
        return "unknown", foreign
    return "ok", "no other processes on the GPU"


def recovery_action(s: Reading, ctx: GpuContext) -> Verdict:
    """The recovery the driver asks for (driver 550+): any is fatal."""
    action = s["recovery_action"]
    if action is UNKNOWN:
        return _unknown("a recovery action (driver 550+)")
    if action != pynvml.NVML_GPU_RECOVERY_ACTION_NONE:
        return "fatal", (f"the driver asks for recovery action {recovery_name(action)}: "
                         f"drain the node and do it")
    return "ok", "the driver asks for no recovery"


# The checks in the order their findings are reported, by the name each finding carries.
GPU_CHECKS: tuple[tuple[str, Callable[[Reading, GpuContext], Verdict | None]], ...] = (
    ("ecc_volatile", ecc_volatile),
    ("ecc_aggregate", ecc_aggregate),
    ("retired_pages", retired_pages),
    ("row_remap", row_remap),
    ("xid", xid),
    ("pcie_link", pcie_link),
    ("throttle", throttle),
    ("temperature", temperature),
    ("nvlink", nvlink),
    ("stray_processes", stray_processes),
    ("recovery_action", recovery_action),
)
