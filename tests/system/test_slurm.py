"""slurm/llmtrain.sbatch end to end on a real single-host Slurm cluster (tests/slurm_cluster.py:
slurmctld, one slurmd per fake node, munge): a training node set DOWN mid-run is replaced
by the spare inside the same job, warm (the default); a preemption signal checkpoints, requeues and resumes,
and a node that fails the health gate is drained and left out of the requeued run."""

import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, events
from nvml_states import node, write_script
from slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)
from llmtrain.checkpoint import storage
from llmtrain.distributed.process_group import free_port
from llmtrain.reliability.health.exclusion import excluded_hosts

pytestmark = pytest.mark.slow

SBATCH = ROOT / "slurm" / "llmtrain.sbatch"
STEPS = 60
TRAIN = ("--training.steps", str(STEPS), "--metrics.log_every", "5",
         "--metrics.address", "127.0.0.1", "--metrics.port", "0")


class Job:
    """A submitted llmtrain.sbatch job and its run dir."""

    def __init__(self, cluster, tmp: Path, nodes: int, *, train_nodes: int, spare_nodes: int,
                 train_args: tuple[str, ...], env: dict | None = None):
        self.cluster, self.run, self.out = cluster, tmp / "run", tmp / "job.out"
        self.id = cluster.sbatch(
            f"--nodes={nodes}", f"--chdir={ROOT}", f"--output={self.out}", str(SBATCH),
            env={"TRAIN_NODES": str(train_nodes), "SPARE_NODES": str(spare_nodes),
                 "LLMTRAIN_PYTHON": sys.executable, "LLMTRAIN_RUN_DIR": str(self.run),
                 "LLMTRAIN_ARGS": " ".join(train_args),
                 "LLMTRAIN_RDZV_PORT": str(free_port()), "SPARE_GRACE": "30",
                 "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})})

    def info(self) -> dict:
        return self.cluster.job(self.id)

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def events(self, name: str) -> list[dict]:
        return events(self.run, name) if (self.run / "events").exists() else []

    def diagnosis(self) -> str:
        return (f"job: {self.info()}\n--- job output (tail)\n{self.output()[-6000:]}\n"
                f"--- cluster logs\n{self.cluster.logs(1500)}")

    def until(self, what: str, ok, timeout: float = 180):
        """Polls ``ok()`` until it returns something truthy; fails early, with the job's
        output and the daemons' logs, when the job ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := ok():
                return found
            if self.info().get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                                               "NODE_FAIL", "TIMEOUT"):
                if found := ok():
                    return found
                raise AssertionError(f"the job ended before {what}\n{self.diagnosis()}")
            time.sleep(0.5)
        raise AssertionError(f"no {what} within {timeout} s\n{self.diagnosis()}")

    def wait_end(self, timeout: float = 240) -> dict:
        try:
            return self.cluster.wait_job(self.id, timeout)
        except TimeoutError:
            raise AssertionError(f"job still running after {timeout} s\n{self.diagnosis()}")

    def no_processes_left(self, node: str | None = None, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (pids := self.cluster.job_processes(self.id, node)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not pids, f"processes of job {self.id} on {node or 'any node'} left: {pids}"


def training_hosts(job: Job) -> list[set[str]]:
    """The hosts whose ranks ran, per attempt (the rank-level health events carry them)."""
    starts = [e["ts"] for e in job.events("attempt_start")]
    per = [set() for _ in starts]
    for e in job.events("health"):
        k = sum(ts <= e["ts"] for ts in starts) - 1
        if k >= 0 and e.get("host"):
            per[k].add(e["host"])
    return per


def final_checkpoint_ok(run: Path, step: int = STEPS) -> None:
    root = str(run / "checkpoints")
    committed = [c.step for c in storage.list_checkpoints(root) if c.committed]
    assert step in committed, committed
    assert storage.verify(storage.step_dir(root, step), checksums=True) == []


def test_a_training_node_set_down_is_replaced_by_the_spare_and_the_job_completes(
        slurm_cluster, tmp_path):  # noqa: F811
    cluster = slurm_cluster(nodes=4)  # n1: batch host + store; 2 training nodes; 1 spare
    steps = 150  # about 10 s of training left after step 20 for the fault and the recovery
    job = Job(cluster, tmp_path, 4, train_nodes=2, spare_nodes=1,
              train_args=(*TRAIN, "--checkpoint.interval_steps", "20",
                          "--training.steps", str(steps)))
    job.until("the checkpoint of step 20", lambda: [
        e for e in job.events("checkpoint_committed") if e["step"] == 20])
    info = job.info()
    assert info["JobState"] == "RUNNING" and info["BatchHost"] == "n1", info
    # the training nodes' launchers start torchrun; the spare (n4) waits warm outside it
    launched = job.until("two node launchers", lambda: len(hosts := {
        e["host"] for e in job.events("node_launch") if not e.get("spare")}) == 2 and hosts)
    assert launched == {"n2", "n3"}, launched
    assert [e["host"] for e in job.events("node_launch") if e.get("spare") == "warm"] == ["n4"]
    (first,) = training_hosts(job)
    assert first == launched, first
    (victim,) = {e["host"] for e in job.events("attempt_start")}  # rank 0's node
    spare = "n4"
    assert job.cluster.job_processes(job.id, victim)

    cluster.scontrol("update", f"nodename={victim}", "state=down", "reason=test: node failure")

    # Slurm kills the victim's step (and everything in it); the job itself runs on.
    job.no_processes_left(victim, timeout=30)
    assert job.info()["JobState"] == "RUNNING", job.diagnosis()
    # warm by default (the script runs an external store): the spare takes the lost rank
    (rec,) = job.until("a warm recovery", lambda: job.events("warm_recovery"))
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"]) == ("COMPLETED", "0:0"), job.diagnosis()
    assert end["Restarts"] == "0"  # survived inside the job: no requeue

    out = job.output()
    assert f"{victim}: lost" in out, out[-4000:]
    assert "done: the run finished" in out, out[-4000:]
    # nobody restarted: one attempt, no checkpoint read; the spare holds the lost rank
    assert [e["world_size"] for e in job.events("attempt_start")] == [2]
    assert not job.events("checkpoint_loaded") and not job.events("warm_recovery_failed")
    assert rec["lost"] == [0], rec  # the victim held rank 0
    assert [e["host"] for e in job.events("startup") if e["rank"] == 0][-1] == spare
    assert max(e["step"] for e in job.events("step")) == steps
    final_checkpoint_ok(job.run, steps)
    assert "DOWN" in cluster.node(victim)["State"]
    job.no_processes_left()


def test_preemption_checkpoints_and_requeues_and_a_node_failing_the_gate_is_drained(
        slurm_cluster, tmp_path):  # noqa: F811
    cluster = slurm_cluster(nodes=5)  # a fifth node for the requeued run: n4 gets drained
    bad = node(1)
    bad["gpus"][0]["remapped_rows"]["failure"] = True
    bad_script = write_script(tmp_path / "bad.json", bad)
    # The scripted NVML stand-in fails the gate on n4 only: a python wrapper that gives
    # that node the bad device states. Until the test sends the preemption signal, the
    # wrapper also slows the first run's steps tenfold from step 5 on, so that the signal
    # lands before its last step however fast this machine is (at full speed the 55 steps
    # left can take less than the signal's way to the ranks); the requeued run goes fast.
    python, signalled = tmp_path / "python", tmp_path / "signalled"
    python.write_text(f"""#!/bin/bash
[[ "${{SLURMD_NODENAME:-}}" == n4 ]] && export LLMTRAIN_NVML_SCRIPT={bad_script}
[[ -e {signalled} ]] || export LLMTRAIN_FAULTS="slow@step:step=5,factor=10"
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    job = Job(cluster, tmp_path, 4, train_nodes=2, spare_nodes=1,
              train_args=(*TRAIN, "--checkpoint.interval_steps", "1000",
                          "--reliability.faults", "env"),
              env={"LLMTRAIN_PYTHON": str(python)})
    job.until("n4 drained", lambda: "DRAIN" in cluster.node("n4").get("State", ""))
    assert "llmtrain excluded" in cluster.node("n4")["Reason"]
    assert "row_remap" in excluded_hosts(str(job.run))["n4"]["reason"]
    assert cluster.hostnames(job.info()["NodeList"]) == ["n1", "n2", "n3", "n4"]
    job.until("training", lambda: [e for e in job.events("step") if e["step"] >= 5])

    # What --signal=B:USR1@120 does 120 s before the time limit: USR1 to the batch shell.
    signalled.touch()
    cluster.run("scancel", "--batch", "--signal=USR1", str(job.id))

    def requeued():
        info = job.info()
        if info["Restarts"] != "1" or info["JobState"] not in ("PENDING", "RUNNING"):
            return None
        if info["JobState"] == "PENDING" and info["Reason"] == "BeginTime":
            # Slurm holds a requeued job for a while before it may start again; skip most
            # of that, not all: a relaunch within the second of the requeue gets a
            # credential slurmd takes for the killed run's ("already killed", exit 1).
            time.sleep(2)
            cluster.scontrol("update", f"jobid={job.id}", "starttime=now", check=False)
        return info
    job.until("the job requeued", requeued, timeout=120)
    (preempted,) = job.events("preempted")
    saved = preempted["step"]
    assert saved < STEPS
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        job.diagnosis()
    # the requeued run got other nodes than the drained one, and resumed where it stopped
    assert "n4" not in cluster.hostnames(end["NodeList"]), end["NodeList"]
    assert [e["step"] for e in job.events("checkpoint_loaded")] == [saved]
    assert [e["step"] for e in job.events("checkpoint_committed")] == [saved, STEPS]
    final_checkpoint_ok(job.run)
    out = job.output()  # --open-mode=append: both runs' logs
    assert "n4 drained" in out and "requeueing job" in out, out[-4000:]
    assert "run 1:" in out and "done: the run finished" in out, out[-4000:]
    job.no_processes_left()
