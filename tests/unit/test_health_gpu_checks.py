"""Each GPU check of the table on its own: a GPU's state scripted, read through NVML's calls
(the scripted backend, the same ``read_gpu`` a real node runs), and judged by that one check."""

import inspect
import os

import pytest

from nvml_states import node, write_script
from llmtrain.config import HealthConfig
from llmtrain.reliability.health import gpu_checks
from llmtrain.reliability.health.checks import Backend, HealthChecker
from llmtrain.reliability.health.gpu_checks import (GPU_CHECKS, GpuContext, ecc_aggregate,
                                                    ecc_volatile, nvlink, pcie_link, pid_visible,
                                                    recovery_action, retired_pages, row_remap,
                                                    stray_processes, temperature, throttle, xid)
from llmtrain.reliability.health.nvml import read_gpu
from llmtrain.reliability.health.nvml_scripted import ScriptedNVML

HOST = "node-a"


@pytest.fixture
def gpu(tmp_path):
    """``gpu(**fields)``: GPU 1 of a healthy node with ``fields`` changed, as NVML reads it."""
    def read(**fields) -> dict:
        state = node(2)
        state["gpus"][1].update(fields)
        return read_gpu(ScriptedNVML(write_script(tmp_path / "gpus.json", state), HOST), 1)
    return read


def ctx(xids=(), seen=frozenset(range(18)), visible=lambda pid: True, **cfg) -> GpuContext:
    return GpuContext(HealthConfig(**cfg), tuple(xids), frozenset(seen), visible)


def test_the_table_holds_every_check_once_under_its_own_name():
    names = [name for name, _ in GPU_CHECKS]
    assert len(set(names)) == len(names)
    assert all(check.__name__ == name for name, check in GPU_CHECKS)
    public = {name for name, f in inspect.getmembers(gpu_checks, inspect.isfunction)
              if f.__module__ == gpu_checks.__name__ and not name.startswith("_")}
    assert public - set(names) == {"pid_visible", "parse_xids"}  # helpers, not checks


def test_the_checker_reports_the_tables_verdicts_in_its_order(tmp_path):
    state = node(2)
    state["gpus"][1].update(retired_pages_pending=True, temperature_c=95)
    script = write_script(tmp_path / "gpus.json", state)
    findings, _ = HealthChecker(HealthConfig(), Backend(ScriptedNVML(script, HOST), "scripted"),
                                host=HOST, pid_visible=lambda pid: True).gpus([1])
    s = read_gpu(ScriptedNVML(script, HOST), 1)
    expected = [(name, *v) for name, check in GPU_CHECKS if (v := check(s, ctx())) is not None]
    assert [(f.check, f.severity, f.message) for f in findings] == expected
    assert {f.check for f in findings} == {name for name, _ in GPU_CHECKS}
    assert all(f.gpu == 1 and f.uuid.startswith("GPU-00000001") and f.host == HOST
               and f.pci_bus_id == "00000000:19:00.0" for f in findings)


def test_ecc_volatile(gpu):
    assert ecc_volatile(gpu(), ctx()) == (
        "ok", "no uncorrectable ECC errors since the driver loaded")
    severity, message = ecc_volatile(gpu(ecc={"volatile": {"dram": 2, "sram": 1}}), ctx())
    assert severity == "fatal" and message.startswith(
        "3 uncorrectable ECC error(s) since the driver loaded (DRAM 2, SRAM 1): ")
    severity, message = ecc_volatile(gpu(ecc={"volatile": {"dram": 1}}), ctx())
    assert severity == "fatal" and "(DRAM 1)" in message and "SRAM" not in message
    assert ecc_volatile(gpu(unsupported=["ecc"]), ctx())[0] == "unknown"


