"""A real single-host Slurm cluster for tests: its own munged, one slurmctld and one slurmd
per fake node ("n1".."nN", all ``NodeHostname=localhost`` on their own ports), everything
in a fresh temp dir, torn down (jobs, daemons, every process the jobs left) even when the
test fails.

    slurm_cluster             -> factory: slurm_cluster(nodes=4, cpus=2) -> SlurmCluster
    SlurmCluster              .env (SLURM_CONF for sbatch/scontrol), .sbatch(), .scontrol(),
                              .job(id), .wait_job(id), .node(name), .wait_nodes_idle(),
                              .job_processes(job_id, node=None), .close()

Skipped when Debian `slurm-wlm` / `munge` are not installed; with CI=true that is a failure
instead (`.ci/run` installs them). Needs root: slurmd runs job steps as their user.

What works on a 2-core container without systemd (see also the shared Slurm recipes):
proctrack/linuxproc (tracks a step's processes by parent pid, so torchrun's workers in
sessions of their own are still found), task/none, no accounting (job records are read
with ``scontrol show job``, kept for MinJobAge after the end).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import process_state
from needs import unavailable

__all__ = ["SlurmCluster", "slurm_cluster", "slurm_problem"]

def slurm_problem() -> str | None:
    """Why no cluster can be started here, or None."""
    for tool in ("slurmctld", "slurmd", "sbatch", "scontrol", "munged", "munge"):
        if shutil.which(tool) is None:
            return f"{tool} not found: apt-get install slurm-wlm munge (see .ci/run)"
    if os.geteuid() != 0:
        return "a Slurm test cluster needs root (slurmd starts job steps as their user)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _parse(text: str) -> dict[str, str]:
    """``scontrol show`` output (Key=Value pairs, spaces inside some values) as a dict."""
    out: dict[str, str] = {}
    key = None
    for token in text.split():
        k, eq, v = token.partition("=")
        if eq and k and (k[0].isupper() or k in ("cpus", "mem")):
            key = k
            out[key] = v
        elif key is not None:
            out[key] += " " + token
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


class SlurmCluster:
    def __init__(self, nodes: int = 4, cpus: int = 2, kill_wait: int = 5):
        # A short path: munged's socket path must fit in sockaddr_un (108 bytes).
        self.base = Path(tempfile.mkdtemp(prefix="llmslurm-"))
        self.base.chmod(0o711)  # munge clients (any user) must reach the socket
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus, self.kill_wait = cpus, kill_wait
        self.conf = self.base / "slurm.conf"
        self.munge_socket = self.base / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if var != "SLURM_CONF":
                del self.env[var]
        self.daemons: dict[str, subprocess.Popen] = {}

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> "SlurmCluster":
        for d in ("state", "log", "munge", *(f"spool/{n}" for n in self.names)):
            (self.base / d).mkdir(parents=True)
        (self.base / "munge").chmod(0o700)
        self._start_munge()
        ctld_port, *node_ports = _free_ports(1 + len(self.names))
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} "
            f"CPUs={self.cpus} RealMemory=2000 State=UNKNOWN"
            for n, p in zip(self.names, node_ports))
        b = self.base
        self.conf.write_text(f"""\
