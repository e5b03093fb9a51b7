"""Realistic device states for the scripted NVML backend, shared by the health tests."""

import json
import os


def healthy_gpu(i: int) -> dict:
    return {"name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i:08x}-1111-2222-3333-444455556666",
            "pci_bus_id": f"00000000:{0x18 + i:02x}:00.0",
            "ecc": {"volatile": {"dram": 0, "sram": 0}, "aggregate": {"dram": 0, "sram": 0}},
            "retired_pages_pending": False,
            "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False,
                              "failure": False},
            "pcie": {"gen": 5, "width": 16, "max_gen": 5, "max_width": 16},
            "temperature_c": 41, "power_w": 113.5, "throttle": ["sw_power_cap"],
            "nvlink": [{"active": True, "replay": 0, "recovery": 0, "crc_flit": 0}
                       for _ in range(18)],
            "processes": [], "recovery_action": "none"}


def node(n: int = 2, **top) -> dict:
    return {"driver_version": "550.90.07", "gpus": [healthy_gpu(i) for i in range(n)], **top}


def write_script(path, state) -> str:
    """Writes the states; bumps the mtime so that a rewrite within a second is seen."""
    path.write_text(json.dumps(state))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    return str(path)
