"""What a lost rank costs: from the fault to the first step after it, on the warm path and
on the cold path, in the same run, for four faults:

- ``node_loss``: node2 is killed whole (launcher, agent, workers);
- ``kill_rank``: node2's worker is SIGKILLed (its agent lives on);
- ``gpu_bad``: node2's GPU (the scripted NVML stand-in, checked every second) reports
  uncorrectable ECC errors; its rank leaves and the node is excluded. The time counts from
  the state's change, so it includes up to a second of the health monitor's polling;
- ``hang``: node2's worker is SIGSTOPped: its peer waits in a collective until the
  watchdog names it (its heartbeat one and a half intervals old while the peer waits for
  it). Warm, its agent kills it at the watchdog's word; cold, every rank exits and the
  stopped one is killed by this script (it would ignore torchrun's SIGTERM), as
  ``llmtrain chaos`` does.

Three "nodes" on this machine (``LocalCluster``: ``llmtrain launch`` agents on loopback,
an external rendezvous store), ``--nnodes 2:2`` with the third as a spare.

- **warm** (``--warm.enable true``): the spare waits warm (imported, store connected); the
  survivor keeps its process, the spare takes the lost rank, both restore the snapshot of
  the last step from memory (the lost rank's from its buddy's replica). Parts from the
  ``warm_recovery`` event: detected, agreed (who is lost, which spare, which step),
  group formed, restored, first step.
- **cold**: torchrun restarts every worker; the spare joins the rendezvous; the new
  processes load the newest checkpoint. Every process starts afresh and imports torch
  itself (``--no-prepared-workers --no-template``): the baseline. Parts from the
  ``recovery`` event.
- **cold_prepared**: the cold path as ``llmtrain launch`` runs it by default: each node
  keeps a worker per local rank, forked before the fault from the node's template process
  (which imported torch and llmtrain once), and the restart's ranks run in them (the
  spawn and the imports skipped).
- **shrink** (``node_loss`` only): no spare, ``--nnodes 1:2``, the defaults otherwise:
  the survivor goes on alone at half the world size (the global batch kept, in more
  micro-batches) in its own process, its state resharded in memory from its snapshot and
  its ward's replica. Parts from the ``warm_recovery`` event: detected, agreed, group
  formed (the old trainer closed, a new one built at the smaller size), restored
  (resharded), first step at the smaller size.
- **shrink_hsdp**: the shrink of an HSDP job: two ranks a node, each node a replica of 2
  shards (``dp_shard`` 2, ``dp_replicate`` -1), so the job drops the lost node's replica
  and goes on as the other (2 x 2 ranks to 1 x 2): each survivor keeps its own shards,
  and nothing is sent.
- **grow** (after a shrink as above): a standby node comes; the ranks vote to take it in
  at a step boundary, copy the state of that step into memory, and re-form at full size,
  the spare's shard resharded from their memory. The row is the time the running ranks
  lose: from the vote's decision to the first step at full size (the spare's own start,
  imports and model build, runs beside training and is not counted). Parts from the
  ``warm_grow`` event.
- **shrink_cold**: the same with ``--warm.shrink false``: the warm path finds no spare and
  goes cold, and the survivor restarts alone from the newest checkpoint under torchrun.
  The baseline of the shrink. The lost node is known dead at once (its agent's presence
  connection closes), so the survivor's round completes without torch's last call.
  Fresh processes, as ``cold``.
- **shrink_cold_prepared**: the same with the default prepared workers, as ``cold_prepared``.
- **warm_tp**: the warm path with tensor parallelism: two ranks a node, a tp 2 group each
  (``parallelism.tp`` 2, each node an HSDP replica of its own), one standby node with a
  warm spare per local rank (a node lost whole needs two); a lost rank's place goes to a
  spare, which takes that rank's pieces from its buddy's replica.
- **shrink_tp** (``node_loss`` only): the same with no spare: the lost node's replica is
  dropped and the other tp group goes on from its own memory (nothing sent).

With ``--script examples/hf_causal_lm.py`` (or any loop on llmtrain's public API) the
same faults and paths are timed on that loop instead of llmtrain's own trainer, its
figures' names prefixed with the script's name.

Goals: warm <= 1.0 s median for each of the first three faults, with warm / cold <= 0.15;
the hang warm <= 3.0 s; the shrink and the grow <= 2.0 s each; with TP, a rank killed
and a node lost <= 1.0 s; cold, a rank killed <= 2.0 s, a node lost <= 3.0 s with a spare
and without (shrink_cold), a hang <= 4.0 s.

    python benchmarks/recovery.py [--repeats 2] [--faults node_loss,kill_rank,gpu_bad]
        [--paths warm,cold,cold_prepared,shrink,shrink_cold,shrink_cold_prepared,shrink_hsdp,
                 grow,warm_tp,shrink_tp]
        [--script LOOP.py]

Prints a table per fault and path, then one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from llmtrain.chaos.local_cluster import LocalCluster
from llmtrain.chaos.scripted_gpu import write_gpu_script
from llmtrain.events import read_events
from reaper import reaping

TRAIN = ("--config", "debug_cpu", "--training.steps", "100000",
         "--checkpoint.interval_steps", "20", "--metrics.log_every", "5",
         "--metrics.address", "127.0.0.1", "--metrics.port", "0", "--health.interval_s", "1")
FAULTS = ("node_loss", "kill_rank", "gpu_bad", "hang")
FRESH = ("--no-prepared-workers", "--no-template")  # every process imports torch itself
PATHS = ("warm", "cold", "cold_prepared", "shrink", "shrink_cold", "shrink_cold_prepared",
         "shrink_hsdp", "grow", "warm_tp", "shrink_tp")
SHRINKS = ("shrink", "shrink_cold", "shrink_cold_prepared", "shrink_hsdp", "grow",
           "shrink_tp")  # node loss, no spare
TP = ("--nproc-per-node", "2", "--parallelism.tp", "2", "--parallelism.dp_replicate", "-1",
      "--parallelism.dp_shard", "1", "--training.micro_batch_size", "4")


def wait_for(run: Path, event: str, where=lambda e: True, timeout: float = 300,
             failed: str = "") -> dict:
    """The first ``event`` matching ``where``; RuntimeError at a ``failed`` event first
    (the warm path gave up: the row would time a cold restart)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = [e for e in read_events(str(run)) if e["event"] in (event, failed)
                     and where(e)]
        except FileNotFoundError:
            found = []
        if found and found[0]["event"] == failed:
            raise RuntimeError(f"{failed} in {run}: {found[0]}")
        if found:
            return found[0]
        time.sleep(0.1)
    raise TimeoutError(f"no {event} event in {run} within {timeout} s")


