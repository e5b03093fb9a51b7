"""The node launcher: what every launch path (Slurm, torchx, a shell) runs on each node.

``llmtrain launch`` does, in order:

1. **Preflight**: the config and its overrides must validate at every world size the job
   may run at (each node count from MIN to MAX), and the data must open. A FATAL error
   here exits 78 before torchrun starts, so a bad config never becomes a restart loop, nor
   a shrink to a size it cannot train at a FATAL hours in.
2. **Health gate**: the node's checks (``llmtrain health --gate``). A fatal finding, or an
   exclusion recorded earlier in the run's ``excluded_hosts.json``, exits 76: the node
   never joins the rendezvous, and a spare takes its place.
3. **torchrun** with the elastic agent: c10d rendezvous (``--nnodes MIN:MAX``; extra nodes
   started beyond MAX wait as spares and are admitted when a node fails), restarts up to
   ``--max-restarts``, and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so that each round gets
   a fresh store: with torch 2.13's shared store, a node joining a running job (a spare)
   deadlocks (pytorch/pytorch#135712). The rendezvous store can live in its own process
   (``llmtrain rdzv-store``, ``--external-store``), so that losing any training node,
   including the first, leaves the rendezvous up.
4. **Exit code** for the scheduler: 0 when training finished, 76 when this node was
   excluded (by the gate or by a rank's health monitor), 78 when a rank hit a FATAL error,
   else 75 (retryable: requeue).

Workers that exit FATAL or EXCLUDE_NODE stop their own agent (``worker.stop_agent``), since
torchrun restarts workers whatever their exit code; the other nodes' agents then form a
new round without this node.

**Spares wait outside the rendezvous** (``--standby``) and join only when a round is
short of nodes. In torch 2.13, a spare sitting in the rendezvous while a rank (not its
whole node) fails makes the agents restart for ever: after the restart one of the three
lands in the round's wait list, the others see a "new node" and restart to admit it, and
so on. A standby launcher reads the rendezvous state from the store instead, and joins
when a round has waited for nodes for ``STANDBY_GRACE_S``: a node is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass

from llmtrain.config import ConfigError, JobConfig
from llmtrain.distributed.nccl_env import warm_worker_env
from llmtrain.distributed.signed_store import (SECRET_ENV, job_secret, new_secret,
                                               report_forged_to, require_secret)
from llmtrain.events import EventLog, EventTail
from llmtrain.exit_codes import ExitCode
from llmtrain.reliability.health.exclusion import excluded_hosts
from llmtrain.reliability.health.gate import run_gate

log = logging.getLogger(__name__)


@dataclass
class LaunchConfig:
    nnodes: str = "1"             # N or MIN:MAX, torchrun's syntax
    nproc_per_node: int = 1
    rdzv_endpoint: str = "127.0.0.1:29400"
    rdzv_id: str = "llmtrain"
    max_restarts: int = 3
    external_store: bool = False  # the endpoint is an `llmtrain rdzv-store`, not an agent
    host: str = ""                # the node's name in exclusion records (default: hostname)
    standby: bool = False         # a spare: wait outside the rendezvous until one is short
    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 5.0
    monitor_interval_s: float = 1.0
    script: str = ""              # a training script of the user's (it calls llmtrain.start)

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes of ``nnodes``; N is N:N."""
        lo, _, hi = self.nnodes.partition(":")
        return int(lo), int(hi or lo)

    @property
    def world_sizes(self) -> list[int]:
        """Every world size the job may run at: a node lost without a spare shrinks it by
        one node, down to MIN."""
        lo, hi = self.node_range
        return [n * self.nproc_per_node for n in range(lo, hi + 1)]


