"""Several "nodes" on one machine: a rendezvous store and one ``llmtrain launch`` per node,
each node with its own name and its own process tree, so that a node can be killed whole.
On loopback by default; with a :class:`~llmtrain.chaos.netns.Network`, each node has a
network namespace, address and hostname of its own, and the store sits on the bridge
between them, so that a node can also be cut off or given a bad link. The elastic tests,
the recovery benchmark and chaos runs use it."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from llmtrain.chaos.netns import Network
from llmtrain.chaos.processes import kill_marked, kill_tree, stop
from llmtrain.distributed.process_group import free_port
from llmtrain.distributed.signed_store import SECRET_ENV, new_secret

# in the environment of every process a cluster starts (and so of all they start): what
# ``close`` sweeps for, whatever became of the tree that started it
MARKER_ENV = "LLMTRAIN_LOCAL_CLUSTER"


class LocalCluster:
    """A rendezvous store and a node launcher per name, on this machine; ``close`` ends
    every process any of them started."""

    def __init__(self, workdir: Path, run_dir: Path, nnodes: str, train_args: tuple[str, ...],
                 *, max_restarts: int = 3, env: dict | None = None,
                 network: Network | None = None):
        self.workdir, self.run, self.nnodes = workdir, run_dir, nnodes
        self.train_args, self.max_restarts = train_args, max_restarts
        self.network = network
        self.address = network.hub_address if network else "127.0.0.1"  # the store's
        self.port = free_port()
        self.marker = uuid.uuid4().hex
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    **(env or {}), MARKER_ENV: self.marker}
        # the job's secret, as a scheduler's job script gives it to every node
        self.env.setdefault(SECRET_ENV, new_secret())
        if network:  # gloo's sockets on the node's own link, not its loopback
            self.env["GLOO_SOCKET_IFNAME"] = "eth0"
        self.store = self._serve()
        self.nodes: dict[str, subprocess.Popen] = {}

    def _serve(self) -> subprocess.Popen:
        """The rendezvous store's process (``llmtrain rdzv-store``), on the cluster's
        address and port: in the hub's namespace when the nodes have their own. It says
        one line on stdout once it serves (and nothing more: it stays in the pipe)."""
        argv = [sys.executable, "-m", "llmtrain", "rdzv-store", "--bind", self.address,
                "--port", str(self.port)]
        return subprocess.Popen(self.network.in_hub(argv) if self.network else argv,
                                env=self.env, stdout=subprocess.PIPE, text=True)

    def restart_store(self, down_s: float = 3.0, timeout: float = 60) -> None:
        """The store's process dies at once (SIGKILL: every key it held is gone, every
        connection to it reset) and, ``down_s`` later, a new one serves on the same
        address and port, empty, as a store restarted by its supervisor would. Returns
        once the new one serves. (Its listening socket is bound with SO_REUSEADDR, so
        the old one's connections, closed by the kernel, do not keep the port.)"""
        self.store.kill()
        self.store.wait()
        time.sleep(down_s)
        self.store = self._serve()
        ready, _, _ = select.select([self.store.stdout], [], [], timeout)
        line = self.store.stdout.readline() if ready else ""
        if not line.startswith("llmtrain rdzv-store: serving"):
            raise RuntimeError(f"the rendezvous store did not serve again on {self.address}:"
                               f"{self.port} within {timeout:g} s (exit {self.store.poll()})")

    def start(self, name: str, *extra: str, env: dict | None = None,
              spare: bool = False) -> subprocess.Popen:
        """Starts node ``name``'s launcher (``spare``: on standby); ``extra`` are more
        training overrides."""
        log = open(self.workdir / f"{name}.log", "a")  # a node started again keeps its past
        argv = [sys.executable, "-m", "llmtrain", "launch", "--nnodes", self.nnodes,
                "--rdzv-endpoint", f"{self.address}:{self.port}", "--external-store",
                "--rdzv-id", "local", "--host", name, "--max-restarts", str(self.max_restarts),
                *(["--standby"] if spare else []),
                "--training.run_dir", str(self.run), *self.train_args, *extra]
        if self.network:
            self.network.add(name)
            argv = self.network.command(name, argv)
        proc = subprocess.Popen(argv, env={**self.env, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes[name] = proc
        return proc

    def store_client(self, timeout: float = 30) -> dist.TCPStore:
        """A client of the rendezvous store, for the harness (opened from the hub when
        the nodes have namespaces)."""
        def connect() -> dist.TCPStore:
            return dist.TCPStore(self.address, self.port, is_master=False, use_libuv=True,
                                 timeout=timedelta(seconds=timeout))
        return self.network.from_hub(connect) if self.network else connect()

    def kill(self, name: str) -> None:
        """The node dies: its launcher, agent and workers at once."""
        kill_tree(self.nodes[name].pid)

    def wait(self, name: str, timeout: float = 300) -> int:
        try:
            return self.nodes[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout} s\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text()[-4000:]

    def close(self) -> None:
        """Ends every node (launcher, agent, workers), whatever any of them started that
        outlived it (a worker whose launcher died first), and the store."""
        for name, proc in self.nodes.items():
            if proc.poll() is None:
                self.kill(name)
            proc.wait()
        stop(self.store)
        kill_marked(MARKER_ENV, self.marker)
