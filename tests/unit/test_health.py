"""Every health check, driven through the scripted NVML backend with realistic states."""

import copy
import json
import os
from datetime import datetime, timezone

import pytest

from logs import logged
from nvml_states import node, write_script
from llmtrain.cli import main
from llmtrain.config import ConfigError, HealthConfig
from llmtrain.events import read_events
from llmtrain.exit_codes import ExitCode
from llmtrain.reliability.health.checks import Backend, HealthChecker, open_backend, worst
from llmtrain.reliability.health.exclusion import excluded_hosts
from llmtrain.reliability.health.monitor import HealthMonitor
from llmtrain.reliability.health.nvml_scripted import ScriptedNVML

HOST = "node-a"


def check(tmp_path, state, pid_visible=lambda pid: True, **cfg) -> list:
    script = write_script(tmp_path / "gpus.json", state)
    checker = HealthChecker(HealthConfig(**cfg), Backend(ScriptedNVML(script, HOST), "scripted"),
                            host=HOST, pid_visible=pid_visible)
    findings, _ = checker.gpus()
    return findings


def only(findings, check, gpu=1):
    (f,) = [f for f in findings if f.check == check and f.gpu == gpu]
    return f


def test_healthy_node_is_all_ok(tmp_path):
    findings = check(tmp_path, node(), expected_gpus=2)
    assert worst(findings) == "ok", [f.sentence() for f in findings if f.severity != "ok"]
    checks = {f.check for f in findings}
    assert {"gpu_count", "ecc_volatile", "ecc_aggregate", "row_remap", "xid", "pcie_link",
            "throttle", "temperature", "nvlink", "stray_processes", "recovery_action"} <= checks


def test_gpu_missing_from_the_bus(tmp_path):
    state = node(2)
    state["gpus"].pop()  # NVML enumerates one GPU fewer
    f = only(check(tmp_path, state, expected_gpus=2), "gpu_count", gpu=None)
    assert f.severity == "fatal"
    assert "1 GPU(s) visible to NVML, 2 expected" in f.message and "XID 79" in f.message


def test_gpu_lost_mid_flight_names_the_gpu(tmp_path):
    state = node(2)
    state["gpus"][1]["lost"] = True  # every call on it raises GpuIsLost
    f = only(check(tmp_path, state), "gpu_lost")
    assert f.severity == "fatal" and "GPU 1" in f.message and "fallen off the bus" in f.message
    assert f.host == HOST


def test_xid_79_in_the_kernel_log_is_fatal_for_that_gpu_only(tmp_path):
    stamp = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace(".", ",")
    old = "2020-01-01T00:00:00,000000+00:00"
    state = node(2, kernel_log=[
        f"{stamp} NVRM: Xid (PCI:0000:19:00): 79, pid=4242, name=python, GPU has fallen off the bus.",
        f"{old} NVRM: Xid (PCI:0000:18:00): 48, pid=1, name=python, DBE (too old to count)",
        f"{stamp} NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception (an application bug)"])
    findings = check(tmp_path, state)
    f = only(findings, "xid", gpu=1)
    assert f.severity == "fatal" and "79" in f.message and "fallen off the bus" in f.message
    assert f.uuid.startswith("GPU-00000001") and f.pci_bus_id == "00000000:19:00.0"
    assert "GPU 1 (GPU-00000001" in f.sentence() and "node-a" in f.sentence()
    assert only(findings, "xid", gpu=0).severity == "ok"


@pytest.mark.parametrize("xid,severity", [(48, "fatal"), (64, "fatal"), (74, "fatal"),
                                          (95, "fatal"), (63, "warn"), (92, "warn"),
                                          (94, "warn"), (31, "ok")])
def test_xid_severity_policy(tmp_path, xid, severity):
    state = node(2, kernel_log=[f"NVRM: Xid (PCI:0000:19:00): {xid}, pid=1, name=x"])
    assert only(check(tmp_path, state), "xid").severity == severity


