"""Reading one GPU through NVML: every field the health checks need, in one dict.

``nvml`` is the ``pynvml`` module or the scripted stand-in with the same calls
(``nvml_scripted``); a field the driver or GPU does not report reads ``UNKNOWN``, which the
checks treat as "cannot tell", never as healthy.
"""

from __future__ import annotations

from typing import Any, Callable

import pynvml

UNKNOWN = object()  # an NVML field this driver or GPU does not report

# NVML's bits and codes, named as the checks, the metrics and the scripted states name them.
THROTTLE_BITS = {
    "gpu_idle": pynvml.nvmlClocksThrottleReasonGpuIdle,
    "applications_clocks": pynvml.nvmlClocksThrottleReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksThrottleReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksThrottleReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksThrottleReasonSyncBoost,
    "sw_thermal": pynvml.nvmlClocksThrottleReasonSwThermalSlowdown,
    "hw_thermal": pynvml.nvmlClocksThrottleReasonHwThermalSlowdown,
    "hw_power_brake": pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown,
}
RECOVERY_ACTIONS = {
    "none": pynvml.NVML_GPU_RECOVERY_ACTION_NONE,
    "gpu_reset": pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    "node_reboot": pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT,
    "drain_p2p": pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P,
    "drain_and_reset": pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET,
}


def _read(call: Callable, *args) -> Any:
    try:
        return call(*args)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound,
            pynvml.NVMLError_NoPermission, pynvml.NVMLError_InvalidArgument):
        return UNKNOWN


def read_gpu(nvml: Any, index: int) -> dict[str, Any]:
    """Every field the checks need, UNKNOWN where unsupported; raises GpuIsLost."""
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    s: dict[str, Any] = {"index": index, "name": _read(nvml.nvmlDeviceGetName, h),
                         "uuid": _read(nvml.nvmlDeviceGetUUID, h)}
    pci = _read(nvml.nvmlDeviceGetPciInfo, h)
    bus = UNKNOWN if pci is UNKNOWN else pci.busId
    s["pci_bus_id"] = bus.decode() if isinstance(bus, bytes) else bus
    unc = nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    for scope, counter in (("volatile", nvml.NVML_VOLATILE_ECC),
                           ("aggregate", nvml.NVML_AGGREGATE_ECC)):
        s[f"ecc_{scope}"] = _read(nvml.nvmlDeviceGetTotalEccErrors, h, unc, counter)
        for loc, location in (("dram", nvml.NVML_MEMORY_LOCATION_DRAM),
                              ("sram", nvml.NVML_MEMORY_LOCATION_SRAM)):
            s[f"ecc_{scope}_{loc}"] = _read(nvml.nvmlDeviceGetMemoryErrorCounter, h, unc,
                                            counter, location)
    pending = _read(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
    s["retired_pages_pending"] = pending if pending is UNKNOWN else bool(pending)
    s["remapped_rows"] = _read(nvml.nvmlDeviceGetRemappedRows, h)
    for key, call in (("pcie_gen", nvml.nvmlDeviceGetCurrPcieLinkGeneration),
                      ("pcie_width", nvml.nvmlDeviceGetCurrPcieLinkWidth),
                      ("pcie_max_gen", nvml.nvmlDeviceGetMaxPcieLinkGeneration),
                      ("pcie_width_max", nvml.nvmlDeviceGetMaxPcieLinkWidth)):
        s[key] = _read(call, h)
    mask = _read(nvml.nvmlDeviceGetCurrentClocksEventReasons, h)
    s["throttle"] = mask if mask is UNKNOWN else {
        reason: bool(mask & bit) for reason, bit in THROTTLE_BITS.items()}
    s["temperature_c"] = _read(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)
    power = _read(nvml.nvmlDeviceGetPowerUsage, h)
    s["power_w"] = power if power is UNKNOWN else power / 1000
    s["nvlink"] = _read_nvlink(nvml, h)
    procs = _read(nvml.nvmlDeviceGetComputeRunningProcesses, h)
    s["processes"] = procs if procs is UNKNOWN else [
        (p.pid, (p.usedGpuMemory or 0) / 2**20) for p in procs]
    action = _read(nvml.nvmlDeviceGetFieldValues, h, [nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    s["recovery_action"] = (action[0].value.uiVal if action is not UNKNOWN
                            and action[0].nvmlReturn == nvml.NVML_SUCCESS else UNKNOWN)
    return s


def _read_nvlink(nvml: Any, h: Any) -> list[dict] | Any:
    links = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        state = _read(nvml.nvmlDeviceGetNvLinkState, h, link)
        if state is UNKNOWN:
            break  # no NVLink, or no more links
        errors = {name: _read(nvml.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)
                  for name, counter in (("replay", nvml.NVML_NVLINK_ERROR_DL_REPLAY),
                                        ("recovery", nvml.NVML_NVLINK_ERROR_DL_RECOVERY),
                                        ("crc_flit", nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT))}
        links.append({"link": link, "active": state == nvml.NVML_FEATURE_ENABLED, **errors})
    return links


def readings(s: dict[str, Any]) -> dict[str, Any]:
    """The numbers worth a metric, without the UNKNOWNs."""
    keep = ("temperature_c", "power_w", "pcie_width", "pcie_width_max", "ecc_volatile",
            "ecc_aggregate", "throttle")
    return {k: s[k] for k in keep if s.get(k, UNKNOWN) is not UNKNOWN}


def recovery_name(action: int) -> str:
    return next((k for k, v in RECOVERY_ACTIONS.items() if v == action), str(action))