def wait_ready(log: Path, count: int, timeout: float = 120) -> None:
    """Until a node's launcher has said ``count`` prepared workers are ready."""
    deadline = time.monotonic() + timeout
    while log.read_text().count("prepared worker") < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log}: no {count} prepared workers ready in {timeout} s")
        time.sleep(0.2)


def one_recovery(workdir: Path, path: str, fault: str, script: str = "") -> dict:
    run = workdir / "run"
    warm = path not in ("cold", "cold_prepared", "shrink_cold", "shrink_cold_prepared")
    with_spare = path not in SHRINKS
    per_node = 2 if path in ("shrink_hsdp", "warm_tp", "shrink_tp") else 1
    options = {"cold": ("--warm.enable", "false", *FRESH),
               "cold_prepared": ("--warm.enable", "false"),
               "shrink_cold": ("--warm.shrink", "false", *FRESH),
               "shrink_cold_prepared": ("--warm.shrink", "false"),
               "shrink_hsdp": ("--nproc-per-node", "2", "--parallelism.dp_replicate", "-1",
                               "--parallelism.dp_shard", "2",
                               "--training.global_batch_size", "32"),
               "warm_tp": TP, "shrink_tp": TP,
               }.get(path, ())
    loop = ("--script", str(Path(script).resolve())) if script else ()
    cluster = LocalCluster(workdir, run, "2:2" if with_spare else "1:2", TRAIN + options + loop)
    gpus = {name: workdir / f"{name}-gpu.json" for name in ("node1", "node2", "node3")}

    def start(name: str, spare: bool = False) -> None:
        write_gpu_script(gpus[name], healthy=True, count=per_node)  # one a local rank
        cluster.start(name, env={"LLMTRAIN_NVML_SCRIPT": str(gpus[name])}, spare=spare)
    try:
        start("node1")
        start("node2")
        if with_spare and warm:
            start("node3", spare=True)
        wait_for(run, "checkpoint_committed", lambda e: e["step"] >= 40)
        if with_spare and not warm:  # a standby, its agent (and prepared workers) imported
            start("node3", spare=True)
            time.sleep(6)
            if path == "cold_prepared":  # as a standby is long before it is needed
                wait_ready(workdir / "node3.log", per_node)
        time.sleep(2)  # mid-interval, with the spare waiting
        worker = wait_for(run, "startup", lambda e: e["host"] == "node2")
        killed = time.time()
        if fault == "node_loss":
            cluster.kill("node2")
        elif fault == "kill_rank":
            os.kill(worker["pid"], signal.SIGKILL)
        elif fault == "hang":
            os.kill(worker["pid"], signal.SIGSTOP)
            if not warm:
                wait_for(run, "hang", lambda e: e["ts"] > killed)
                os.kill(worker["pid"], signal.SIGKILL)
        else:
            write_gpu_script(gpus["node2"], healthy=False, count=per_node)  # its GPU 0
        rec = wait_for(run, "warm_recovery" if warm else "recovery",
                       lambda e: e["ts"] > killed, failed="warm_recovery_failed" if warm else "")
        if path == "grow":
            start("node3", spare=True)
            rec = wait_for(run, "warm_grow")
    finally:
        cluster.close()
    marks = rec["marks"]
    if path == "grow":
        assert rec["world_size"] == 2, rec
        return {"paused_s": rec["total_s"],
                "agree_s": marks["agreed"] - marks["grow_decided"],
                "form_group_s": marks["group_formed"] - marks["agreed"],
                "restore_s": marks["restored"] - marks["group_formed"],
                "first_step_s": marks["first_step"] - marks["restored"]}
    detected = marks["failure_detected"] or killed
    if warm:
        if not with_spare:  # the survivors alone
            assert (rec["kind"], rec["world_size"]) == ("shrink", per_node), rec
        return {"fault_to_first_step_s": marks["first_step"] - killed,
                "detect_s": detected - killed,
                "agree_s": marks["agreed"] - detected,
                "form_group_s": marks["group_formed"] - marks["agreed"],
                "restore_s": marks["restored"] - marks["group_formed"],
                "first_step_s": marks["first_step"] - marks["restored"],
                # the last step done when it failed, back to the snapshot restored
                "steps_redone": rec["failed_at"] - rec["step"],
                "snapshot_interval": rec["snapshot_interval"]}
    if not with_spare:
        started = wait_for(run, "attempt_start", lambda e: e["ts"] > killed)
        assert started["world_size"] == 1, started  # the survivor alone
    return {"fault_to_first_step_s": marks["first_step"] - killed,
            "detect_s": detected - killed,
            "rendezvous_spawn_s": marks["process_start"] - detected,
            "startup_to_pg_s": marks["process_group_up"] - marks["process_start"],
            "pg_to_loaded_s": marks["checkpoint_loaded"] - marks["process_group_up"],
            "loaded_to_first_step_s": marks["first_step"] - marks["checkpoint_loaded"]}