def test_volatile_uncorrectable_ecc_is_fatal_and_split_by_location(tmp_path):
    state = node(2)
    state["gpus"][1]["ecc"]["volatile"] = {"dram": 2, "sram": 0}
    f = only(check(tmp_path, state), "ecc_volatile")
    assert f.severity == "fatal"
    assert "2 uncorrectable ECC error(s)" in f.message and "DRAM 2, SRAM 0" in f.message


def test_lifetime_sram_error_is_fatal_dram_only_warns(tmp_path):
    state = node(2)
    state["gpus"][1]["ecc"]["aggregate"] = {"dram": 0, "sram": 1}
    assert only(check(tmp_path, state), "ecc_aggregate").severity == "fatal"
    state["gpus"][1]["ecc"]["aggregate"] = {"dram": 3, "sram": 0}
    f = only(check(tmp_path, state), "ecc_aggregate")
    assert f.severity == "warn" and "3 uncorrectable" in f.message


def test_row_remap_failure_is_fatal_pending_warns(tmp_path):
    state = node(2)
    state["gpus"][1]["remapped_rows"] = {"correctable": 0, "uncorrectable": 9, "pending": False,
                                         "failure": True}
    f = only(check(tmp_path, state), "row_remap")
    assert f.severity == "fatal" and "RMA" in f.message
    state["gpus"][1]["remapped_rows"] = {"correctable": 0, "uncorrectable": 1, "pending": True,
                                         "failure": False}
    f = only(check(tmp_path, state), "row_remap")
    assert f.severity == "warn" and "reset the GPU" in f.message


def test_pcie_x8_on_an_x16_device(tmp_path):
    state = node(2)
    state["gpus"][1]["pcie"] = {"gen": 5, "width": 8, "max_gen": 5, "max_width": 16}
    f = only(check(tmp_path, state), "pcie_link")
    assert f.severity == "warn" and "x8" in f.message and "x16" in f.message
    assert only(check(tmp_path, state, pcie_degraded="fatal"), "pcie_link").severity == "fatal"
    state["gpus"][1]["pcie"] = {"gen": 1, "width": 16, "max_gen": 5, "max_width": 16}
    assert only(check(tmp_path, state), "pcie_link").severity == "ok"  # idle gen downshift


def test_thermal_slowdown(tmp_path):
    state = node(2)
    state["gpus"][1].update(throttle=["hw_thermal", "sw_power_cap"], temperature_c=91)
    findings = check(tmp_path, state)
    f = only(findings, "throttle")
    assert f.severity == "warn" and "hw_thermal" in f.message and "91 C" in f.message
    assert "sw_power_cap" not in f.message  # a power cap under load is normal
    assert only(findings, "temperature").severity == "warn"


def test_unsupported_fields_are_unknown_never_healthy(tmp_path):
    state = node(2)
    state["gpus"][1]["unsupported"] = ["ecc", "remapped_rows", "retired_pages_pending",
                                       "throttle", "pcie", "recovery_action"]
    del state["gpus"][1]["processes"]
    findings = check(tmp_path, state)
    for name in ("ecc_volatile", "ecc_aggregate", "row_remap", "throttle", "pcie_link",
                 "recovery_action", "stray_processes"):
        f = only(findings, name)
        assert f.severity == "unknown" and "not checked" in f.message, f


def test_nvlink_down_and_noisy(tmp_path):
    state = node(2)
    state["gpus"][1]["nvlink"][3]["active"] = False
    f = only(check(tmp_path, state), "nvlink")
    assert f.severity == "fatal" and "[3]" in f.message
    state["gpus"][1]["nvlink"][3] = {"active": True, "replay": 5000, "recovery": 0, "crc_flit": 0}
    assert only(check(tmp_path, state), "nvlink").severity == "warn"


