"""How long a node's loss costs: from killing it to the first step after it, on the warm
path and on the cold path, in the same run.

Three "nodes" on this machine (``LocalCluster``: ``llmtrain launch`` agents on loopback,
an external rendezvous store), ``--nnodes 2:2`` with the third as a spare. Once training
runs, node2 is killed whole (launcher, agent, workers).

- **warm** (``--warm.enable true``): the spare waits warm (imported, store connected); the
  survivor keeps its process, the spare takes the lost rank, both restore the snapshot of
  the last step from memory (the lost rank's from its buddy's replica). Parts from the
  ``warm_recovery`` event: detected, agreed (who is lost, which spare, which step),
  group formed, restored, first step.
- **cold** (today's default): torchrun restarts every worker; the spare joins the
  rendezvous; the new processes load the newest checkpoint. Parts from the ``recovery``
  event.

Goal (the warm-recovery issue): warm <= 2.0 s median, warm / cold <= 0.2.

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


def one_recovery(workdir: Path, warm: bool) -> dict:
    run = workdir / "run"
    cluster = LocalCluster(workdir, run, "2:2",
                           TRAIN + (("--warm.enable", "true") if warm else ()))
    try:
        cluster.start("node1")
        cluster.start("node2")
        if warm:
            cluster.start("node3", spare=True)
        wait_for(run, "checkpoint_committed", lambda e: e["step"] >= 40)
        if not warm:
            cluster.start("node3", spare=True)
        time.sleep(2)  # mid-interval, with the spare waiting
        killed = time.time()
        cluster.kill("node2")
        rec = wait_for(run, "warm_recovery" if warm else "recovery")
    finally:
        cluster.close()
    marks = rec["marks"]
    detected = marks["failure_detected"] or killed
    if warm:
        return {"kill_to_first_step_s": marks["first_step"] - killed,
                "detect_s": detected - killed,
                "agree_s": marks["agreed"] - detected,
                "form_group_s": marks["group_formed"] - marks["agreed"],
                "restore_s": marks["restored"] - marks["group_formed"],
                "first_step_s": marks["first_step"] - marks["restored"]}
    return {"kill_to_first_step_s": marks["first_step"] - killed,
            "detect_s": detected - killed,
            "rendezvous_spawn_s": marks["process_start"] - detected,
            "startup_to_pg_s": marks["process_group_up"] - marks["process_start"],
            "pg_to_loaded_s": marks["checkpoint_loaded"] - marks["process_group_up"],
            "loaded_to_first_step_s": marks["first_step"] - marks["checkpoint_loaded"]}


def table(name: str, runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"{name:<26}" + "".join(f"{f'run {i + 1}':>10}" for i in range(len(runs)))
          + f"{'median':>10}")
    for k in runs[0]:
        print(f"  {k:<24}" + "".join(f"{r[k]:>10.2f}" for r in runs) + f"{med[k]:>10.2f}")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    results = {"warm": [], "cold": []}
    for _ in range(args.repeats):
        for path in results:
            with tempfile.TemporaryDirectory(prefix=f"llmtrain-bench-{path}-") as d:
                results[path].append(one_recovery(Path(d), warm=path == "warm"))
    med = {path: table(path, runs) for path, runs in results.items()}
    figures = {f"{path}_{k}": round(v, 3) for path, m in med.items() for k, v in m.items()}
    figures["warm_over_cold"] = round(med["warm"]["kill_to_first_step_s"]
                                      / med["cold"]["kill_to_first_step_s"], 3)
    figures["goal_warm_s"] = 2.0
    figures["goal_warm_over_cold"] = 0.2
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