def test_ecc_aggregate(gpu):
    assert ecc_aggregate(gpu(), ctx()) == ("ok", "0 lifetime uncorrectable ECC error(s)")
    severity, message = ecc_aggregate(gpu(ecc={"aggregate": {"dram": 0, "sram": 1}}), ctx())
    assert severity == "fatal" and "SRAM cannot be remapped" in message and "RMA" in message
    dram = gpu(ecc={"aggregate": {"dram": 3, "sram": 0}})
    severity, message = ecc_aggregate(dram, ctx())
    assert severity == "warn" and "3 uncorrectable" in message and "threshold 0" in message
    assert ecc_aggregate(dram, ctx(max_aggregate_uce=3))[0] == "ok"
    assert ecc_aggregate(gpu(ecc={"volatile": {"dram": 0}}), ctx())[0] == "unknown"


def test_retired_pages(gpu):
    severity, message = retired_pages(gpu(retired_pages_pending=True), ctx())
    assert severity == "warn" and "retired pages are pending" in message
    assert retired_pages(gpu(), ctx()) is None
    assert retired_pages(gpu(unsupported=["retired_pages_pending"]), ctx()) is None


def test_row_remap(gpu):
    assert row_remap(gpu(remapped_rows={"correctable": 2, "uncorrectable": 1}), ctx()) == (
        "ok", "3 rows remapped, none pending")
    severity, message = row_remap(gpu(remapped_rows={"uncorrectable": 9, "failure": True}),
                                  ctx())
    assert severity == "fatal" and "9 rows remapped" in message and "RMA" in message
    severity, message = row_remap(gpu(remapped_rows={"uncorrectable": 1, "pending": True}),
                                  ctx())
    assert severity == "warn" and "reset the GPU" in message
    # page retirement only (before Ampere): that check speaks; neither: unknown
    assert row_remap(gpu(unsupported=["remapped_rows"]), ctx()) is None
    severity, message = row_remap(
        gpu(unsupported=["remapped_rows", "retired_pages_pending"]), ctx())
    assert severity == "unknown" and "row remapping or page retirement" in message


@pytest.mark.parametrize("xids,severity,words", [
    ((), "ok", "no critical XIDs"),
    ((79,), "fatal", "critical XID 79 reported (GPU has fallen off the bus)"),
    ((94, 79, 48), "fatal", "critical XID 48, 79 reported (double-bit ECC error)"),
    ((94, 63), "warn", "XID 63, 94 reported (row remapping/page retirement recorded)"),
    ((13, 31, 43), "ok", "no critical XIDs")])
def test_xid(gpu, xids, severity, words):
    got_severity, message = xid(gpu(), ctx(xids))
    assert got_severity == severity and words in message


def test_xid_follows_the_configured_policy(gpu):
    assert xid(gpu(), ctx([79], xid_fatal="48", xid_warn="79"))[0] == "warn"
    severity, message = xid(gpu(), ctx([150], xid_fatal="150"))
    assert severity == "fatal" and "see NVIDIA's XID catalog" in message


def test_pcie_link(gpu):
    narrow = gpu(pcie={"gen": 5, "width": 8, "max_gen": 5, "max_width": 16})
    severity, message = pcie_link(narrow, ctx())
    assert severity == "warn" and "PCIe link at x8, the device supports x16 (gen 5 of 5)" in message
    assert pcie_link(narrow, ctx(pcie_degraded="fatal"))[0] == "fatal"
    idle = gpu(pcie={"gen": 1, "width": 16, "max_gen": 5, "max_width": 16})
    assert pcie_link(idle, ctx()) == ("ok", "PCIe x16 gen 1")  # a power-saving downshift
    assert pcie_link(gpu(unsupported=["pcie"]), ctx())[0] == "unknown"


def test_throttle(gpu):
    severity, message = throttle(gpu(throttle=["hw_thermal", "sw_power_cap"], temperature_c=91),
                                 ctx())
    assert severity == "warn" and message.startswith("clocks slowed by hw_thermal at 91 C: ")
    assert throttle(gpu(throttle=["sw_power_cap", "gpu_idle"]), ctx()) == (
        "ok", "no hardware or thermal slowdown")  # a power cap under load is normal
    severity, message = throttle(gpu(throttle=["hw_slowdown", "hw_power_brake"],
                                     unsupported=["temperature_c"]), ctx())
    assert message.startswith("clocks slowed by hw_slowdown, hw_power_brake: ")
    assert throttle(gpu(unsupported=["throttle"]), ctx())[0] == "unknown"