def preflight(cfg: JobConfig, lc: LaunchConfig) -> None:
    """Raises ConfigError/ShardError for a config or data that no restart would fix. The
    config must validate at every world size the job may run at, not only its ends: a
    global batch that 2 and 8 ranks divide but 6 do not ends a shrink to 6 FATAL."""
    tp = cfg.parallelism.tp
    if lc.nproc_per_node % tp:
        raise ConfigError(
            f"parallelism.tp={tp} does not divide --nproc-per-node={lc.nproc_per_node}: a "
            f"tensor-parallel group would span nodes, and its collectives (several in every "
            f"block) would cross the network; set parallelism.tp to a divisor of "
            f"{lc.nproc_per_node}")
    # a script of the user's trains its own model on its own data: the settings only
    check = cfg.settings().validate if lc.script else cfg.validate
    failures = {}
    for world in lc.world_sizes:
        try:
            check(world)
        except ConfigError as e:
            failures[world] = str(e)
    if failures:
        raise ConfigError(_unfit(cfg, lc, failures))
    if lc.script:
        return
    from llmtrain.data import TokenDataset, shard_urls
    TokenDataset(shard_urls(cfg.data, cfg.training.run_dir), cfg.data.seq_len)


def _unfit(cfg: JobConfig, lc: LaunchConfig, failures: dict[int, str]) -> str:
    """One line for the operator: the world sizes the config cannot train at, why at the
    first, and the values that fit every size (or the node counts that fit as it is)."""
    sizes = lc.world_sizes
    reasons = set(failures.values())
    if len(failures) == len(sizes) and len(reasons) == 1:
        return reasons.pop()  # wrong at any world size
    first = min(failures)
    fixes = []
    if not lc.script and any(_fails(cfg.accumulation_steps, w) for w in sizes):
        per_step = math.lcm(*(cfg.training.micro_batch_size * (w // cfg.parallelism.tp)
                              for w in sizes))
        fixes.append(f"training.global_batch_size="
                     f"{-(-cfg.training.global_batch_size // per_step) * per_step} "
                     f"(a multiple of {per_step})")
    if any(_fails(cfg.mesh_shape, w) for w in sizes):
        p = cfg.parallelism
        if p.dp_replicate == -1:  # replicas of a fixed size: it must divide every size
            fixes.append(f"parallelism.dp_shard={math.gcd(*sizes)} (or a divisor of it)")
        else:
            if p.dp_shard != -1:
                fixes.append("parallelism.dp_shard=-1")
            if any(w % p.dp_replicate for w in sizes):
                fixes.append(f"parallelism.dp_replicate={math.gcd(*sizes)} (or a divisor of it)")
    fits = [w // lc.nproc_per_node for w in sizes if w not in failures]
    remedies = ([f"set {' and '.join(fixes)}"] if fixes else []) + (
        [f"narrow --nnodes to node counts it fits: {fits}"] if fits else [])
    return (f"--nnodes {lc.nnodes} x --nproc-per-node {lc.nproc_per_node} lets the job run "
            f"at world sizes {sizes}, but the config cannot train at {sorted(failures)} "
            f"(at {first}: {failures[first]}); to fit every size, " + ", or ".join(remedies))


def _fails(check, world: int) -> bool:
    try:
        check(world)
    except ConfigError:
        return True
    return False


def torchrun_command(lc: LaunchConfig, train_args: list[str], warm: bool = False) -> list[str]:
    """torchrun's command line (``warm``: with the agent that lets the warm path replace
    a dead worker, ``llmtrain.launch.agent``)."""
    conf = (f"join_timeout={lc.join_timeout_s:.0f},last_call_timeout={lc.last_call_timeout_s:.0f},"
            f"keep_alive_interval=2,keep_alive_max_attempt=3")
    if lc.external_store:
        conf += ",is_host=0"
    agent = "llmtrain.launch.agent" if warm else "torch.distributed.run"
    return [sys.executable, "-m", agent, f"--nnodes={lc.nnodes}",
            f"--nproc-per-node={lc.nproc_per_node}", f"--max-restarts={lc.max_restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={lc.rdzv_endpoint}",
            f"--rdzv-id={lc.rdzv_id}", f"--rdzv-conf={conf}",
            f"--monitor-interval={lc.monitor_interval_s:g}",
            *worker_command(lc)[1:], *train_args]


def worker_command(lc: LaunchConfig) -> list[str]:
    """A worker's command, before its arguments: the user's script, or llmtrain's own
    trainer (``llmtrain train``)."""
    return [sys.executable, lc.script] if lc.script else [sys.executable, "-m", "llmtrain", "train"]


def launch(cfg: JobConfig, lc: LaunchConfig, train_args: list[str]) -> int:
    """Runs this node until the job ends for it; returns its exit code. With an external
    store, holds a lease on it meanwhile (:mod:`llmtrain.launch.store`)."""
    from llmtrain.launch.store import Lease  # imports torch: not at the CLI's start
    lease = Lease(lc.rdzv_endpoint) if lc.external_store else None
    try:
        return _launch(cfg, lc, train_args)
    finally:
        if lease is not None:
            lease.release()


def _launch(cfg: JobConfig, lc: LaunchConfig, train_args: list[str]) -> int:
    # first: a job that ends while the preflight and the gate run ended after this
    # launcher came (a standby that started then waited for an end it had missed)
    started = time.time()
    host = lc.host or socket.gethostname()
    run_dir = cfg.training.run_dir
    preflight(cfg, lc)
    ensure_secret(lc)
    gate = run_gate(cfg, host)
    if gate != ExitCode.CLEAN:
        return gate
    events = EventLog(run_dir, rank=None)
    report_forged_to(events)
    off = warm_off_reason(cfg, lc, worker_env(cfg, lc, host))
    if off:  # said once, here; the workers then go cold without saying it again
        log.warning("llmtrain launch: warm recovery is off: %s", off)
        events.emit("warm_path_off", host=host, reason=off)
        cfg.warm.enable = False
        train_args = [*train_args, "--warm.enable", "false"]
    vacancy = False  # a cold restart's round lacks a node, and this one holds its place
    if lc.standby and cfg.warm.enable and lc.external_store:
        events.emit("node_launch", host=host, nnodes=lc.nnodes, rdzv_id=lc.rdzv_id, spare="warm")
        # Waits warm; takes a lost rank's place in the running job. If the warm path
        # fails, the job restarts cold and this node joins that as a standby; if the rank
        # it took was not replaced when the job went cold, it joins the restart as a node.
        rc, signalled, rejoin = serve_warm(cfg, lc, host, train_args, started)
        vacancy = rc is None or rejoin
        code = None if vacancy else (
            ExitCode.EXCLUDE_NODE if host in excluded_hosts(run_dir) else ExitCode.CLEAN
            if rc == ExitCode.CLEAN or finished(EventTail(
                run_dir, keep=frozenset({"run_end"})).read(), cfg.training.steps, started)
            else ExitCode.RETRYABLE if signalled  # preempted: leave
            else None)  # its rank was lost and replaced: a standby for a restart
        if code is not None:
            events.emit("node_exit", host=host, spare_exit=rc, exit_code=int(code))
            events.close()
            return code
    if lc.standby and not vacancy and not await_vacancy(
            standby_vacancies(cfg, lc), run_dir, cfg.training.steps, started):
        events.emit("spare_released", host=host)
        events.close()
        return ExitCode.CLEAN  # the job finished without needing this spare
    env = worker_env(cfg, lc, host)
    events.emit("node_launch", host=host, nnodes=lc.nnodes, rdzv_id=lc.rdzv_id)
    warm = cfg.warm.enable and "LLMTRAIN_RDZV_ENDPOINT" in env
    proc = subprocess.Popen(torchrun_command(lc, train_args, warm), env=env)
    forward_signals(proc)
    rc = _wait_agent(proc, run_dir, cfg.training.steps, started)
    code = _outcome(rc, run_dir, host, started, cfg.training.steps)
    events.emit("node_exit", host=host, torchrun_exit=rc, exit_code=int(code))
    events.close()
    return code


def ensure_secret(lc: LaunchConfig, env: MutableMapping[str, str] = os.environ) -> None:
    """Makes sure this node's launcher and workers hold the job's secret, with which
    every control key in the rendezvous store is signed
    (:mod:`llmtrain.distributed.signed_store`). The scheduler's job script gives it, the
    same on every node; a launcher that is its job's only one (one node, no spare) makes
    its own. The workers' watchdogs meet in the store at ``--rdzv-endpoint`` whether or
    not it is external, so every launched job signs. ConfigError when several launchers
    must share one that nobody gave."""
    if job_secret(env) is not None:
        return
    if lc.node_range[1] > 1 or lc.standby:
        require_secret(env)  # raises, naming what to set
    env[SECRET_ENV] = new_secret()


def warm_off_reason(cfg: JobConfig, lc: LaunchConfig, env: dict[str, str]) -> str:
    """Why the warm path, on by default, cannot work for this node's workers, with what to
    change (empty when it can, or when the user turned it off)."""
    if not cfg.warm.enable:
        return ""
    if lc.node_range[1] == 1:
        return ("the job has one node: a lost rank's snapshot has no replica on another "
                "node to come back from (--warm.enable false silences this)")
    if not lc.external_store or "LLMTRAIN_RDZV_ENDPOINT" not in env:
        return ("the rendezvous store lives in torchrun's agents and dies with a node; run "
                "`llmtrain rdzv-store` on a host that does not train and pass "
                "--rdzv-endpoint HOST:PORT --external-store (or --warm.enable false)")
    from llmtrain.distributed.process_group import backend_for, device_type
    p = cfg.parallelism
    if backend_for(p, device_type(p)) != "nccl":
        return ""
    from llmtrain.distributed.failure import nccl_problems
    problems = nccl_problems(env)
    return "; ".join(problems) + " (or --warm.enable false)" if problems else ""


def worker_env(cfg: JobConfig, lc: LaunchConfig, host: str) -> dict[str, str]:
    """The environment of this node's workers (torchrun's agent passes it on) or of its
    warm spare. With the warm path on, the process-group settings it needs are set where
    the user has not set them (:func:`llmtrain.distributed.failure.warm_worker_env`)."""
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LLMTRAIN_HOST": host,
           "LLMTRAIN_RDZV_ID": lc.rdzv_id, "LLMTRAIN_WARM_BUDGET_S": str(cfg.warm.budget_s),
           "LLMTRAIN_RUN_DIR": cfg.training.run_dir,  # where the agent reports to
           # how far a warm shrink and grow may go
           "LLMTRAIN_MIN_NODES": str(lc.node_range[0]),
           "LLMTRAIN_MAX_NODES": str(lc.node_range[1])}
    if not lc.rdzv_endpoint.endswith(":0"):  # port 0: the agent picks one we cannot know
        env["LLMTRAIN_RDZV_ENDPOINT"] = lc.rdzv_endpoint  # the watchdogs meet there
    if cfg.warm.enable and "LLMTRAIN_RDZV_ENDPOINT" in env:
        warm_worker_env(env)
    return env


def forward_signals(proc: subprocess.Popen) -> list[int]:
    """A scheduler's SIGTERM (preemption, scancel) or USR1 goes on to ``proc`` (the agent,
    which passes it to the workers, or a warm spare's worker): they save, then exit
    RETRYABLE. Slurm signals every process of a step itself, so there it is not passed on
    a second time. Returns the signals received, as they come."""
    received: list[int] = []

    def forward(signum, _frame) -> None:
        received.append(signum)
        proc.send_signal(signum)
    if "SLURM_STEP_ID" not in os.environ:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, forward)
    return received


