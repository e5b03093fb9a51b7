"""A chaos job's end, judged: waiting for it (and ending the launchers that outlive it),
the committed checkpoints lost, and the fault-free reference its final weights must equal
bit for bit."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import asdict

from llmtrain.chaos.job import Job
from llmtrain.chaos.processes import kill_tree
from llmtrain.chaos.summary import weighted
from llmtrain.chaos.timeline import (measured_ettr, restarts, sizes, skipped_at_last,
                                     time_below)
from llmtrain.checkpoint import storage
from llmtrain.distributed.signed_store import SignedStore


def job_end(job: Job) -> dict | None:
    """The job's ``run_end`` at its last step (or where a stop request ended it), unless
    an attempt began after it (a restart)."""
    end, start = job.latest("run_end"), job.latest("attempt_start")
    if end is None or (start is not None and start["ts"] > end["ts"]):
        return None
    return end if end["steps"] == job.cfg.steps or end["stopped"] else None


def launchers_gone(job: Job) -> bool:
    """Every launcher that ran a rank has exited (75 after a failure it could not restart
    from): nothing restarts the job, and the spares' launchers would wait for it for ever."""
    hosts = [h for h in job.hosts() if h in job.cluster.nodes]
    return bool(hosts) and all(job.cluster.nodes[h].poll() is not None for h in hosts)


def pool_state(spares: SignedStore) -> dict:
    """The spare pool's counters and each registered spare's slot, as the store has them."""
    with contextlib.suppress(Exception):
        registered = spares.add("spares/registered", 0)
        return {"registered": registered, "claimed": spares.add("spares/claimed", 0),
                "left": spares.add("spares/left", 0),
                "slots": {n: [spares.get(f"spares/{n}/state").decode()
                              if spares.check([f"spares/{n}/state"]) else "",
                              spares.check([f"spares/{n}/plan"])]
                          for n in range(1, registered + 1)}}
    return {}


def wait_for_end(job: Job) -> dict[str, dict]:
    """Lets the job run to its end; every node's launcher exits once it has, a waiting
    spare released. One that has not a minute after is killed: returns those, each with
    the spare pool as it was then."""
    with contextlib.suppress(TimeoutError):  # (then the verdict says it did not finish)
        job.wait(lambda: job_end(job) or launchers_gone(job)
                 or all(p.poll() is not None for p in job.cluster.nodes.values()),
                 "the job's end", 1800)
    deadline, killed = time.time() + 60, {}
    for name, proc in job.cluster.nodes.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            killed[name] = pool_state(job.spares)
            job.cluster.kill(name)
    return killed


def lost_checkpoints(job: Job) -> list[int]:
    """Committed steps that are neither retired by retention, nor the one chaos broke,
    nor still whole."""
    # retired by retention while committed; a rejected one chaos did not break was lost
    removed = {e["step"] for e in job.events("checkpoint_removed") if e.get("committed")}
    wrongly_rejected = {e["step"] for e in job.events("checkpoint_rejected")} - job.truncated
    lost = sorted(wrongly_rejected)
    for e in job.events("checkpoint_committed"):
        step = e["step"]
        if step in removed or step in job.truncated or step in wrongly_rejected:
            continue
        url = storage.step_dir(str(job.mount.root), step)
        if storage.read_manifest(url) is None or storage.verify(url, checksums=True):
            lost.append(step)
    return sorted(set(lost))


def _reference_run(argv: list[str], log) -> int:
    """Runs the reference (its launcher and workers, a session of their own); ends them
    all if this is interrupted."""
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()


