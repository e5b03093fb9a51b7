"""A chaos node's scripted GPU: the state its NVML stand-in (``LLMTRAIN_NVML_SCRIPT``)
reports, healthy or failed."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_gpu_script(path: Path, healthy: bool, count: int = 1, bad: int = 0) -> None:
    """Writes a node's scripted GPUs (``count``, one per local rank) for its NVML stand-in
    (``LLMTRAIN_NVML_SCRIPT``), atomically: healthy, or GPU ``bad`` with uncorrectable ECC
    errors (the node must leave)."""
    gpus = [{"name": "scripted GPU", "uuid": f"GPU-chaos-{i}",
             "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0",
             "ecc": {"volatile": {"dram": 0 if healthy or i != bad else 2, "sram": 0},
                     "aggregate": {"dram": 0, "sram": 0}},
             "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False,
                               "failure": False},
             "pcie": {"gen": 5, "width": 16, "max_gen": 5, "max_width": 16},
             "temperature_c": 40, "power_w": 100, "throttle": [], "processes": [],
             "recovery_action": "none"} for i in range(count)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    os.replace(tmp, path)
