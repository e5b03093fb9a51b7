"""A chaos node's scripted GPU: the state its NVML stand-in (``LLMTRAIN_NVML_SCRIPT``)
reports, healthy or failed."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_gpu_script(path: Path, healthy: bool) -> None:
    """Writes one scripted GPU's state for a node's NVML stand-in (``LLMTRAIN_NVML_SCRIPT``),
    atomically: healthy, or with uncorrectable ECC errors (the node must leave)."""
    gpu = {"name": "scripted GPU", "uuid": "GPU-chaos", "pci_bus_id": "00000000:18:00.0",
           "ecc": {"volatile": {"dram": 0 if healthy else 2, "sram": 0},
                   "aggregate": {"dram": 0, "sram": 0}},
           "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False,
                             "failure": False},
           "pcie": {"gen": 5, "width": 16, "max_gen": 5, "max_width": 16},
           "temperature_c": 40, "power_w": 100, "throttle": [], "processes": [],
           "recovery_action": "none"}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": [gpu]}))
    os.replace(tmp, path)
