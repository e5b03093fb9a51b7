import os
import secrets
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

import needs
from llmtrain.distributed.process_group import free_port
from llmtrain.events import EventTail, read_events

ROOT = Path(__file__).resolve().parent.parent

# The job's secret, as a scheduler's job script gives it to every node (every launcher,
# worker and spare the tests start inherits it); tests of a missing one clear it.
os.environ.setdefault("LLMTRAIN_JOB_SECRET", secrets.token_hex(32))


def signed_store(store=None, context: str = "test", reconnect=None):
    """A view of ``store`` (default: a new HashStore) with values signed by the tests' job
    secret, as llmtrain's components get theirs."""
    import torch.distributed as dist

    from llmtrain.distributed.signed_store import signed
    return signed(store if store is not None else dist.HashStore(), context,
                  reconnect=reconnect)


STORE_AT = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      use_libuv=True)
print("up", flush=True)
time.sleep(300)
"""


class RestartableStore:
    """A store in a process of its own, on a port that stays the same when it is killed
    (SIGKILL) and started again: empty, as a restarted ``llmtrain rdzv-store`` is."""

    def __init__(self):
        from llmtrain.distributed.process_group import free_port
        self.port, self.proc = free_port(), None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", STORE_AT, str(self.port)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "up"

    def restart(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.start()

    def client(self):
        import torch.distributed as dist
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, use_libuv=True,
                             timeout=timedelta(seconds=1))

    def connect(self):
        """A signed view that connects again after a restart."""
        return signed_store(self.client(), reconnect=self.client)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def process_state(stat: str | Path) -> str:
    """The state letter (R, S, T, Z...) in a ``/proc/PID/stat`` or ``/proc/PID/task/TID/stat``
    file; OSError once the process or thread is gone."""
    return Path(stat).read_text().rpartition(")")[2].split()[0]


def sigstop(pid: int, within_s: float = 5.0) -> None:
    """SIGSTOPs ``pid`` and returns once every thread of it has stopped. The kernel wakes
    one thread for the signal and stops the others only once that one has run, so on a
    loaded machine a thread of the process can still answer a request sent just after the
    kill."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append(process_state(task / "stat"))
            except OSError:  # a thread that ended meanwhile
                continue
        if states and all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"pid {pid} has threads still running: {states}"
        time.sleep(0.01)


def llmtrain_command(run_dir: Path, *overrides: str, nproc: int | None = None,
                     max_restarts: int = 0, torchrun: bool = False, env: dict | None = None,
                     port: int | None = None) -> tuple[list[str], dict]:
    """The command line and environment of ``llmtrain train`` on the debug preset: alone,
    or with ``nproc`` ranks on one node through ``llmtrain launch`` (the path the docs give
    a job: the preflight, the exit codes, and one import for the node, its template forking
    torchrun's agent and the prepared workers that take the ranks), or with ``torchrun``
    through plain ``torchrun --standalone`` (each rank importing for itself). Both restart
    a failed attempt ``max_restarts`` times; exporters listen on loopback only. ``port``:
    the launcher's rendezvous port (None: a free one)."""
    train = ["--config", "debug_cpu", "--training.run_dir", str(run_dir),
             "--metrics.address", "127.0.0.1", *overrides]
    if not nproc:
        cmd = [sys.executable, "-m", "llmtrain", "train", *train]
    elif torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m",
               "llmtrain", "train", *train]
    else:  # a known port, as on a cluster: the watchdogs meet in the agent's store, which
        # outlives every rank (with port 0, in rank 0's)
        port = free_port() if port is None else port
        cmd = [sys.executable, "-m", "llmtrain", "launch", f"--nproc-per-node={nproc}",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--max-restarts={max_restarts}", *train]
    return cmd, {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}


def llmtrain(run_dir: Path, *overrides: str, timeout: float = 600,
             **kwargs) -> subprocess.CompletedProcess:
    """Runs ``llmtrain train`` to the end (see ``llmtrain_command``)."""
    cmd, env = llmtrain_command(run_dir, *overrides, **kwargs)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def llmtrain_start(run_dir: Path, *overrides: str, **kwargs) -> subprocess.Popen:
    """Starts ``llmtrain train`` in the background, for tests that act on a running job."""
    cmd, env = llmtrain_command(run_dir, *overrides, **kwargs)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)


def wait_for_event(run_dir: Path, name: str, proc: subprocess.Popen, timeout: float = 120,
                   where=lambda e: True) -> dict:
    """The first ``name`` event matching ``where``, once the running job has written it
    (each look reads only what was written since the last)."""
    deadline = time.monotonic() + timeout
    tail = EventTail(str(run_dir), keep=frozenset({name}))
    while time.monotonic() < deadline:
        found = [e for e in tail.read() if where(e)]
        if found:
            return found[0]
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job exited {proc.returncode} before a {name} event\n"
                                 f"{(out or '')[-2000:]}\n{(err or '')[-4000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {name} event within {timeout} s")


def events(run_dir: Path, name: str) -> list[dict]:
    return read_events(str(run_dir), name)


def step_losses(run_dir: Path) -> dict[int, float]:
    """The logged loss of every step; a step run twice (resumed) keeps its last value."""
    return {e["step"]: e["loss"] for e in events(run_dir, "step")}


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def pytest_configure(config: pytest.Config) -> None:
    """A skip under CI=true is a failure unless a mark declares it (see needs.py)."""
    config.pluginmanager.register(needs, "needs")


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A one-rank gloo process group in this process, and its 1-D device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"
from storage_fixtures import *  # noqa: E402,F401,F403  (bindfs_mount, faultfs, s3_url, ...)


@pytest.fixture
def cluster(tmp_path):
    """Makes local clusters (``LocalCluster``: "nodes" of ``llmtrain launch`` on loopback,
    or each in a network namespace of its own with ``network``) of the debug preset with
    the given training arguments; closes them, and their networks, after the test."""
    from llmtrain.chaos.local_cluster import LocalCluster
    made = []

    def make(nnodes: str, args: tuple[str, ...], **kwargs) -> LocalCluster:
        made.append(LocalCluster(tmp_path, tmp_path / "run", nnodes,
                                 ("--config", "debug_cpu", *args), **kwargs))
        return made[-1]
    yield make
    for c in made:
        c.close()
        if c.network is not None:
            c.network.close()
