"""A scripted stand-in for the NVML library, for machines without GPUs.

It answers the same ``pynvml`` calls the health checks make, with the same return shapes
and the same ``NVMLError`` subclasses, from device states in a JSON or TOML file. The
health code receives this object where it would receive the ``pynvml`` module, so the
code path the tests drive is the one a real GPU node runs.

The file is re-read whenever it changes, so a test (or a chaos run) turns a GPU bad mid-run
by rewriting it. Its shape::

    {"driver_version": "550.90.07",
     "gpus": [{"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-...", "pci_bus_id": "...",
               "ecc": {"volatile": {"dram": 0, "sram": 0}, "aggregate": {"dram": 0, "sram": 0}},
               "retired_pages_pending": false,
               "remapped_rows": {"correctable": 0, "uncorrectable": 0,
                                 "pending": false, "failure": false},
               "pcie": {"gen": 5, "width": 16, "max_gen": 5, "max_width": 16},
               "temperature_c": 40, "power_w": 120, "throttle": ["sw_power_cap"],
               "nvlink": [{"active": true, "replay": 0, "recovery": 0, "crc_flit": 0}],
               "processes": [{"pid": 1234, "used_memory_mib": 600}],
               "recovery_action": "none",
               "lost": false,
               "unsupported": ["remapped_rows"]}],
     "xid_events": [{"gpu": 0, "xid": 79}],
     "kernel_log": ["[Fri Nov 20 10:00:00 2026] NVRM: Xid (PCI:0000:18:00): 79, ..."],
     "hosts": {"node-b": {"gpus": [...]}}}

A field left out of a GPU's state, or named in ``unsupported``, raises NotSupported, as a
driver that lacks it would. ``lost: true`` makes every call on that GPU raise GpuIsLost
(XID 79, "fallen off the bus"). ``hosts`` overrides the top level for one host name.
XID events are delivered once each through the event-set calls.
"""

from __future__ import annotations

import json
import os
import socket
from types import SimpleNamespace

import pynvml
import tomllib

from llmtrain.reliability.health.nvml import RECOVERY_ACTIONS, THROTTLE_BITS

_NVLINK_COUNTERS = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
                    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
                    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit"}


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml turns the code into its subclass


class _Handle:
    """A device handle. pynvml's is a ctypes pointer, which cannot be hashed or used as
    an index: callers must ask ``nvmlDeviceGetIndex``, and so must the code under test."""
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, index: int):
        self.index = index


