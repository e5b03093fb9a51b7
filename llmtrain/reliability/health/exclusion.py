"""The run's exclusion record, ``<run_dir>/excluded_hosts.json``: nodes kept out of the
job (by the preflight gate or by a rank's health monitor) and why, until a person removes
them once the node is repaired."""

from __future__ import annotations

import json
import random
import time

import fsspec

from llmtrain.fsio import join, write_atomic

EXCLUDED_HOSTS = "excluded_hosts.json"


def excluded_hosts(run_dir: str) -> dict[str, dict]:
    """The run's ``excluded_hosts.json``: host -> why and when it was taken out."""
    try:
        with fsspec.open(join(run_dir, EXCLUDED_HOSTS), "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def exclude_host(run_dir: str, host: str, reason: str, **details) -> None:
    """Adds ``host`` to the run's exclusion list, so no launch path lets it back in.

    Several nodes may fail at once: each rewrites the whole file atomically, then reads it
    back and tries again if another writer's version replaced its entry.
    """
    for _ in range(10):
        hosts = excluded_hosts(run_dir)
        hosts[host] = {"reason": reason, "time": time.time(), **details}
        write_atomic(join(run_dir, EXCLUDED_HOSTS), json.dumps(hosts, indent=2).encode())
        time.sleep(random.uniform(0.05, 0.2))
        if host in excluded_hosts(run_dir):
            return
    raise OSError(f"could not record {host} in {join(run_dir, EXCLUDED_HOSTS)}")