def compare(job: Job, train_args: tuple[str, ...], script: str, final_step: int) -> bool:
    """Trains the same job without faults at the same world size, then compares the
    final weights bit for bit. The reference saves only its last step and checks no
    replicas (neither changes the weights): it is a quarter of a short soak's time."""
    import torch

    from llmtrain.checkpoint.shard_read import load_unsharded
    ref = job.dir / "reference"
    skips = ",".join(map(str, skipped_at_last(job.events())))
    # the job's LR schedule (llmtrain's trainer; a script's schedule is its own, and
    # must not depend on training.steps, which the reference ends at the job's end)
    schedule = [] if script else ["--optim.decay_steps", str(job.cfg.steps)]
    # one node of all the ranks, launched as the job's nodes are (its template imports
    # once for them all); port 0: its agent's store takes a free port
    argv = [sys.executable, "-m", "llmtrain", "launch", "--rdzv-endpoint=127.0.0.1:0",
            f"--nproc-per-node={job.cfg.world_size}", "--max-restarts=0",
            *(["--script", script] if script else []), *train_args,
            "--training.steps", str(final_step), *schedule,
            "--training.run_dir", str(ref), "--health.monitor", "false",
            # nothing is injected, and nothing restarts it: a watchdog's false alarm (a
            # rank starved for a few seconds on a loaded machine) ended one
            "--reliability.watchdog", "false",
            # (a script skips them only if its loop asks run.skipping())
            "--integrity.skip_steps", skips,
            "--checkpoint.interval_steps", str(final_step),
            "--integrity.sdc_every", "0"]
    with open(job.dir / "reference.log", "w") as log:
        code = _reference_run(argv, log)
    if code != 0:
        raise RuntimeError(f"chaos: the fault-free reference run exited {code}; "
                           f"see {job.dir / 'reference.log'}")
    a, b = (load_unsharded(storage.step_dir(str(root), final_step))["model"]
            for root in (ref / "checkpoints", job.mount.root))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _weights(job: Job, result: dict, end: dict | None, compare_at) -> None:
    """The final weights' verdict: compared with the reference (``compare_at(step)``)
    unless the job changed size or did not save its last step."""
    finished = end is not None
    resized = {size for _, size in sizes(job.events())} != {job.cfg.world_size}
    if not (job.cfg.reference and finished):
        return
    if resized:  # other reduction orders
        result["reference"] = ("not compared: the job trained at other world sizes "
                               "(its sums ran in other orders)")
    elif not result["final_checkpoint_committed"]:
        result["reference"] = f"not compared: the job's last step {end['steps']} was not saved"
        result["bitwise_equal_to_reference"] = False
    else:
        result["bitwise_equal_to_reference"] = compare_at(end["steps"])


def judge(job: Job, killed: dict[str, dict], kinds_result: dict, compare_at) -> dict:
    """The run's result (``verdict.json``): the job's end, the faults' verdicts and
    totals, ``kinds_result`` (what ran and what did not), the checkpoints lost, the
    ETTR, the size changes and the final weights (``compare_at(step)``)."""
    end = job_end(job)
    finished = end is not None
    last = job.latest("run_end")
    result = {"finished": finished, "steps": last and last["steps"],
              "faults": len(job.verdicts),
              "kinds": sorted({v.kind for v in job.verdicts}),
              "detected": sum(v.detected for v in job.verdicts),
              "correct": sum(v.correct for v in job.verdicts),
              "committed_checkpoints_lost": lost_checkpoints(job), **kinds_result}
    # the job's last step, committed: a job that ended with its last save refused
    # (its store stalled) has trained steps that no restart gets back
    result["final_checkpoint_committed"] = finished and storage.read_manifest(
        storage.step_dir(str(job.mount.root), end["steps"])) is not None
    result["nodes_killed_after_the_end"] = killed
    events = job.events()
    result.update(measured_ettr(events, [v.recover_s for v in job.verdicts if v.recover_s],
                                job.cfg.checkpoint_every))
    result["shrinks"] = sum(v.path == "shrink" for v in job.verdicts)
    result["grows"] = sum(v.returned == "grow" for v in job.verdicts)
    result["below_full_s"] = time_below(events, job.cfg.world_size)
    result["restarts"] = restarts(events)
    _weights(job, result, end, compare_at)
    result["verdicts"] = [asdict(v) for v in job.verdicts]
    if job.cfg.mix:
        result["mix"] = {"weights": job.cfg.mix, "source": job.cfg.mix_source}
        result.update(weighted(result["verdicts"], job.cfg.mix))
    return result