class ScriptedNVML:
    """The subset of the ``pynvml`` module the health checks use, replaying a script."""

    NVMLError = pynvml.NVMLError

    def __init__(self, path: str, host: str | None = None):
        self.path = path
        self.host = host or socket.gethostname()
        self._mtime: float | None = None
        self._state: dict = {}
        self._delivered = 0  # XID events already handed out

    def __getattr__(self, name: str):
        """Constants (NVML_*, nvmlClocks*) come from the real module."""
        if name.startswith(("NVML_", "nvmlClocks", "nvmlEventType")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # -- the script -----------------------------------------------------------------------

    def _load(self) -> dict:
        mtime = os.stat(self.path).st_mtime
        if mtime != self._mtime:
            with open(self.path, "rb") as f:
                raw = f.read()
            state = tomllib.loads(raw.decode()) if self.path.endswith(".toml") else json.loads(raw)
            self._state = {**state, **state.get("hosts", {}).get(self.host, {})}
            self._mtime = mtime
        return self._state

    def _gpu(self, handle: _Handle) -> dict:
        gpus = self._load().get("gpus", [])
        if handle.index >= len(gpus) or gpus[handle.index].get("lost"):
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpus[handle.index]

    def _field(self, handle: _Handle, key: str):
        gpu = self._gpu(handle)
        if key not in gpu or key in gpu.get("unsupported", ()):
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu[key]

    def kernel_log(self) -> list[str]:
        return list(self._load().get("kernel_log", []))

    # -- pynvml calls ---------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._load()

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._load().get("driver_version", "scripted")

    def nvmlDeviceGetCount(self) -> int:
        return len(self._load().get("gpus", []))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        handle = _Handle(index)
        self._gpu(handle)
        return handle

    def nvmlDeviceGetIndex(self, h: _Handle) -> int:
        return h.index

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        return self._gpu(h).get("name", "scripted GPU")

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        return self._gpu(h).get("uuid", f"GPU-scripted-{h.index}")

    def nvmlDeviceGetPciInfo(self, h: _Handle):
        return SimpleNamespace(busId=self._gpu(h).get("pci_bus_id", f"00000000:{h.index:02x}:00.0"))

    def nvmlDeviceGetTotalEccErrors(self, h: _Handle, error_type: int, counter_type: int) -> int:
        scope = self._ecc_scope(h, error_type, counter_type)
        return sum(scope.values())

    def nvmlDeviceGetMemoryErrorCounter(self, h: _Handle, error_type: int, counter_type: int,
                                        location: int) -> int:
        scope = self._ecc_scope(h, error_type, counter_type)
        key = {pynvml.NVML_MEMORY_LOCATION_DRAM: "dram",
               pynvml.NVML_MEMORY_LOCATION_SRAM: "sram"}.get(location)
        if key not in scope:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return scope[key]

    def _ecc_scope(self, h: _Handle, error_type: int, counter_type: int) -> dict:
        if error_type != pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # only uncorrectable is scripted
        scope = "volatile" if counter_type == pynvml.NVML_VOLATILE_ECC else "aggregate"
        ecc = self._field(h, "ecc")
        if scope not in ecc:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return ecc[scope]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: _Handle) -> int:
        pending = self._field(h, "retired_pages_pending")
        return pynvml.NVML_FEATURE_ENABLED if pending else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, h: _Handle) -> tuple[int, int, int, int]:
        r = self._field(h, "remapped_rows")
        return (r.get("correctable", 0), r.get("uncorrectable", 0), int(r.get("pending", False)),
                int(r.get("failure", False)))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: _Handle) -> int:
        return self._field(h, "pcie")["gen"]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: _Handle) -> int:
        return self._field(h, "pcie")["width"]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: _Handle) -> int:
        return self._field(h, "pcie")["max_gen"]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: _Handle) -> int:
        return self._field(h, "pcie")["max_width"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: _Handle) -> int:
        mask = 0
        for reason in self._field(h, "throttle"):
            mask |= THROTTLE_BITS[reason]
        return mask

    def nvmlDeviceGetTemperature(self, h: _Handle, sensor: int) -> int:
        return self._field(h, "temperature_c")

    def nvmlDeviceGetPowerUsage(self, h: _Handle) -> int:
        return int(self._field(h, "power_w") * 1000)  # milliwatts, as NVML reports

    def nvmlDeviceGetNvLinkState(self, h: _Handle, link: int) -> int:
        links = self._field(h, "nvlink")
        if link >= len(links):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if links[link].get("active", True) else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, h: _Handle, link: int, counter: int) -> int:
        return self._field(h, "nvlink")[link].get(_NVLINK_COUNTERS[counter], 0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> list:
        return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p.get("used_memory_mib", 0) * 2**20)
                for p in self._field(h, "processes")]

    def nvmlDeviceGetFieldValues(self, h: _Handle, field_ids: list[int]) -> list:
        values = []
        for fid in field_ids:
            value = SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED,
                                    value=SimpleNamespace(uiVal=0))
            if fid == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                try:
                    action = RECOVERY_ACTIONS[self._field(h, "recovery_action")]
                    value = SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS,
                                            value=SimpleNamespace(uiVal=action))
                except pynvml.NVMLError_NotSupported:
                    pass
            values.append(value)
        return values

    def nvmlEventSetCreate(self) -> list:
        return []

    def nvmlDeviceRegisterEvents(self, h: _Handle, event_types: int, event_set: list) -> None:
        if "xid_events" in self._gpu(h).get("unsupported", ()):  # MIG, vGPU, some drivers
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.append(h.index)

    def nvmlEventSetWait_v2(self, event_set: list, timeout_ms: int):
        events = self._load().get("xid_events", [])
        while self._delivered < len(events):
            e = events[self._delivered]
            self._delivered += 1
            if e["gpu"] in event_set:
                return SimpleNamespace(device=_Handle(e["gpu"]), eventData=e["xid"],
                                       eventType=pynvml.nvmlEventTypeXidCriticalError,
                                       timeStamp=0)
        raise _error(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: list) -> None:
        event_set.clear()