def test_temperature(gpu):
    assert temperature(gpu(), ctx()) == ("ok", "41 C")
    assert temperature(gpu(temperature_c=87), ctx()) == (
        "warn", "87 C, at or above 87.0 C: check the node's cooling")
    assert temperature(gpu(temperature_c=80), ctx(max_temperature_c=80))[0] == "warn"
    assert temperature(gpu(unsupported=["temperature_c"]), ctx())[0] == "unknown"


def _links(n=4, **changed):
    links = [{"active": True, "replay": 0, "recovery": 0, "crc_flit": 0} for _ in range(n)]
    for i, fields in changed.items():
        links[int(i[1:])].update(fields)
    return links


def test_nvlink(gpu):
    assert nvlink(gpu(nvlink=_links()), ctx()) == ("ok", "4 NVLink link(s) active")
    severity, message = nvlink(gpu(nvlink=_links(l3={"active": False})), ctx())
    assert severity == "fatal" and "NVLink link(s) [3] down" in message
    noisy = gpu(nvlink=_links(l2={"replay": 101}))
    assert nvlink(noisy, ctx())[0] == "warn" and "[2] over 100" in nvlink(noisy, ctx())[1]
    assert nvlink(noisy, ctx(nvlink_error_threshold=101))[0] == "ok"


def test_nvlink_ports_never_seen_active_are_no_fault(gpu):
    """A PCIe card without a bridge reports every port inactive; a GPU without NVLink, none."""
    inactive = gpu(nvlink=[{"active": False} for _ in range(4)])
    assert nvlink(inactive, ctx(seen=())) == (
        "ok", "no NVLink link active of 4 (no bridge or fabric in use)")
    assert nvlink(inactive, ctx(seen={0}))[0] == "fatal"  # once one was, down is a fault
    assert nvlink(gpu(nvlink=[]), ctx())[1] == "no NVLink links reported (a PCIe-only GPU)"
    assert nvlink(gpu(unsupported=["nvlink"]), ctx())[0] == "ok"


def test_stray_processes(gpu):
    assert stray_processes(gpu(), ctx()) == ("ok", "no other processes on the GPU")
    mine = gpu(processes=[{"pid": os.getpid(), "used_memory_mib": 500}])
    assert stray_processes(mine, ctx())[0] == "ok"
    stray = gpu(processes=[{"pid": 4242, "used_memory_mib": 900}])
    severity, message = stray_processes(stray, ctx())
    assert severity == "fatal" and "pid 4242 (900 MiB)" in message
    assert stray_processes(stray, ctx(stray_processes="warn"))[0] == "warn"
    severity, message = stray_processes(stray, ctx(visible=lambda pid: False))
    assert severity == "unknown" and "pid 4242 (900 MiB) in another PID namespace" in message
    assert stray_processes(gpu(unsupported=["processes"]), ctx())[0] == "unknown"


@pytest.mark.parametrize("action", ["gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset"])
def test_recovery_action(gpu, action):
    severity, message = recovery_action(gpu(recovery_action=action), ctx())
    assert severity == "fatal" and f"recovery action {action}: drain the node" in message


def test_no_recovery_action_or_none_reported(gpu):
    assert recovery_action(gpu(), ctx()) == ("ok", "the driver asks for no recovery")
    severity, message = recovery_action(gpu(unsupported=["recovery_action"]), ctx())
    assert severity == "unknown" and "driver 550+" in message and "not checked" in message


def test_pid_visible_looks_in_this_pid_namespace():
    assert pid_visible(os.getpid()) and pid_visible(os.getppid())
    assert not pid_visible(2**22 + 1)  # above the kernel's largest pid_max
