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

**One import per node**: the launcher first starts the node's template process
(:mod:`llmtrain.launch.template`), which imports torch and llmtrain while the preflight and
the gate run; torchrun's agent, the prepared workers and the warm spares are forks of it.

**Spares wait outside the rendezvous** (``--standby``) and join only when a round is
short of nodes, or wait warm to take a lost rank's place (:mod:`llmtrain.launch.standby`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import subprocess
import time
from collections.abc import MutableMapping

from llmtrain import collector
from llmtrain.config import ConfigError, JobConfig
from llmtrain.distributed.signed_store import (SECRET_ENV, job_secret, new_secret,
                                               report_forged_to, require_secret)
from llmtrain.events import EventLog, EventTail
from llmtrain.exit_codes import ExitCode
from llmtrain.launch.children import child_pids, forward_signals, torchrun_command, worker_env
from llmtrain.launch.config import LaunchConfig
from llmtrain.launch.standby import await_vacancy, finished, serve_warm, standby_vacancies
from llmtrain.launch.template import Process, Spawn, Template, TemplateConfig
from llmtrain.process_origin import PREPARED_DIR_ENV
from llmtrain.reliability.health.exclusion import excluded_hosts
from llmtrain.reliability.health.gate import run_gate

log = logging.getLogger(__name__)


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


def launch(cfg: JobConfig, lc: LaunchConfig, train_args: list[str]) -> int:
    """Runs this node until the job ends for it; returns its exit code. With an external
    store, holds a lease on it meanwhile (:mod:`llmtrain.launch.store`)."""
    # first: its imports overlap the preflight and the gate
    template = Template(TemplateConfig(compiled=cfg.parallelism.compile,
                                       fp8=cfg.parallelism.fp8 != "none")) \
        if lc.template else None
    lease = None
    if lc.external_store:  # a client of the store: the launcher's one use of torch
        with collector.paused(freeze=True):
            from llmtrain.launch.store import Lease
        lease = Lease(lc.rdzv_endpoint)
    try:
        return _launch(cfg, lc, train_args, template.spawn if template else subprocess.Popen)
    finally:
        if lease is not None:
            lease.release()
        if template is not None:
            template.close()


def _launch(cfg: JobConfig, lc: LaunchConfig, train_args: list[str], spawn: Spawn) -> int:
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
        rc, signalled, rejoin = serve_warm(cfg, lc, host, train_args, started, spawn)
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
    env = worker_env(cfg, lc, host)
    warm = cfg.warm.enable and "LLMTRAIN_RDZV_ENDPOINT" in env
    # a standby's agent and prepared workers import while it waits: it joins a round as
    # soon as the round is short of it
    waits = lc.standby and not vacancy
    prepared = _prepare_workers(lc, env, cfg, spawn)
    try:
        proc = spawn(torchrun_command(
            lc, train_args, warm, prepared and prepared.folder, after_go=waits), env=env,
            stdin=subprocess.PIPE if waits else None)
        if waits and not _go(proc, await_vacancy(standby_vacancies(cfg, lc), run_dir,
                                                 cfg.training.steps, started)):
            events.emit("spare_released", host=host)
            events.close()
            return ExitCode.CLEAN  # the job finished without needing this spare
        events.emit("node_launch", host=host, nnodes=lc.nnodes, rdzv_id=lc.rdzv_id)
        forward_signals([proc])
        rc = _wait_agent(proc, run_dir, cfg.training.steps, started)
    finally:
        if prepared is not None:
            prepared.close()
    code = _outcome(rc, run_dir, host, started, cfg.training.steps)
    events.emit("node_exit", host=host, torchrun_exit=rc, exit_code=int(code))
    events.close()
    return code


def _go(agent: Process, join: bool) -> bool:
    """Tells a standby's waiting agent to join the job's rendezvous, or to end; ``join``."""
    with contextlib.suppress(BrokenPipeError):
        agent.stdin.write(b"go\n" if join else b"end\n")
        agent.stdin.close()
    if not join:
        agent.wait()
    return join


def _prepare_workers(lc: LaunchConfig, env: dict[str, str], cfg: JobConfig, spawn: Spawn):
    """Unless ``--no-prepared-workers``: this node's prepared workers, started now, beside the
    rendezvous (:mod:`llmtrain.launch.prepared`)."""
    if not lc.prepared_workers:
        return None
    from llmtrain.launch.prepared import PreparedConfig, PreparedWorkers, new_folder
    folder = new_folder()
    env[PREPARED_DIR_ENV] = folder  # the agent's kills find the workers handed attempts
    return PreparedWorkers(PreparedConfig(local_ranks=lc.nproc_per_node,
                                          compiled=cfg.parallelism.compile,
                                          fp8=cfg.parallelism.fp8 != "none"),
                           folder, env, spawn)


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


# After the run's end, how long an agent may take to exit before it is stopped.
EXIT_GRACE_S = 10.0


def _wait_agent(proc: Process, run_dir: str, steps: int, since: float) -> int:
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
