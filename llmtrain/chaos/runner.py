"""Chaos runs: the whole fault matrix against one running job, and a verdict on each fault.

A job runs on this machine as several "nodes" (``LocalCluster``: ``llmtrain launch``
agents, an external rendezvous store) with spares waiting, checkpoints on the
fault-injecting FUSE filesystem and a scripted NVML per node. Each node has a network
namespace, address and hostname of its own where the machine allows (root, iproute2;
``llmtrain.chaos.netns``), and loopback otherwise, where the kinds that need a link of
their own are left out: the table names them as not run, they count nowhere, and under
``CI=true`` a requested kind that did not run fails the run. A seeded schedule injects
every kind of fault at least once, then random ones, one at a time. The kinds, each in a
module of its own (its injection, its detection and its verdict), are listed in
``llmtrain.chaos.kinds``.

``--script PATH`` runs a user's training loop instead of llmtrain's trainer (a script
that calls ``llmtrain.start``, as ``examples/*.py`` do): the nodes run ``llmtrain launch
--script PATH`` (workers and warm spares alike), the reference is ``torchrun --standalone
PATH`` with the same settings, and only what the public API's ``Settings`` reads is passed
(no ``--data.*``, no ``--optim.*``: the loop trains its own model on its own data, with
its own schedule, which must not depend on ``training.steps``, since the reference ends
at the job's last step). The kinds marked ``trainer_only`` (``nan``: the "loss" fault
point is the trainer's) cannot strike such a loop: asked for, they are refused with a
ConfigError naming them; the default set leaves them out, and a mix's weight on them is
listed as left out.

``--mix FILE`` (or a shipped mix by name: ``llama3``) draws the kinds by weight instead of
uniformly, as a fleet fails: after each kind of the mix once, by the weights; the table
then adds each kind's results and the detection and diagnosis rates weighted by the mix.

A missed detection is a verdict too ("no"), not the end of the chaos run; a kill is
diagnosed right only if the job names the rank that died.

The job runs with the warm path (``--warm.enable``) unless ``warm`` is off: a lost rank
is replaced by the waiting spare from its buddy's in-memory replica, and the verdict says
which path each recovery took. Two spares wait, so that one is ready while the other,
used, starts again; a node that a warm recovery left without its worker is started again
as a spare too (but not after the schedule's last fault: no fault is left to need it),
except a standby node, which puts a new spare in the lost one's place itself (with
spares). The
warm spares start with the job's nodes, and before each fault chaos waits for a spare to be
waiting (in the pool: one still importing makes the recovery wait for its imports, and
the verdict's time says so).

With no spares (``spares = 0``) the job may run one node short (``--nnodes N-1:N``): a
lost or preempted node's survivors shrink in memory (or restart cold at the smaller
size), and the node comes back ``repair_s`` after its fault, as a standby that the job
grows back into. Each verdict's path then reads ``shrink+grow`` (or ``cold+grow``...), and
chaos waits for the full world before the next fault. Training at another world size
changes the order of the gradient reductions, so a job that shrank is not compared bit for
bit with the fault-free run (the shrink-and-grow test compares it with cold resumes at
each size).

Each fault's verdict comes from the run's own event log: whether and when it was
detected, whether the diagnosis named the right rank, collective, check or checkpoint,
what the job did, how long until the first step after it, and the steps it cost. A node
that was lost or excluded is repaired (its GPU fixed, its exclusion lifted) and started
again as the next spare. Once every kind has run (unless ``repeat``), chaos asks the job
to stop (``llmtrain stop``: a save, then a clean end). At the end: did the job finish,
are its final weights bitwise those of a fault-free run of as many steps at the same
world size, was any committed checkpoint lost, and how does the measured ETTR compare
with the Young/Daly model's for the measured costs (``llmtrain.chaos.ending``).

Whatever way a run ends (its end, an error, Ctrl-C, SIGTERM or SIGHUP), it ends the
processes it started, unmounts its filesystem and removes its network namespaces.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from llmtrain.chaos import ending, netns
from llmtrain.chaos.job import Job, JobStopped
from llmtrain.chaos.kinds import (FAULT_KINDS, KINDS, FaultKind, kinds_named, script_kinds,
                                  trainer_only_kinds)
from llmtrain.chaos.local_cluster import LocalCluster
from llmtrain.chaos.mix import load_mix
from llmtrain.chaos.mount import FaultMount
from llmtrain.chaos.settings import ChaosConfig
from llmtrain.chaos.summary import not_run, passed, row, table
from llmtrain.config import ConfigError
from llmtrain.recovery.pool import spares_waiting
from llmtrain.recovery.warm import job_namespace
from llmtrain.stop_request import request_stop

# what ``llmtrain chaos`` (llmtrain/cli.py) and benchmarks use of a chaos run
__all__ = ["KINDS", "Chaos", "ChaosConfig", "kinds_named", "load_mix", "passed",
           "script_kinds", "table"]

log = logging.getLogger(__name__)
FENCE_TIMEOUT_S = 2.0  # the job's: a store stall longer than this refuses its saves
# signals that end a chaos run (the default for SIGTERM and SIGHUP kills at once, with
# nothing cleaned up): each raises SystemExit(128 + signal) instead
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
HELD_SIGNALS = (signal.SIGINT, *ENDING_SIGNALS)  # held off while a run cleans up


@contextlib.contextmanager
def _handling(signals: tuple[signal.Signals, ...], handler) -> Iterator[None]:
    """``handler`` for ``signals`` while the block runs, then the handlers as they were
    (on the main thread: no other may set them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, before in old.items():
            signal.signal(s, before)


def _exit_on_signal(signum: int, frame) -> None:
    """SIGTERM and SIGHUP end a run as Ctrl-C does: by an exception, its cleanup run."""
    raise SystemExit(128 + signum)


def _close_uninterrupted(made: contextlib.ExitStack) -> int | None:
    """Closes ``made`` (the run's processes, mount and namespaces) with Ctrl-C, SIGTERM and
    SIGHUP noted, not acted on (a second Ctrl-C would otherwise leave half of it behind);
    the first signal noted, if any."""
    noted: list[int] = []

    def note(signum: int, frame) -> None:
        noted.append(signum)
        log.warning("chaos: %s while cleaning up: ending the run's processes, mounts and "
                    "namespaces first", signal.Signals(signum).name)
    with _handling(HELD_SIGNALS, note):
        made.close()
    return noted[0] if noted else None


class Chaos:
    """One chaos run (:meth:`execute`): the job, the faults, the verdicts."""

    def __init__(self, cfg: ChaosConfig):
        self.cfg = cfg
        self.script = ""
        if cfg.script:
            if not Path(cfg.script).is_file():
                raise ConfigError(f"--script {cfg.script}: no such file (a training script "
                                  f"that calls llmtrain.start)")
            self.script = str(Path(cfg.script).resolve())  # the nodes' working directory may differ
        self.kinds = kinds_named(cfg.faults, cfg.script)
        self.rng = random.Random(cfg.seed)
        self.dir = Path(cfg.workdir).resolve()
        if self.dir.exists() and any(self.dir.iterdir()):
            raise FileExistsError(f"chaos workdir {self.dir} is not empty: give a new one")
        # Warm, two spares: one waits while the other, used, starts again.
        self.spare_nodes = 1 + cfg.warm if cfg.spares is None else cfg.spares
        self.names = [f"node{i + 1}" for i in range(cfg.nodes + self.spare_nodes)]
        self.left_out: dict[str, str] = {}  # kinds the run meant to inject but cannot, why
        self.no_room: list[str] = []  # kinds of the schedule the job's steps left no room for
        self.train_args = self._train_args()
        # the nodes' launch option (not the workers'): what their workers and spares run
        self.launch_args = (("--script", self.script) if self.script else ()) + (
            ("--nproc-per-node", str(cfg.tp)) if cfg.tp > 1 else ())

    def _train_args(self) -> tuple[str, ...]:
        """The job's settings, for its workers and for the reference."""
        cfg = self.cfg
        # what only llmtrain's trainer reads; a script trains its own model on its own data
        trainer = () if self.script else (
            # 128-token sequences: steps as long as the fault schedule's timing assumes
            "--data.seq_len", "128")
        return (
            "--config", "debug_cpu", *trainer, "--training.steps", str(cfg.steps),
            "--checkpoint.interval_steps", str(cfg.checkpoint_every),
            "--checkpoint.keep_last", "4", "--checkpoint.keep_every", str(5 * cfg.checkpoint_every),
            "--checkpoint.if_busy", "skip", "--metrics.log_every", "5",
            "--metrics.address", "127.0.0.1", "--metrics.port", "0",
            "--reliability.straggler_window_s", "4",
            "--health.interval_s", "1", "--health.link_window_s", "5",
            "--reliability.faults", "env", "--reliability.fence_timeout_s", str(FENCE_TIMEOUT_S),
            # each node a replica, at any number of nodes: a shrink drops one whole
            "--parallelism.dp_replicate", "-1", "--parallelism.dp_shard", "1",
            *(("--parallelism.tp", str(cfg.tp)) if cfg.tp > 1 else ()),
            "--integrity.sdc_every", "5",
            "--warm.enable", str(cfg.warm).lower())

    def requested(self) -> list[FaultKind]:
        """The kinds this run means to inject: those asked for (and, with a mix, in it)."""
        return [k for k in FAULT_KINDS.values() if k in self.kinds
                and (self.cfg.mix is None or k.name in self.cfg.mix)]

    # -- the run --------------------------------------------------------------------------

    def execute(self) -> dict:
        """Runs the job, injects the faults, judges each and the end; returns the result
        (``verdict.json``). Whatever way it ends (the job's end, an error, Ctrl-C,
        SIGTERM, SIGHUP), the processes, the mount and the namespaces it made are gone."""
        made = contextlib.ExitStack()
        try:
            with _handling(ENDING_SIGNALS, _exit_on_signal):
                job = self._setup(made)
                self._inject(job)
                result = self._finish(job)
        finally:
            noted = _close_uninterrupted(made)
        if noted == signal.SIGINT:  # (an error on its way out already ends the run)
            raise KeyboardInterrupt
        if noted is not None:
            raise SystemExit(128 + noted)
        return result

    def _setup(self, made: contextlib.ExitStack) -> Job:
        """The checkpoint filesystem, the nodes' network and the cluster (each undone by
        ``made``), the nodes started and training, the spares waiting."""
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "nvml").mkdir()
        mount = FaultMount(self.dir / "ckpt").start()
        made.callback(mount.stop)
        why_not = netns.available() if self.cfg.netns else "--no-netns"
        network = netns.Network(self.dir) if why_not is None else None
        if network is not None:
            made.callback(network.close)
        self.leave_out(why_not)
        fewest = self.cfg.nodes - (self.spare_nodes == 0)  # no spare: one node short
        faults_file = self.dir / "faults.txt"  # run-time faults (``reliability.faults``)
        # the pace: every rank's steps from step 5 on, in every attempt, last ``pace`` times
        # its fastest before (the reference, without it, trains the same arithmetic)
        faults_file.write_text(f"slow@step:step=5,factor={self.cfg.pace},id=pace\n"
                               if self.cfg.pace > 1 else "")
        cluster = LocalCluster(self.dir, self.dir / "run", f"{fewest}:{self.cfg.nodes}",
                               (*self.launch_args, *self.train_args,
                                "--checkpoint.url", str(mount.mount)),
                               max_restarts=100, env={"LLMTRAIN_FAULTS_FILE": str(faults_file)},
                               network=network)
        made.callback(cluster.close)
        job = Job(self.cfg, self.dir, self.names, self.spare_nodes, cluster, mount, network,
                  faults_file, self.rng)
        for name in self.names:
            job.set_gpu(name, healthy=True)
        for name in self.names[:self.cfg.nodes]:
            job.start(name, spare=False)
        # a warm spare waits in the job's pool, never in a round: it starts with the nodes;
        # a cold one (--cold) could take the place of a node slow to join the first round
        early, late = ((self.names[self.cfg.nodes:], []) if self.cfg.warm
                       else ([], self.names[self.cfg.nodes:]))
        for name in early:
            job.start(name)
        job.wait(lambda: job.latest("step"), "the first step", 300)
        for name in late:
            job.start(name)
        job.spares = job_namespace(cluster.store_client(), "local", cluster.env)
        return job

    def leave_out(self, why_not_netns: str | None) -> None:
        """The kinds this run meant to inject but cannot, and why: those that need nodes
        with links of their own, on loopback; with a script, a mix's kinds only
        llmtrain's trainer meets."""
        if why_not_netns is not None:
            self.left_out = {k.name: f"nodes on loopback ({why_not_netns})"
                             for k in self.requested() if k.needs_netns}
        if self.script and self.cfg.mix:  # a mix's kinds that a user's loop cannot meet
            self.left_out.update({k: f"--script: {why}" for k, why in trainer_only_kinds().items()
                                  if k in self.cfg.mix})

    def _inject(self, job: Job) -> None:
        """The schedule: every kind once in a seeded order, then (with repeat) by the
        mix's weights or uniformly, until the job nears its last step; then (without
        repeat) asks the job to stop. A job that ended on a fatal error ends the schedule:
        the fault in flight says so, the end's verdict judges the rest."""
        try:
            self._schedule(job)
        except JobStopped as e:
            print(f"chaos: {e}", flush=True)

    def _schedule(self, job: Job) -> None:
        kinds = [k for k in self.requested() if k.name not in self.left_out]
        weights = [self.cfg.mix[k.name] for k in kinds] if self.cfg.mix else None
        schedule = self.rng.sample(kinds, len(kinds))
        last = self.cfg.steps - 3 * self.cfg.checkpoint_every
        while kinds and (schedule or self.cfg.repeat):  # (none: every kind was left out)
            scheduled = bool(schedule)
            kind = schedule.pop(0) if schedule else self.rng.choices(kinds, weights)[0]
            self._settle(job, spares=0 if kind.keeps_ranks else
                         self.cfg.tp if kind.takes_node else 1)
            # the kinds of the schedule that never ran: the table says so
            if job.step() >= last:
                self.no_room += [k.name for k in [kind] * scheduled + schedule]
                break
            if not self._room_for(job, kind, last):  # (others may still fit)
                self.no_room += [kind.name] * scheduled
                continue
            before = len(job.verdicts)
            job.last_fault = not (schedule or self.cfg.repeat)
            try:
                kind.inject(job)
            except (TimeoutError, JobStopped) as e:
                if len(job.verdicts) == before:
                    raise  # the job itself stopped answering, before any fault
                job.verdicts[-1].diagnosis = f"missed: {e}"
                if isinstance(e, JobStopped):
                    raise  # (its row is printed on the way out)
            finally:
                if len(job.verdicts) > before:
                    print(row(job.verdicts[-1]), flush=True)
        if not schedule and not self.cfg.repeat:  # every kind has run: no need to wait
            self._launched(job)
            request_stop(str(job.run), "chaos: every fault kind has run")

    def _launched(self, job: Job, timeout: float = 60) -> None:
        """Waits until every node started last (a repaired one, back as a spare) has
        launched, or exited: a launcher sees only a job's end after its own start, and a
        spare still starting when the job was stopped waited for that end for ever
        (chaos killed it a minute later)."""
        def launched(name: str) -> bool:
            return (name not in job.started_at or job.cluster.nodes[name].poll() is not None
                    or any(e["event"] in ("node_launch", "warm_path_off")
                           and e.get("host") == name
                           for e in job.events(None, job.started_at[name])))
        with contextlib.suppress(TimeoutError):  # (then the end's verdict names it)
            job.wait(lambda: all(launched(n) for n in job.cluster.nodes),
                     "launch of the nodes started last", timeout)

    def _settle(self, job: Job, spares: int) -> None:
        """Waits until every training node runs the current attempt and has stepped,
        ``spares`` spares wait (warm, as many as the next fault takes ranks: a node's
        worth for a node lost), and the quiet interval has passed; or the job has ended."""
        def ended() -> bool:
            return job.step() >= self.cfg.steps
        job.wait(lambda: len(job.ranks()) == self.cfg.world_size or ended(), "full world",
                 300)
        if self.cfg.warm and spares and self.spare_nodes:
            job.wait(lambda: spares_waiting(job.spares) >= spares or ended(),
                     f"{spares} waiting spare(s)", 300)
        since = time.time()
        job.wait(lambda: job.latest("step", since) or ended(), "a step", 120)
        if not ended():
            time.sleep(self.cfg.interval_s * self.rng.uniform(0.5, 1.5))

    def _room_for(self, job: Job, kind: FaultKind, last: int) -> bool:
        """Whether the job, at its present pace, trains long enough for ``kind``: a store
        stall lasts ``store_stall_s`` while the job trains on, and must end before the
        last ``last`` step (a job that ended while its store stood still had its last
        save refused), with a commit after it."""
        if kind.name != "store_stall":
            return True
        times = sorted(e["step_time_s"] for e in job.events("step")[-10:])
        pace = times[len(times) // 2] if times else 0.0
        return (last - job.step()) * pace > self.cfg.store_stall_s

    # -- the end ----------------------------------------------------------------------------

    def _finish(self, job: Job) -> dict:
        """Lets the job run to its end (its last step, or the step a stop request ended
        it at), then judges it."""
        killed = ending.wait_for_end(job)
        for judge in job.rejudge.values():  # the faults whose effects may come late
            judge()
        return ending.judge(job, killed, self.kinds_result({v.kind for v in job.verdicts}),
                            lambda step: ending.compare(job, self.train_args, self.script,
                                                        step))

    def kinds_result(self, ran: set[str]) -> dict:
        """The result's account of the kinds (``ran``: those with a verdict): those left
        out (kind -> why), those the job's steps left no room for, and every requested
        kind that did not run (kind -> why), which nothing counts."""
        return {"left_out": self.left_out, "no_room": self.no_room,
                "not_run": not_run([k.name for k in self.requested()], ran, self.left_out,
                                   self.no_room)}