def test_nvlink_ports_never_active_are_no_fault_until_one_was(tmp_path):
    """A PCIe card without a bridge reports every NVLink port inactive: not a fault. Once
    a link has been seen active, its going down is one, even with every link down."""
    state = node(2)
    state["gpus"][1]["nvlink"] = [{"active": False, "replay": 0, "recovery": 0, "crc_flit": 0}
                                  for _ in range(4)]
    script = write_script(tmp_path / "gpus.json", state)
    checker = HealthChecker(HealthConfig(), Backend(ScriptedNVML(script, HOST), "scripted"),
                            host=HOST, pid_visible=lambda pid: True)
    f = only(checker.gpus()[0], "nvlink")
    assert f.severity == "ok" and "no NVLink link active" in f.message
    for active in (True, False):
        for link in state["gpus"][1]["nvlink"]:
            link["active"] = active
        write_script(tmp_path / "gpus.json", state)
        f = only(checker.gpus()[0], "nvlink")
    assert f.severity == "fatal" and "[0, 1, 2, 3] down" in f.message, f


def test_stray_process_and_recovery_action(tmp_path):
    state = node(2)
    state["gpus"][1]["processes"] = [{"pid": 4242, "used_memory_mib": 900}]
    state["gpus"][1]["recovery_action"] = "drain_and_reset"
    findings = check(tmp_path, state)
    f = only(findings, "stray_processes")
    assert f.severity == "fatal" and "pid 4242 (900 MiB)" in f.message
    f = only(findings, "recovery_action")
    assert f.severity == "fatal" and "drain_and_reset" in f.message


def test_processes_of_another_pid_namespace_are_not_strays(tmp_path):
    """In a container, NVML's PIDs are the host's: absent from this namespace's /proc."""
    state = node(2)
    state["gpus"][1]["processes"] = [{"pid": 4242, "used_memory_mib": 900},
                                     {"pid": os.getpid(), "used_memory_mib": 500}]
    f = only(check(tmp_path, state, pid_visible=lambda pid: False), "stray_processes")
    assert f.severity == "unknown" and "another PID namespace" in f.message
    assert "pid 4242 (900 MiB)" in f.message and f"pid {os.getpid()}" not in f.message
    state["gpus"][1]["processes"].append({"pid": 7, "used_memory_mib": 100})
    f = only(check(tmp_path, state, pid_visible=lambda pid: pid == 7), "stray_processes")
    assert f.severity == "fatal" and "pid 7 (100 MiB)" in f.message
    assert "pid 4242 (900 MiB) in another PID namespace" in f.message


def test_cpu_mode_reports_no_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMTRAIN_NVML_SCRIPT", raising=False)
    assert open_backend(HealthConfig()) is None  # no NVML library on this machine
    findings, values = HealthChecker(HealthConfig(), None, host=HOST).gpus()
    assert [(f.check, f.severity) for f in findings] == [("gpus", "ok")]
    assert "no GPUs" in findings[0].message and values == {}


def test_bad_backend_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="health.script"):
        open_backend(HealthConfig(backend="scripted"))
    with pytest.raises(ConfigError, match="does not exist"):
        open_backend(HealthConfig(script=str(tmp_path / "nope.json")))


def test_node_checks_storage_and_shm(tmp_path):
    blocked = tmp_path / "ro"
    blocked.write_text("a file where a directory should be")
    checker = HealthChecker(HealthConfig(min_shm_gb=1e6), None, host=HOST,
                            storage={"run_storage": str(tmp_path / "ok"),
                                     "checkpoint_storage": str(blocked / "ckpt")})
    findings = {f.check: f for f in checker.node()}
    assert findings["run_storage"].severity == "ok"
    # writable where the run would create it, and left uncreated: a check from any
    # directory leaves no run dir behind
    assert not (tmp_path / "ok").exists() and not list(tmp_path.glob(".llmtrain-health*"))
    assert findings["checkpoint_storage"].severity == "fatal"
    assert "not writable" in findings["checkpoint_storage"].message
    assert findings["shm"].severity == "fatal" and "--shm-size" in findings["shm"].message
    assert findings["clock"].severity in ("ok", "warn", "unknown")