ClusterName=llmtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MpiDefault=none
ReturnToService=1
SlurmdTimeout=30
MessageTimeout=20
InactiveLimit=0
KillWait={self.kill_wait}
MinJobAge=600
JobCompType=jobcomp/filetxt
JobCompLoc={b}/log/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes={",".join(self.names)} Default=YES MaxTime=INFINITE State=UP
""")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._until(lambda: self.scontrol("ping", check=False).returncode == 0,
                    "slurmctld to answer", 30)
        for n in self.names:
            self._daemon(f"slurmd-{n}", ["slurmd", "-D", "-f", str(self.conf), "-N", n])
        self.wait_nodes_idle(self.names, timeout=60)
        return self

    def _start_munge(self) -> None:
        key = self.base / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self._daemon("munged", [
            "munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.base / 'munge' / 'munged.pid'}",
            f"--seed-file={self.base / 'munge' / 'munged.seed'}"])
        ok = lambda: subprocess.run(["munge", "-n", f"--socket={self.munge_socket}"],  # noqa: E731
                                    capture_output=True).returncode == 0
        self._until(ok, "munged to answer", 15)

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.base / "log" / f"{name}.out", "w")
        self.daemons[name] = subprocess.Popen(cmd, env=self.env, stdout=log,
                                              stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL,
                                              start_new_session=True)
        log.close()

    def _until(self, ok, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            dead = {n: p.returncode for n, p in self.daemons.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"Slurm daemon(s) exited {dead} while waiting for {what}\n"
                                   + self.logs())
            time.sleep(0.2)
        raise TimeoutError(f"waited {timeout} s for {what}\n{self.logs()}")

    def close(self) -> None:
        """Cancels every job, stops the daemons and kills whatever the jobs left running
        (any process with this cluster's SLURM_CONF in its environment); never raises."""
        if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--full", f"--user={os.geteuid()}", check=False)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and self.squeue():
                    time.sleep(0.3)
            except (OSError, subprocess.SubprocessError):
                pass  # the daemons go next, and whatever the jobs left after them
        for name in sorted(self.daemons, key=lambda n: n.startswith("munged")):
            proc = self.daemons[name]  # the slurmds and slurmctld first, munged last
            if proc.poll() is None:
                proc.terminate()
        for proc in self.daemons.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.kill_leftovers()
        shutil.rmtree(self.base, ignore_errors=True)

    def leftovers(self) -> list[int]:
        """Processes started by this cluster's daemons or jobs (slurmstepd, job steps,
        their children), found by the SLURM_CONF each one inherits."""
        me = os.getpid()
        return [p for p in _pids()
                if p != me and _environ(p).get("SLURM_CONF") == str(self.conf)]

    def kill_leftovers(self) -> None:
        for _ in range(3):
            pids = self.leftovers()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    # -- commands ---------------------------------------------------------------------

    def run(self, *cmd: str, check: bool = True, timeout: float = 30,
            env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}"
                               f"\n{proc.stderr}")
        return proc

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("scontrol", *args, check=check)

    def sbatch(self, *args: str, env: dict | None = None) -> int:
        """Submits a job (``--parsable``); returns its id. ``env`` adds to the
        environment the job inherits (sbatch's default --export=ALL)."""
        out = self.run("sbatch", "--parsable", *args, env=env).stdout.strip()
        return int(out.split(";")[0])

    def squeue(self) -> list[str]:
        proc = self.run("squeue", "-h", "-o", "%i %T %N", check=False)
        return proc.stdout.split("\n") if proc.returncode == 0 and proc.stdout.strip() else []

    def job(self, job_id: int) -> dict[str, str]:
        return _parse(self.scontrol("show", "job", str(job_id)).stdout)

    def node(self, name: str) -> dict[str, str]:
        return _parse(self.scontrol("show", "node", name).stdout)

    def hostnames(self, nodelist: str) -> list[str]:
        return self.scontrol("show", "hostnames", nodelist).stdout.split()

    def wait_job(self, job_id: int, timeout: float,
                 states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")) -> dict:
        """The job's record once its state is one of ``states`` (default: ended)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after "
                           f"{timeout} s\n{self.logs()}")

    def wait_nodes_idle(self, names: list[str], timeout: float = 60) -> None:
        def idle():
            return all(self.node(n).get("State", "").split("+")[0] == "IDLE" for n in names)
        self._until(idle, f"nodes {names} to be IDLE", timeout)

    def job_processes(self, job_id: int, node: str | None = None) -> list[int]:
        """Live processes of a job (on one fake node), by the SLURM_JOB_ID and
        SLURMD_NODENAME every step process inherits."""
        found = []
        for pid in _pids():
            env = _environ(pid)
            if env.get("SLURM_JOB_ID") == str(job_id) and (
                    node is None or env.get("SLURMD_NODENAME") == node):
                try:  # a zombie has no environ worth counting, but be exact
                    state = process_state(f"/proc/{pid}/stat")
                except OSError:
                    continue
                if state != "Z":
                    found.append(pid)
        return found

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for f in sorted((self.base / "log").glob("*")):
            if f.suffix == ".out" and f.with_suffix(".log").exists():
                continue  # the daemon's stderr repeats its log file
            text = f.read_text(errors="replace")[-tail:] if f.is_file() else ""
            if text.strip():
                parts.append(f"--- {f.name}\n{text}")
        return "\n".join(parts)


@pytest.fixture
def slurm_cluster() -> Iterator:
    """A factory: ``slurm_cluster(nodes=4)`` starts a cluster, torn down after the test."""
    problem = slurm_problem()
    if problem:
        unavailable(problem)
    made: list[SlurmCluster] = []

    def make(nodes: int = 4, cpus: int = 2, kill_wait: int = 5) -> SlurmCluster:
        cluster = SlurmCluster(nodes, cpus, kill_wait)
        made.append(cluster)
        return cluster.start()
    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()
