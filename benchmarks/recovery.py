"""How long a node's loss costs: from killing it to the first step after the restart.

Three "nodes" on this machine (``LocalCluster``: ``llmtrain launch`` agents on loopback,
an external rendezvous store), ``--nnodes 2:2`` with the third waiting as a spare. Once
training runs and a checkpoint is committed, node2 is killed whole (launcher, agent,
workers). The ``recovery`` event of the new attempt names the parts: failure detected
(a surviving rank's collective fails), new processes started (rendezvous with the spare
and spawn), process group up, checkpoint loaded, first step. The baseline, measured in
the same run, is the job's cold start: launch to its first step. Goal: under 15 s.

    python benchmarks/recovery.py [--repeats 2]

Prints a table, then one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from llmtrain.chaos.local_cluster import LocalCluster
from llmtrain.events import read_events

TRAIN = ("--config", "debug_cpu", "--training.steps", "100000",
         "--checkpoint.interval_steps", "20", "--metrics.log_every", "5",
         "--metrics.address", "127.0.0.1", "--metrics.port", "0")


def wait_for(run: Path, event: str, where=lambda e: True, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = [e for e in read_events(str(run), event) if where(e)]
        except FileNotFoundError:
            found = []
        if found:
            return found[0]
        time.sleep(0.1)
    raise TimeoutError(f"no {event} event in {run} within {timeout} s")


def one_recovery(workdir: Path) -> dict:
    run = workdir / "run"
    cluster = LocalCluster(workdir, run, "2:2", TRAIN)
    try:
        launched = time.time()
        cluster.start("node1")
        cluster.start("node2")
        first = wait_for(run, "startup", lambda e: e["rank"] == 0)
        cluster.start("node3", spare=True)
        wait_for(run, "checkpoint_committed", lambda e: e["step"] >= 40)
        time.sleep(2)  # mid-interval, with the spare waiting in the rendezvous
        killed = time.time()
        cluster.kill("node2")
        rec = wait_for(run, "recovery")
    finally:
        cluster.close()
    marks = rec["marks"]
    return {"cold_start_s": first["ts"] - launched,
            "kill_to_first_step_s": marks["first_step"] - killed,
            "detect_s": (marks["failure_detected"] or killed) - killed,
            "rendezvous_spawn_s": marks["process_start"] - (marks["failure_detected"] or killed),
            "startup_to_pg_s": marks["process_group_up"] - marks["process_start"],
            "pg_to_loaded_s": marks["checkpoint_loaded"] - marks["process_group_up"],
            "loaded_to_first_step_s": marks["first_step"] - marks["checkpoint_loaded"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="llmtrain-bench-recovery-") as d:
            runs.append(one_recovery(Path(d)))
    keys = list(runs[0])
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    print(f"{'part':<26}" + "".join(f"{f'run {i + 1}':>10}" for i in range(len(runs)))
          + f"{'median':>10}")
    for k in keys:
        print(f"{k:<26}" + "".join(f"{r[k]:>10.2f}" for r in runs) + f"{med[k]:>10.2f}")
    figures = {k: round(v, 3) for k, v in med.items()}
    figures["recovery_over_cold_start"] = round(med["kill_to_first_step_s"]
                                                / med["cold_start_s"], 3)
    figures["goal_s"] = 15
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