def _outcome(rc: int, run_dir: str, host: str, since: float, steps: int) -> ExitCode:
    if host in excluded_hosts(run_dir):
        return ExitCode.EXCLUDE_NODE
    if rc == 0:
        return ExitCode.CLEAN
    ended = EventTail(run_dir, keep=frozenset({"fatal", "run_end"})).read()
    if any(e["event"] == "fatal" and e["ts"] >= since for e in ended):
        return ExitCode.FATAL
    # A node left waiting when the job ended: torch 2.13's agent fails on that, but the
    # job is done.
    return ExitCode.CLEAN if finished(ended, steps, since) else ExitCode.RETRYABLE


STANDBY_GRACE_S = 3.0
# After the run's end, how long an agent may take to exit before it is stopped.
EXIT_GRACE_S = 10.0


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout.split()
    return [int(p) for p in out]


def _wait_agent(proc: subprocess.Popen, run_dir: str, steps: int, since: float) -> int:
    """torchrun's exit code. An agent whose workers finished waits in torchrun's exit
    barrier for the round's other agents, for 300 s, in a call no signal interrupts; after
    a warm recovery replaced a lost node, that node's agent never comes. So once the run
    has ended and this agent's workers are gone, the agent is killed."""
    ends = EventTail(run_dir, keep=frozenset({"run_end"}))
    ended_at = None
    while (rc := proc.poll()) is None:
        time.sleep(1.0)
        if ended_at is None and finished(ends.read(), steps, since):
            ended_at = time.monotonic()
        if (ended_at is not None and time.monotonic() - ended_at > EXIT_GRACE_S
                and not child_pids(proc.pid)):
            proc.kill()
            return proc.wait()
    return rc