GOAL_WARM_S, GOAL_HANG_WARM_S, GOAL_WARM_OVER_COLD = 1.0, 3.0, 0.15
GOAL_SHRINK_S = 2.0  # node loss without a spare, to the first step at the smaller size
GOAL_GROW_S = 2.0  # the others' time lost to taking a spare in
GOAL_COLD_S = {"kill_rank": 2.0, "node_loss": 3.0, "hang": 4.0}  # a cold restart
GOAL_SHRINK_COLD_S = 3.0  # node loss without a spare, cold: the survivors restart alone


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
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--script", default="",
                    help="a training loop on llmtrain's API to time instead of the trainer")
    args = ap.parse_args()
    faults, paths = args.faults.split(","), args.paths.split(",")
    if unknown := set(faults) - set(FAULTS):
        ap.error(f"--faults: {sorted(unknown)} not among {FAULTS}")
    if unknown := set(paths) - set(PATHS):
        ap.error(f"--paths: {sorted(unknown)} not among {PATHS}")
    results = {(f, path): [] for f in faults for path in paths
               if path not in SHRINKS or f == "node_loss"}
    for _ in range(args.repeats):
        for fault, path in results:
            with tempfile.TemporaryDirectory(prefix=f"llmtrain-bench-{fault}-{path}-") as d:
                results[fault, path].append(one_recovery(Path(d), path, fault, args.script))
    figures = {}
    prefix = f"{Path(args.script).stem}_" if args.script else ""
    for (fault, path), runs in results.items():
        med = table(f"{prefix}{fault} {path}", runs)
        figures |= {f"{prefix}{fault}_{path}_{k}": round(v, 3) for k, v in med.items()}
    for fault in (f for f in faults if {(f, "warm"), (f, "cold")} <= results.keys()):
        figures[f"{prefix}{fault}_warm_over_cold"] = round(
            figures[f"{prefix}{fault}_warm_fault_to_first_step_s"]
            / figures[f"{prefix}{fault}_cold_fault_to_first_step_s"], 3)
    for fault in (f for f in faults if {(f, "cold_prepared"), (f, "cold")} <= results.keys()):
        figures[f"{prefix}{fault}_cold_prepared_over_cold"] = round(
            figures[f"{prefix}{fault}_cold_prepared_fault_to_first_step_s"]
            / figures[f"{prefix}{fault}_cold_fault_to_first_step_s"], 3)
    figures["goal_cold_s"] = GOAL_COLD_S
    figures["goal_warm_s"] = GOAL_WARM_S
    figures["goal_hang_warm_s"] = GOAL_HANG_WARM_S
    figures["goal_warm_over_cold"] = GOAL_WARM_OVER_COLD
    if {("node_loss", "shrink_cold"), ("node_loss", "shrink_cold_prepared")} & results.keys():
        figures["goal_shrink_cold_s"] = GOAL_SHRINK_COLD_S
    if ("node_loss", "grow") in results:
        figures["goal_grow_s"] = GOAL_GROW_S
    if ("node_loss", "shrink") in results:
        figures["goal_shrink_s"] = GOAL_SHRINK_S
        if ("node_loss", "shrink_cold") in results:  # in memory against a cold restart
            figures[f"{prefix}node_loss_shrink_over_shrink_cold"] = round(
                figures[f"{prefix}node_loss_shrink_fault_to_first_step_s"]
                / figures[f"{prefix}node_loss_shrink_cold_fault_to_first_step_s"], 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    with reaping():
        main()
