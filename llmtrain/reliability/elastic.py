"""How a run ends, as the launcher must read it.

=====  ===============  ==================================================================
code   name             what the launcher does
=====  ===============  ==================================================================
0      CLEAN            nothing: the run finished
75     RETRYABLE        restart the workers, on the same nodes or on a spare
76     EXCLUDE_NODE     take this node out of the job, then restart on the others/spares
78     FATAL            stop: bad configuration or data; a restart would fail the same way
=====  ===============  ==================================================================

75 and 78 are the BSD sysexits EX_TEMPFAIL and EX_CONFIG. Any other non-zero code (an
uncaught exception gives 1, a signal gives 128+N) counts as RETRYABLE.
"""

from __future__ import annotations

import enum
import json
import random
import time

import fsspec

from llmtrain.fsio import join, write_atomic

EXCLUDED_HOSTS = "excluded_hosts.json"


class ExitCode(enum.IntEnum):
    CLEAN = 0
    RETRYABLE = 75
    EXCLUDE_NODE = 76
    FATAL = 78


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