class Vacancies:
    """The job's rendezvous as a spare sees it. A round is short when it has waited for
    nodes for ``STANDBY_GRACE_S`` (forming with fewer than the minimum, or running with
    fewer than the maximum); a spare takes a ticket for its place, so that no more spares
    join a round than it lacks nodes. ``restarts_only``: only a restart's round counts
    (not the first, whose nodes may still be starting, nor a running one, which a warm
    recovery may have left with a dead node's agent missing)."""

    def __init__(self, lc: LaunchConfig, restarts_only: bool = False):
        self.endpoint, self.timeout_s = lc.rdzv_endpoint, lc.join_timeout_s
        self.rdzv_id, self.restarts_only = lc.rdzv_id, restarts_only
        self._connect()
        self.min_nodes, self.max_nodes = lc.node_range
        self.short_since: float | None = None
        self.refused: str | None = None  # the round whose places other spares took

    def client(self):
        """A new client of the rendezvous store."""
        import datetime

        import torch.distributed as dist
        host, _, port = self.endpoint.rpartition(":")
        return dist.TCPStore(host, int(port), is_master=False, use_libuv=True,
                             timeout=datetime.timedelta(seconds=self.timeout_s))

    def _connect(self) -> None:
        """Connects (again: a TCPStore client whose server restarted stays broken)."""
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )
        self.store = self.client()
        self.backend = C10dRendezvousBackend(self.store, self.rdzv_id)
        self.broken = False

    def _missing(self):
        """(the round's ticket key, nodes it lacks) or None."""
        got = self.backend.get_state()
        state = rendezvous_state(got[0]) if got else None
        if state is None or state.closed or (self.restarts_only and state.round == 0):
            return None
        have = len(state.participants)
        lack = (self.min_nodes - have if not state.complete and have else
                self.max_nodes - have if state.complete and not self.restarts_only else 0)
        return (f"llmtrain/vacancy/{self.rdzv_id}/{state.round}/{have}", lack) if lack > 0 \
            else None

    def claim(self) -> bool:
        """True once a round has been short for the grace and this spare holds one of
        the places it lacks. A store error is raised; the next call connects again."""
        if self.broken:
            self._connect()
        try:
            missing = self._missing()
        except store_errors():
            self.broken = True
            raise
        now = time.monotonic()
        self.short_since = (self.short_since or now) if missing else None
        if not missing or now - self.short_since < STANDBY_GRACE_S or missing[0] == self.refused:
            return False
        key, lack = missing
        try:
            ticket = self.store.add(key, 1)
        except store_errors():
            self.broken = True
            raise
        if ticket <= lack:
            return True
        self.refused = key
        return False