def test_site_plugin_checks(tmp_path, monkeypatch):
    (tmp_path / "site_checks.py").write_text(
        "from llmtrain.reliability.health import Finding\n"
        "def ib(cfg, host):\n"
        "    return [Finding('infiniband', 'fatal', 'mlx5_0 port down', host)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    findings = HealthChecker(HealthConfig(plugins="site_checks:ib"), None, host=HOST).node()
    assert any(f.check == "infiniband" and f.severity == "fatal" for f in findings)
    with pytest.raises(ConfigError, match="module:function"):
        HealthChecker(HealthConfig(plugins="site_checks:nope"), None)


def gate(tmp_path, state, *extra) -> int:
    script = write_script(tmp_path / "gpus.json", state)
    return main(["health", "--gate", "--host", HOST, "--training.run_dir", str(tmp_path / "run"),
                 "--health.script", script, "--health.expected_gpus", "2", *extra])


def test_gate_passes_a_healthy_node(tmp_path, capsys):
    assert gate(tmp_path, node(2)) == ExitCode.CLEAN
    assert excluded_hosts(str(tmp_path / "run")) == {}


def test_gate_excludes_a_bad_node_and_keeps_it_out(tmp_path, capsys):
    state = node(2)
    state["gpus"][1]["ecc"]["volatile"]["dram"] = 1
    assert gate(tmp_path, state) == ExitCode.EXCLUDE_NODE
    record = excluded_hosts(str(tmp_path / "run"))[HOST]
    assert "ecc_volatile" in record["reason"] and "GPU 1" in record["reason"]
    assert record["findings"][0]["uuid"].startswith("GPU-00000001")
    (event,) = read_events(str(tmp_path / "run"), "node_excluded")
    assert event["host"] == HOST and event["source"] == "gate"
    # repaired hardware is not enough: the exclusion stands until a person lifts it
    assert gate(tmp_path, node(2)) == ExitCode.EXCLUDE_NODE
    assert "excluded from this run earlier" in capsys.readouterr().err


def test_health_cli_json_and_exit_by_worst(tmp_path, capsys):
    state = node(2)
    state["gpus"][0]["pcie"]["width"] = 8
    script = write_script(tmp_path / "gpus.json", state)
    rc = main(["health", "--json", "--training.run_dir", str(tmp_path / "run"),
               "--health.script", script, "--health.expected_gpus", "2"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["worst"] == "warn" and out["backend"] == "scripted"
    assert out["readings"]["0"]["pcie_width"] == 8 and out["readings"]["0"]["power_w"] == 113.5


class _Events:
    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": event, **fields})


def test_monitor_sees_an_xid_event_and_reports_changes_once(tmp_path):
    path = tmp_path / "gpus.json"
    state = node(2)
    write_script(path, state)
    events, passes = _Events(), []
    checker = HealthChecker(HealthConfig(), Backend(ScriptedNVML(str(path), HOST), "scripted"),
                            host=HOST)
    monitor = HealthMonitor(checker, [1], interval_s=3600, node_checks=False, events=events,
                            on_pass=lambda f, v: passes.append(v))
    monitor.start()
    try:
        assert monitor.fatal_finding() is None and events.records == []
        bad = copy.deepcopy(state)
        bad["xid_events"] = [{"gpu": 0, "xid": 79}, {"gpu": 1, "xid": 79}]
        write_script(path, bad)
        monitor.check()
        monitor.check()  # the same state again: no second event
        assert monitor.fatal_finding() is not None and monitor.fatal_finding().check == "xid"
        assert monitor.fatal_finding().gpu == 1 and "79" in monitor.fatal_finding().message
        assert [r["check"] for r in events.records] == ["xid"]  # GPU 0 is not this rank's
        assert passes[-1][1]["temperature_c"] == 41
    finally:
        monitor.close()


def test_the_monitor_tells_of_a_gpu_failing_mid_run_at_once_and_once(tmp_path):
    """A GPU that fails while the job trains is told to ``on_fatal`` on the monitor's own
    thread within one polling interval (no step end, no vote awaited), once however many
    passes see it; one already failed at the first pass is left to the training loop."""
    import threading
    import time
    path = tmp_path / "gpus.json"
    state = node(2)
    write_script(path, state)
    told, seen = [], threading.Event()
    checker = HealthChecker(HealthConfig(), Backend(ScriptedNVML(str(path), HOST), "scripted"),
                            host=HOST)

    def on_fatal(finding):
        told.append((finding, threading.current_thread().name))
        seen.set()

    monitor = HealthMonitor(checker, [1], interval_s=0.05, node_checks=False,
                            events=_Events(), on_fatal=on_fatal)
    monitor.start()
    try:
        time.sleep(0.2)
        assert told == []
        bad = copy.deepcopy(state)
        bad["gpus"][1]["ecc"]["volatile"]["dram"] = 2
        write_script(path, bad)
        assert seen.wait(5), "no word of the failed GPU"
        time.sleep(0.2)  # more passes see it: still told once
        ((finding, thread),) = told
        assert finding.gpu == 1 and finding.severity == "fatal" and thread == "llmtrain-health"
    finally:
        monitor.close()
    told.clear()
    early = HealthMonitor(checker, [1], interval_s=0.05, node_checks=False, events=_Events(),
                          on_fatal=on_fatal)
    early.start()  # the first pass finds it: the loop's first step end acts on it
    try:
        time.sleep(0.2)
        assert early.fatal_finding() is not None and told == []
    finally:
        early.close()


def test_monitor_without_xid_events_reads_the_kernel_log(tmp_path):
    """Under MIG or vGPU NVML refuses event registration: the monitor starts anyway and
    reads XIDs from the kernel log at each pass."""
    path = tmp_path / "gpus.json"
    state = node(2)
    state["gpus"][1]["unsupported"] = ["xid_events"]
    write_script(path, state)
    checker = HealthChecker(HealthConfig(), Backend(ScriptedNVML(str(path), HOST), "scripted"),
                            host=HOST)
    monitor = HealthMonitor(checker, [1], interval_s=3600, node_checks=False, events=_Events())
    with logged() as said:
        monitor.start()
    try:
        assert checker.event_set is None and monitor.fatal_finding() is None
        assert "XID events unavailable" in "\n".join(said), said
        state["kernel_log"] = ["NVRM: Xid (PCI:0000:19:00): 79, pid=1, name=python, "
                               "GPU has fallen off the bus."]
        write_script(path, state)
        monitor.check()
        assert monitor.fatal_finding() is not None and monitor.fatal_finding().check == "xid"
        assert monitor.fatal_finding().gpu == 1
    finally:
        monitor.close()


def test_a_process_beside_a_running_job_only_warns(tmp_path):
    """The gate keeps a node with a stray process out; the monitor of a job already
    training only warns (the H200 check found the monitor stopping training for this)."""
    path = tmp_path / "gpus.json"
    state = node(2)
    state["gpus"][1]["processes"] = [{"pid": 4242, "used_memory_mib": 900}]
    write_script(path, state)
    checker = HealthChecker(HealthConfig(), Backend(ScriptedNVML(str(path), HOST), "scripted"),
                            host=HOST,
                            pid_visible=lambda pid: True)
    assert only(checker.gpus()[0], "stray_processes").severity == "fatal"
    events = _Events()
    monitor = HealthMonitor(checker, [1], interval_s=3600, node_checks=False, events=events)
    monitor.start()
    monitor.close()
    assert monitor.fatal_finding() is None
    (f,) = [r for r in events.records if r["check"] == "stray_processes"]
    assert f["severity"] == "warn" and "pid 4242" in f["message"]