def store_errors() -> tuple[type[BaseException], ...]:
    """What a request to the rendezvous store raises when the store is out (stalled,
    restarting, gone): torch's DistError (a RuntimeError), a socket's OSError, and
    torchrun's RendezvousError for requests through its rendezvous backend."""
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    return (RuntimeError, OSError, RendezvousError)


class _StoreOutage:
    """Says once an outage, in a log line, that the rendezvous store is out (and once that
    it is back), where a launcher looks at the store every half second."""

    def __init__(self, who: str):
        self.who, self.out = who, False

    def failed(self, error: BaseException) -> None:
        if not self.out:
            log.warning("%s: the rendezvous store is out (%s: %s); waiting for it",
                        self.who, type(error).__name__, str(error).splitlines()[0][:200])
        self.out = True

    def answered(self) -> None:
        if self.out:
            log.warning("%s: the rendezvous store answers again", self.who)
        self.out = False


class _RendezvousStateOnly(pickle.Unpickler):
    """torchrun keeps its rendezvous state in the store as a pickle, which anyone who
    reaches the store's port can replace: read here, it may build torch's state classes
    and datetimes, nothing else (a pickle that names any other callable is refused)."""

    ALLOWED = {("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
               ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
               ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it asks for {module}.{name}")
        return super().find_class(module, name)


def rendezvous_state(data: bytes):
    """torchrun's rendezvous state from its pickle in the store; None (said in a log line)
    when it is not one, such as a value a stranger wrote there to run code."""
    try:
        return _RendezvousStateOnly(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any malformed pickle: not torch's state
        log.warning("the rendezvous state in the store is not torchrun's (%s): ignored", e)
        return None


def standby_vacancies(cfg: JobConfig, lc: LaunchConfig) -> Vacancies:
    """The rounds a standby joins. A warm job's running round lacks a node after every
    warm recovery (the lost node's agent, whose rank a warm spare took): joining it would
    restart every rank cold, so there only a restart's round counts. Chaos caught a warm
    spare whose rank was lost doing that, when its launcher went on as a plain standby."""
    return Vacancies(lc, restarts_only=cfg.warm.enable and lc.external_store)


def await_vacancy(vacancies: Vacancies, run_dir: str, steps: int, since: float) -> bool:
    """Waits, as a spare, until the job's rendezvous is short of nodes (True), or the job
    has finished (False)."""
    ends = EventTail(run_dir, keep=frozenset({"run_end"}))  # each poll reads what is new
    outage = _StoreOutage("standby")
    while True:
        try:
            if vacancies.claim():
                return True
            outage.answered()
        except store_errors() as e:
            outage.failed(e)
        if finished(ends.read(), steps, since):
            return False
        time.sleep(0.5)


def serve_warm(cfg: JobConfig, lc: LaunchConfig, host: str, train_args: list[str],
               since: float) -> tuple[int | None, list[int], bool]:
    """A warm spare: ``llmtrain spare`` imports torch and builds the model once, then waits
    for a plan on its stdin, while this launcher holds its place in the job's pool and
    hands it the plan that assigns it a lost rank. It joins the pool at once (a lost rank is
    better off waiting for its imports than going cold) and says when it is ready, seconds
    later: a grow waits for that (its survivors waited 3 s for a spare's imports, not 0.3).
    Returns the spare's exit code, the signals forwarded to it, and whether this node must
    join a cold restart as a node, as an agent would restart its worker: the rank it took
    ended and the warm path did not replace it (once every rank ran in a spare, the job
    waited for a restart that nobody started). The code is CLEAN if the job finished
    without it, and None when a cold restart's round lacks a node (the warm path could
    not replace one): the spare left the pool, and this node holds a place in that
    round."""
    from llmtrain.recovery.eviction import EvictionWatch
    from llmtrain.recovery.pool import PoolPlace, assignment, leave_pool
    from llmtrain.recovery.roll_call import owner
    from llmtrain.recovery.verdicts import Verdicts
    from llmtrain.recovery.warm import job_namespace
    vacancies = Vacancies(lc, restarts_only=True)
    pool = job_namespace(vacancies.store, lc.rdzv_id, reconnect=vacancies.client)
    ready, says_ready = os.pipe()
    # in a session of its own, as torchrun's workers are: an eviction kills its children too
    command = worker_command(lc) if lc.script else [sys.executable, "-m", "llmtrain", "spare"]
    spare = subprocess.Popen([*command, *train_args],
                             stdin=subprocess.PIPE, text=True, start_new_session=True,
                             env={**worker_env(cfg, lc, host), "LLMTRAIN_SPARE": "1",  # see llmtrain.start
                                  "LLMTRAIN_SPARE_READY_FD": str(says_ready)},
                             pass_fds=(says_ready,))
    os.close(says_ready)
    signalled = forward_signals(spare)  # once it holds a rank, preemption must reach it
    place = PoolPlace(pool, cfg.warm.budget_s)
    vacancy, outage = False, _StoreOutage("warm spare")
    ends = EventTail(cfg.training.run_dir, keep=frozenset({"run_end"}))
    looked = time.monotonic()
    with open(ready, "rb", buffering=0) as ready:
        while spare.poll() is None:
            if select.select([ready], [], [], 0)[0] and ready.read(64):
                place.ready = True
            try:
                place.keep()  # in the pool, ready when the spare is, after a restart too
                plan = assignment(pool, place.number)
                outage.answered()
            except store_errors() as e:  # no plan can come meanwhile: look again
                outage.failed(e)
                if finished(ends.read(), cfg.training.steps, since):  # the job ended
                    spare.stdin.close()  # without it, and without its store perhaps
                    spare.wait()
                    return ExitCode.CLEAN, signalled, False
                time.sleep(0.5)
                continue
            if plan is not None:
                holder = owner(spare.pid, host)
                evictions = EvictionWatch(pool, [holder])
                verdicts = Verdicts(pool, [holder], cfg.warm.budget_s)
                try:
                    spare.stdin.write(json.dumps(plan) + "\n")
                    spare.stdin.close()
                except BrokenPipeError:  # it died just now: the survivors go cold in budget
                    pass
                rc = supervise_spare(spare, evictions)
                ended = rc in (ExitCode.CLEAN, ExitCode.FATAL, ExitCode.EXCLUDE_NODE)
                return rc, signalled, not (ended or signalled) and (
                    rc == ExitCode.RETRYABLE or not _replaced(verdicts, holder))
            if time.monotonic() - looked > 0.5:
                looked = time.monotonic()
                done = finished(ends.read(), cfg.training.steps, since)
                try:
                    vacancy = vacancy or (not done and vacancies.claim())  # a ticket, held
                    if (done or vacancy) and place.leave():
                        spare.stdin.close()  # end of input: the spare exits CLEAN
                        spare.wait()
                        return (ExitCode.CLEAN if done else None), signalled, False
                except store_errors() as e:
                    outage.failed(e)
            time.sleep(0.05)
    with contextlib.suppress(*store_errors()):  # it died waiting (a signal): no survivor
        leave_pool(pool, place.number)  # may count on it
    return spare.returncode, signalled, False


def _replaced(verdicts, holder: str) -> bool:
    """The warm path's verdict on the rank a spare held; a store that is out gives none,
    and this node joins the cold restart, as a dead worker's agent would restart it."""
    try:
        return verdicts.replaced(holder)
    except store_errors() as e:
        _StoreOutage("warm spare's launcher").failed(e)
        return False


def supervise_spare(spare: subprocess.Popen, evictions) -> int:
    """Waits for a spare that took a rank, doing for it what an agent does for its
    workers: it is killed when a hang's watchdog asks (:func:`llmtrain.recovery.eviction.evict`;
    without this, a stopped spare went unanswered and its peers cut a later one)."""
    outage = _StoreOutage("warm spare's launcher")
    while (rc := spare.poll()) is None:
        try:
            asked = evictions.asked()
            outage.answered()
        except store_errors() as e:  # nobody can ask while the store is out
            outage.failed(e)
            asked = []
        for holder in asked:  # it watches this spare alone
            with contextlib.suppress(*store_errors()):  # killed first, then said
                evictions.kill(holder, spare.pid)
            return spare.wait()
        time.sleep(0.1)
    return rc


def finished(events: list[dict], steps: int, since: float) -> bool:
    """The run has ended since ``since``: at its last step, or early on a stop request."""
    return any(e["event"] == "run_end" and e["ts"] >= since
               and (e["steps"] == steps or e.get("stopped")) for e in events)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LaunchConfig()
    p.add_argument("--nnodes", default=d.nnodes, help="N, or MIN:MAX for an elastic job")
    p.add_argument("--nproc-per-node", type=int, default=d.nproc_per_node)
    p.add_argument("--rdzv-endpoint", default=d.rdzv_endpoint)
    p.add_argument("--rdzv-id", default=d.rdzv_id)
    p.add_argument("--max-restarts", type=int, default=d.max_restarts)
    p.add_argument("--external-store", action="store_true",
                   help="the endpoint is an `llmtrain rdzv-store` process")
    p.add_argument("--host", default="", help="this node's name (default: the hostname)")
    p.add_argument("--standby", action="store_true",
                   help="a spare: join only when the job's rendezvous is short of nodes")
    p.add_argument("--script", default="",
                   help="run this training script of yours (it calls llmtrain.start; it "
                        "gets --config and the overrides) instead of llmtrain's trainer")


def from_args(args: argparse.Namespace) -> LaunchConfig:
    return LaunchConfig(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                        rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                        max_restarts=args.max_restarts, external_store=args.external_store,
                        host=args.host, standby=args.standby, script=args.script)
