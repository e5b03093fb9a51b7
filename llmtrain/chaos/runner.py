"""Chaos runs: the whole fault matrix against one running job, and a verdict on each fault.

A job runs on this machine as several "nodes" (``LocalCluster``: ``llmtrain launch``
agents, an external rendezvous store) with spares waiting, checkpoints on the
fault-injecting FUSE filesystem and a scripted NVML per node. Each node has a network
namespace, address and hostname of its own where the machine allows (root, iproute2;
``llmtrain.chaos.netns``), and loopback otherwise, where the kinds that need a link of
their own are left out, and the table says so. A seeded schedule
injects every kind of fault at least once, then random ones, one at a time:

==================  ===================================================================
kill_rank           SIGKILL one rank mid-step
kill_in_save        a rank dies inside its checkpoint shard write (a run-time fault)
hang                SIGSTOP one rank: it stops inside a collective, watchdog thread and all;
                    on the warm path its agent kills it once the report names it, and a
                    spare takes its place
desync              one rank calls a different collective (a run-time fault)
slow_rank           one rank stopped 2/3 of the time for a while: a straggler
node_loss           a whole node (launcher, agent, workers) dies; the spare takes over
lossy_link          a node's link drops what does not fit a small queue at 100 Mbit/s
                    (``tc tbf``, nodes in network namespaces only): the node whose link it
                    is must be named by its health check; training goes on, slower
partition           a node's link goes down while its processes live (nodes in network
                    namespaces only): the others must name its rank, go on without the
                    node, and fence it out; once the job has re-formed the link comes back,
                    and the node, repaired, becomes the next spare
preempt             a node's launcher gets SIGTERM, as Slurm sends it before taking the
                    node: the job saves at an agreed step, exits RETRYABLE and restarts
                    cold from that save (no step lost); the requeue brings the node back
                    as a spare (a waiting spare may have taken its place in the restart);
                    with no spares, the others go on without it in memory from that save
enospc, eio         the checkpoint filesystem fails the next save with ENOSPC / EIO
unreadable_         an old committed checkpoint's manifest fails every read (EIO):
checkpoint          retention must leave it and go on; then the storage heals
slow_retention      every manifest read takes 1.5 s: rank 0's write ends seconds after
                    the others', and the saves due meanwhile are skipped by all ranks
                    together (``if_busy = skip``)
store_stall         the rendezvous store's process is stopped (SIGSTOP) for 30 s, fifteen
                    fence timeouts: saves meanwhile are refused, none after, nobody
                    restarts, and nothing prints a traceback
store_restart       the rendezvous store's process is killed (SIGKILL) and started again
                    3 s later, empty, on the same address and port: the fence puts its
                    token back (``fence_restored``), saves commit again, nobody restarts
                    or takes it for a preemption, no launcher prints a traceback, and the
                    standby launchers are back in the spare pool
gpu_bad             a node's scripted GPU reports uncorrectable ECC errors
truncated_shard     a shard of the newest committed checkpoint is cut short, then every
                    rank is killed so that the restart must notice and fall back
nan                 one rank's loss turns NaN for a step (a run-time fault; llmtrain's
                    trainer only: see ``--script`` below)
bitflip             one rank flips a bit of its replica of the parameters (the job runs
                    HSDP, each node a replica, so that corruption has a witness)
==================  ===================================================================

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
as a spare too. Before each fault chaos waits for a spare to be waiting.

With no spares (``spares = 0``) the job may run one node short (``--nnodes N-1:N``): a
lost or preempted node's survivors shrink in memory (or restart cold at the smaller
size), and the node comes back ``repair_s`` after its fault, as a standby that the job grows back into.
Each verdict's path then reads ``shrink+grow`` (or ``cold+grow``...), and chaos waits for
the full world before the next fault. Training at another world size changes the order
of the gradient reductions, so a job that shrank is not compared bit for bit with the
fault-free run (the shrink-and-grow test compares it with cold resumes at each size).

Each fault's verdict comes from the run's own event log: whether and when it was
detected, whether the diagnosis named the right rank, collective, check or checkpoint,
what the job did, how long until the first step after it, and the steps it cost. A node
that was lost or excluded is repaired (its GPU fixed, its exclusion lifted) and started
again as the next spare. Once every kind has run (unless ``repeat``), chaos asks the job
to stop (``llmtrain stop``: a save, then a clean end). At the end: did the job finish,
are its final weights bitwise those of a fault-free run of as many steps at the same
world size, was any committed checkpoint lost, and
how does the measured ETTR compare with the Young/Daly model's for the measured costs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path


from llmtrain.chaos import netns
from llmtrain.chaos.local_cluster import LocalCluster
from llmtrain.chaos.mount import FaultMount
from llmtrain.checkpoint import storage
from llmtrain.config import ConfigError
from llmtrain.events import read_events
from llmtrain.metrics import goodput
from llmtrain.recovery.warm import job_namespace, spares_waiting
from llmtrain.reliability.health.exclusion import EXCLUDED_HOSTS, excluded_hosts
from llmtrain.stop_request import request_stop

MIXES = Path(__file__).parent / "mixes"
# what the job did about a lost node, by recovery path (a verdict's action)
WENT_ON = {"warm": "a spare took its place, state from memory",
           "shrink": "the others went on without it, state from memory"}
FENCE_TIMEOUT_S = 2.0  # the job's: a store stall longer than this refuses its saves
STORE_DOWN_S = 3.0     # a restarted store is back this long after its process died
# what a store fault causes may show only once the store answers again (a watchdog reading
# old heartbeats, a hang timeout of 5 s): its verdict waits this long after it
AFTERMATH_S = 10.0
# what a store fault must not cause (while it lasts, and until the next fault or the end):
# a rank fenced for good, a watchdog taking the silence for a hang, a collective failing,
# a restart, a preemption the scheduler never sent
STORE_TROUBLE = ("fenced", "hang", "failure", "collective_error", "attempt_start",
                 "preempted")


@dataclass(frozen=True)
class FaultKind:
    """A kind of fault chaos injects: the ``Chaos`` method that injects it and judges the
    job's answer, and what it needs of the cluster."""
    name: str
    inject: Callable[[Chaos], Verdict]
    needs_netns: bool = False  # nodes with links of their own (network namespaces)
    keeps_ranks: bool = False  # costs no rank: needs no spare waiting, nor waits for one
    trainer_only: str = ""     # why it needs llmtrain's own trainer (not a --script's loop)


# name -> kind, in the order the kinds are defined (a schedule's seeded order draws from it)
FAULT_KINDS: dict[str, FaultKind] = {}


def fault_kind(name: str, needs_netns: bool = False, keeps_ranks: bool = False,
               trainer_only: str = ""):
    """Registers the decorated ``Chaos`` method as the fault kind ``name``, so that the
    kinds chaos schedules, and checks ``--faults`` and mixes against, have one source.
    ``trainer_only``: why the kind cannot strike a user's loop (``--script``)."""
    def register(inject: Callable[[Chaos], Verdict]) -> Callable[[Chaos], Verdict]:
        FAULT_KINDS[name] = FaultKind(name, inject, needs_netns, keeps_ranks, trainer_only)
        return inject
    return register


def kinds_named(names: str, script: str = "") -> list[FaultKind]:
    """The kinds a comma-separated list names, or a ConfigError listing the known ones;
    with ``script`` (a user's loop, ``--script``), a ConfigError naming those only
    llmtrain's trainer can meet, and why."""
    unknown = [n for n in names.split(",") if n not in FAULT_KINDS]
    if unknown:
        raise ConfigError(f"unknown fault kind(s) {unknown}; known: {', '.join(FAULT_KINDS)}")
    kinds = [FAULT_KINDS[n] for n in names.split(",")]
    refused = [k for k in kinds if k.trainer_only]
    if script and refused:
        raise ConfigError(
            f"--script {script}: fault kind(s) {[k.name for k in refused]} cannot strike a "
            f"loop of your own (" + "; ".join(f"{k.name}: {k.trainer_only}" for k in refused)
            + f"); choose from {', '.join(script_kinds())}")
    return kinds


def script_kinds() -> tuple[str, ...]:
    """The kinds a user's loop (``--script``) can meet, and the default set for one:
    every kind but those only llmtrain's trainer can (``trainer_only``)."""
    return tuple(k for k, kind in FAULT_KINDS.items() if not kind.trainer_only)


def trainer_only_kinds() -> dict[str, str]:
    """The kinds only llmtrain's trainer can meet, and why."""
    return {k: kind.trainer_only for k, kind in FAULT_KINDS.items() if kind.trainer_only}


@dataclass
class ChaosConfig:
    workdir: str = "runs/chaos"
    steps: int = 1000              # the job's length at most (without repeat it is asked
                                   # to stop once every kind has run): faults come until
                                   # 3 checkpoint intervals before it
    interval_s: float = 20.0       # mean quiet time after a fault's recovery
    seed: int = 0
    # kinds to inject: each once in a seeded order, then (with repeat) at random until the
    # job nears its end
    faults: str = field(default_factory=lambda: ",".join(KINDS))
    repeat: bool = False
    nodes: int = 2                 # training nodes, one rank each, plus spares
    rank: int | None = None        # the rank every rank-level fault hits (default: random)
    checkpoint_every: int = 20
    reference: bool = True         # train again without faults to compare the weights
    warm: bool = True              # recover lost ranks warm where the warm path can
    spares: int | None = None      # spare nodes waiting (None: two warm, one cold); 0: the
                                   # job shrinks without the lost node until it returns
    repair_s: float = 20.0         # with no spares: a lost node returns this long after
    store_stall_s: float = 30.0    # how long store_stall stops the store: more than the
                                   # fence's timeout (and torchrun's keep-alive's 15 s)
    mix: dict[str, float] | None = None  # kind -> weight (``load_mix``): draws by weight
    mix_source: str = ""
    netns: bool = True             # nodes in network namespaces where the machine allows
    script: str = ""               # a training script of the user's (it calls
                                   # llmtrain.start) instead of llmtrain's trainer: the
                                   # nodes run it (``llmtrain launch --script``), and so
                                   # does the reference; ``faults`` may not name a kind
                                   # only the trainer meets (``script_kinds()``)


def load_mix(name_or_path: str) -> tuple[dict[str, float], str]:
    """A fault mix: (kind -> weight, its source). A TOML file (or the name of one shipped
    in ``llmtrain/chaos/mixes``) with ``source`` and a ``[categories]`` table of
    ``"cause" = { count = N, kind = "..." }``; a kind's weight is its causes' counts."""
    path = Path(name_or_path)
    if not path.exists() and (MIXES / f"{name_or_path}.toml").exists():
        path = MIXES / f"{name_or_path}.toml"
    shipped = sorted(p.stem for p in MIXES.glob("*.toml"))
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--mix {name_or_path}: no such file, and no shipped mix of that "
                          f"name (shipped: {shipped})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--mix {path}: not valid TOML ({e})") from None
    weights: dict[str, float] = {}
    for cause, entry in doc.get("categories", {}).items():
        kind, count = entry.get("kind"), entry.get("count")
        if kind not in FAULT_KINDS:
            raise ConfigError(f"--mix {path}: {cause!r} names kind {kind!r}; choose from {KINDS}")
        if not isinstance(count, (int, float)) or count < 0:
            raise ConfigError(f"--mix {path}: {cause!r} needs a count >= 0, not {count!r}")
        weights[kind] = weights.get(kind, 0) + count
    weights = {k: w for k, w in weights.items() if w > 0}
    if not weights:
        raise ConfigError(f"--mix {path}: no [categories] with a count above 0")
    return weights, str(doc.get("source", path))


@dataclass
class Verdict:
    kind: str
    target: str
    at_step: int
    injected_at: float
    detected: bool = False
    detect_s: float | None = None
    diagnosis: str = ""
    correct: bool = False
    action: str = ""
    recover_s: float | None = None
    steps_lost: int | None = None
    path: str = ""                 # how the job recovered: "warm" (a spare), "shrink" (in
                                   # memory, without the lost node), "cold", "" (no restart)
    restored: int | None = None    # the step it went on from
    returned: str = ""             # no spares: how the repaired node came back ("grow": in
                                   # memory, at a step boundary; "cold": by a restart)
    return_s: float | None = None  # what its return cost the others


def write_gpu_script(path: Path, healthy: bool) -> None:
    """Writes one scripted GPU's state for a node's NVML stand-in (``LLMTRAIN_NVML_SCRIPT``),
    atomically: healthy, or with uncorrectable ECC errors (the node must leave)."""
    gpu = {"name": "scripted GPU", "uuid": "GPU-chaos", "pci_bus_id": "00000000:18:00.0",
           "ecc": {"volatile": {"dram": 0 if healthy else 2, "sram": 0},
                   "aggregate": {"dram": 0, "sram": 0}},
           "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False,
                             "failure": False},
           "pcie": {"gen": 5, "width": 16, "max_gen": 5, "max_width": 16},
           "temperature_c": 40, "power_w": 100, "throttle": [], "processes": [],
           "recovery_action": "none"}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": [gpu]}))
    os.replace(tmp, path)


class Chaos:
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
        self.run = self.dir / "run"
        self.faults_file = self.dir / "faults.txt"
        # Warm, two spares: one waits while the other, used, starts again.
        self.spare_nodes = 1 + cfg.warm if cfg.spares is None else cfg.spares
        self.names = [f"node{i + 1}" for i in range(cfg.nodes + self.spare_nodes)]
        self.verdicts: list[Verdict] = []
        self.no_room: list[str] = []  # kinds of the schedule the job's steps left no room for
        self.log_marks: list[dict[str, int]] = []  # each verdict's: the nodes' log sizes
        # verdicts judged again at the end (what a fault caused may come late), by index
        self.rejudge: dict[int, Callable[[], None]] = {}
        self.truncated: set[int] = set()
        self.started_at: dict[str, float] = {}  # node -> when chaos last started it
        # what only llmtrain's trainer reads; a script trains its own model on its own data
        trainer = () if self.script else (
            # 128-token sequences: steps as long as the fault schedule's timing assumes
            "--data.seq_len", "128")
        self.train_args = (
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
            "--integrity.sdc_every", "5",
            "--warm.enable", str(cfg.warm).lower())
        # the nodes' launch option (not the workers'): what their workers and spares run
        self.launch_args = ("--script", self.script) if self.script else ()

    # -- the run --------------------------------------------------------------------------

    def execute(self) -> dict:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "nvml").mkdir()
        self.faults_file.write_text("")
        self.mount = FaultMount(self.dir / "ckpt").start()
        env = {"LLMTRAIN_FAULTS_FILE": str(self.faults_file)}
        why_not = netns.available() if self.cfg.netns else "--no-netns"
        self.network = netns.Network(self.dir) if why_not is None else None
        self.left_out = {k.name: f"nodes on loopback ({why_not})"
                         for k in FAULT_KINDS.values() if k.needs_netns and why_not is not None}
        if self.script and self.cfg.mix:  # a mix's kinds that a user's loop cannot meet
            self.left_out.update({k: f"--script: {why}" for k, why in trainer_only_kinds().items()
                                  if k in self.cfg.mix})
        fewest = self.cfg.nodes - (self.spare_nodes == 0)  # no spare: one node short
        self.cluster = LocalCluster(self.dir, self.run, f"{fewest}:{self.cfg.nodes}",
                                    (*self.launch_args, *self.train_args,
                                     "--checkpoint.url", str(self.mount.mount)),
                                    max_restarts=100, env=env, network=self.network)
        try:
            for name in self.names:
                self._gpu(name, healthy=True)
            for name in self.names[:self.cfg.nodes]:
                self._start(name, spare=False)
            self._wait(lambda: self._latest("step"), "the first step", 300)
            for name in self.names[self.cfg.nodes:]:
                self._start(name)
            self.spares = job_namespace(self.cluster.store_client(), "local", self.cluster.env)
            kinds = [k for k in FAULT_KINDS.values() if k in self.kinds
                     and (self.cfg.mix is None or k.name in self.cfg.mix)
                     and k.name not in self.left_out]
            weights = [self.cfg.mix[k.name] for k in kinds] if self.cfg.mix else None
            schedule = self.rng.sample(kinds, len(kinds))
            last = self.cfg.steps - 3 * self.cfg.checkpoint_every
            while schedule or self.cfg.repeat:
                scheduled = bool(schedule)
                kind = schedule.pop(0) if schedule else self.rng.choices(kinds, weights)[0]
                self._settle(spare=not kind.keeps_ranks)
                # the kinds of the schedule that never ran: the table says so
                if self._step() >= last:
                    self.no_room += [k.name for k in [kind] * scheduled + schedule]
                    break
                if not self._room_for(kind, last):  # (others may still fit)
                    self.no_room += [kind.name] * scheduled
                    continue
                before = len(self.verdicts)
                try:
                    kind.inject(self)
                except TimeoutError as e:
                    if len(self.verdicts) == before:
                        raise  # the job itself stopped answering, before any fault
                    self.verdicts[-1].diagnosis = f"missed: {e}"
                print(_row(self.verdicts[-1]), flush=True)
            if not schedule and not self.cfg.repeat:  # every kind has run: no need to wait
                self._launched()
                request_stop(str(self.run), "chaos: every fault kind has run")
            final = self._finish()
        finally:
            self.cluster.close()
            self.mount.stop()
            if self.network is not None:
                self.network.close()
        return final

    def _start(self, name: str, spare: bool = True) -> None:
        # a node, or a warm spare, says it launched (``node_launch``, or ``warm_path_off``
        # before it waits cold); a cold spare says nothing until it is needed
        if not spare or self.cfg.warm:
            self.started_at[name] = time.time()
        else:
            self.started_at.pop(name, None)
        self.cluster.start(name, env={"LLMTRAIN_NVML_SCRIPT": str(self._script(name))},
                           spare=spare)

    def _launched(self, timeout: float = 60) -> None:
        """Waits until every node started last (a repaired one, back as a spare) has
        launched, or exited: a launcher sees only a job's end after its own start, and a
        spare still starting when the job was stopped waited for that end for ever
        (chaos killed it a minute later)."""
        def launched(name: str) -> bool:
            return (name not in self.started_at or self.cluster.nodes[name].poll() is not None
                    or any(e["event"] in ("node_launch", "warm_path_off")
                           and e.get("host") == name
                           for e in self._events(None, self.started_at[name])))
        with contextlib.suppress(TimeoutError):  # (then the end's verdict names it)
            self._wait(lambda: all(launched(n) for n in self.cluster.nodes),
                       "launch of the nodes started last", timeout)

    def _script(self, name: str) -> Path:
        return self.dir / "nvml" / f"{name}.json"

    def _gpu(self, name: str, healthy: bool) -> None:
        write_gpu_script(self._script(name), healthy)

    # -- what the job is doing --------------------------------------------------------------

    def _events(self, kind: str | None = None, since: float = 0.0) -> list[dict]:
        try:
            return [e for e in read_events(str(self.run), kind) if e["ts"] >= since]
        except FileNotFoundError:
            return []

    def _latest(self, kind: str, since: float = 0.0) -> dict | None:
        found = self._events(kind, since)
        return found[-1] if found else None

    def _latest_before(self, kind: str, since: float, until: float) -> dict | None:
        found = [e for e in self._events(kind, since) if e["ts"] < until]
        return found[-1] if found else None

    def _wait(self, probe, what: str, timeout: float):
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = probe()
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"chaos: no {what} within {timeout:.0f} s; see {self.dir}/*.log")

    def _world(self) -> tuple[float, int]:
        """Since when the job has had its present size, and that size."""
        return max(sizes(self._events()), default=(0.0, 0))

    def _ranks(self) -> dict[int, dict]:
        """The ranks of the job as it is: rank -> its startup event (pid, host)."""
        since, size = self._world()
        return {e["rank"]: e for e in self._events("startup", since) if e["rank"] < size}

    def _hosts(self) -> set[str]:
        """The nodes this attempt's ranks run on."""
        return {e["host"] for e in self._ranks().values()}

    def _step(self) -> int:
        last = self._latest("step")
        return last["step"] if last else 0

    def _settle(self, spare: bool) -> None:
        """Waits until every training node runs the current attempt and has stepped, a
        spare waits (warm, where the next fault may need one), and the quiet interval has
        passed; or the job has ended."""
        def ended() -> bool:
            return self._step() >= self.cfg.steps
        self._wait(lambda: len(self._ranks()) == self.cfg.nodes or ended(), "full world", 300)
        if self.cfg.warm and spare and self.spare_nodes:
            self._wait(lambda: spares_waiting(self.spares) > 0 or ended(), "a waiting spare",
                       300)
        since = time.time()
        self._wait(lambda: self._latest("step", since) or ended(), "a step", 120)
        if not ended():
            time.sleep(self.cfg.interval_s * self.rng.uniform(0.5, 1.5))

    def _room_for(self, kind: FaultKind, last: int) -> bool:
        """Whether the job, at its present pace, trains long enough for ``kind``: a store
        stall lasts ``store_stall_s`` while the job trains on, and must end before the
        last ``last`` step (a job that ended while its store stood still had its last
        save refused), with a commit after it."""
        if kind.name != "store_stall":
            return True
        times = sorted(e["step_time_s"] for e in self._events("step")[-10:])
        pace = times[len(times) // 2] if times else 0.0
        return (last - self._step()) * pace > self.cfg.store_stall_s

    def _pick_rank(self) -> tuple[int, dict]:
        ranks = self._ranks()
        rank = self.cfg.rank if self.cfg.rank is not None else self.rng.choice(sorted(ranks))
        return rank, ranks[rank]

    def _verdict(self, kind: str, target: str, at_step: int | None = None) -> Verdict:
        v = Verdict(kind, target, self._step() if at_step is None else at_step, time.time())
        self.verdicts.append(v)
        self.log_marks.append(self._log_sizes())
        return v

    def _log_sizes(self) -> dict[str, int]:
        """How far each node's log (its launcher, agent and workers) has been written."""
        sizes = {}
        for name in self.names:
            with contextlib.suppress(FileNotFoundError):
                sizes[name] = (self.dir / f"{name}.log").stat().st_size
        return sizes

    def _index(self, v: Verdict) -> int:
        return next(i for i, x in enumerate(self.verdicts) if x is v)

    def _window(self, v: Verdict) -> tuple[float, dict[str, int], dict[str, int] | None]:
        """What belongs to fault ``v``: from its injection to the next fault's (or the
        end): that time, and the nodes' log marks at both ends (None: to the end)."""
        i = self._index(v)
        if i + 1 < len(self.verdicts):
            return self.verdicts[i + 1].injected_at, self.log_marks[i], self.log_marks[i + 1]
        return float("inf"), self.log_marks[i], None

    def _tracebacks(self, since: dict[str, int], until: dict[str, int] | None) -> list[str]:
        """``node: Exception: message`` for each Python traceback printed in a node's
        log between the two marks (a launcher's, an agent's or a worker's)."""
        found = []
        for name in self.names:
            # (a log not there yet at a mark had nothing written by then)
            start, end = since.get(name, 0), None if until is None else until.get(name, 0)
            try:
                with open(self.dir / f"{name}.log", "rb") as f:
                    f.seek(start)
                    text = f.read(-1 if end is None else max(0, end - start))
            except FileNotFoundError:
                continue
            lines = text.decode(errors="replace").splitlines()
            for i, line in enumerate(lines):
                at = line.find("Traceback (most recent call last)")
                if at < 0:
                    continue
                prefix = line[:at]  # torchrun's per-rank prefix, if any
                last = next((rest for rest in (ln[len(prefix):] if ln.startswith(prefix)
                                               else ln for ln in lines[i + 1:i + 400])
                             if rest and not rest[0].isspace()), "?")
                kind, colon, message = last.strip().partition(":")  # the class, unqualified
                found.append(f"{name}: {kind.rpartition('.')[2]}{colon}{message}"[:120])
        return found

    def _store_trouble(self, v: Verdict) -> tuple[list[str], list[str]]:
        """What store fault ``v`` caused in its window: STORE_TROUBLE events ("event
        (rank r)") and tracebacks."""
        until, since_logs, until_logs = self._window(v)
        events = [f"{e['event']}" + (f" (rank {e['rank']})" if "rank" in e else "")
                  for e in self._events(None, v.injected_at)
                  if e["event"] in STORE_TROUBLE and e["ts"] < until]
        return events, self._tracebacks(since_logs, until_logs)

    def _recovered(self, v: Verdict, since: float, node: str | None = None,
                   timeout: float = 240) -> dict:
        """Waits for the first step after the recovery, warm or cold; fills in its path,
        time and steps lost. ``node``: the one that held the lost rank; if it lives on
        without its worker after a warm recovery, it is started again as the next spare."""
        rec = self._wait(lambda: self._latest("warm_recovery", since)
                         or self._latest("recovery", since), "recovery", timeout)
        v.path = ("cold" if rec["event"] == "recovery" else
                  "shrink" if rec["kind"] == "shrink" else "warm")
        if v.action.startswith("flight-recorder report"):  # a watchdog's verdict
            v.action += "; " + WENT_ON.get(v.path, "restart from the last checkpoint")
        v.recover_s = rec["marks"]["first_step"] - v.injected_at
        if v.path != "cold":
            v.restored = rec["step"]
            if node is not None:  # its agent has no worker left: back as a spare
                if self.cluster.nodes[node].poll() is None:  # not ended yet
                    self.cluster.kill(node)
                    self.cluster.nodes[node].wait()
                self._back(v, node)
        else:
            loaded = self._latest("checkpoint_loaded", since)
            v.restored = loaded["step"] if loaded else 0
        # a save at the stop (gpu_bad) can be past the step the fault was injected at
        v.steps_lost = max(0, v.at_step - v.restored)
        return rec

    def _back(self, v: Verdict, node: str) -> None:
        """``node``, which left the job, comes back repaired as a spare: at once while
        spares wait for the job; with none, ``repair_s`` after its fault, and a job that
        runs without it takes it in (a warm grow, or a restart): the verdict says which,
        and the time it cost the others."""
        if self.spare_nodes:
            self._start(node)
            return
        time.sleep(max(0.0, v.injected_at + self.cfg.repair_s - time.time()))
        since = time.time()
        self._start(node)
        if self._world()[1] == self.cfg.nodes:
            return
        back = self._wait(lambda: self._latest("warm_grow", since)
                          or self._latest("recovery", since) or self._ended(since),
                          f"the job to take {node} back", 180)
        if back["event"] == "run_end":  # it reached its last step first: nothing to grow
            return
        v.returned = "grow" if back["event"] == "warm_grow" else "cold"
        v.return_s = (back["total_s"] if v.returned == "grow" else
                      back["marks"]["first_step"] - since)

    def _ended(self, since: float) -> dict | None:
        """The job's end at its last step, since ``since``."""
        return next((e for e in self._events("run_end", since)
                     if e["steps"] == self.cfg.steps), None)

    @staticmethod
    def _lost_ranks(rec: dict) -> list[int] | None:
        """The ranks a recovery says died: lost (warm) or silent (cold)."""
        return rec.get("lost", rec.get("silent_ranks"))

    # -- the faults --------------------------------------------------------------------------

    @fault_kind("kill_rank")
    def _kill_rank(self) -> Verdict:
        rank, info = self._pick_rank()
        v = self._verdict("kill_rank", f"rank {rank} ({info['host']})")
        os.kill(info["pid"], signal.SIGKILL)
        seen = self._wait(lambda: self._latest("failure", v.injected_at), "failure", 120)
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        v.diagnosis = f"rank {seen['rank']}'s collective failed: {seen['error'][:80]}"
        rec = self._recovered(v, v.injected_at, info["host"])
        v.action = WENT_ON.get(v.path, "restart from the last checkpoint")
        # right only if the job named the dead rank: the one that went silent
        v.correct = self._lost_ranks(rec) == [rank]
        v.diagnosis = f"rank(s) {self._lost_ranks(rec)} died silently; " + v.diagnosis
        return v

    @fault_kind("kill_in_save")
    def _kill_in_save(self) -> Verdict:
        rank, info = self._pick_rank()
        v = self._verdict("kill_in_save", f"rank {rank} ({info['host']})")
        with open(self.faults_file, "a") as f:
            f.write(f"kill@checkpoint_write:rank={rank},id=save{len(self.verdicts)}\n")
        seen = self._wait(lambda: self._latest("failure", v.injected_at), "failure", 180)
        self._struck(v, f"save{len(self.verdicts)}", rank)
        v.at_step = seen["step"]
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        self._recovered(v, v.injected_at, info["host"])
        saved = v.at_step // self.cfg.checkpoint_every * self.cfg.checkpoint_every
        committed = storage.read_manifest(storage.step_dir(str(self.mount.mount), saved))
        v.diagnosis = (f"save of step {saved} left "
                       f"{'committed' if committed is not None else 'uncommitted'}; resumed "
                       f"from {'the snapshot of ' if v.path == 'warm' else ''}step {v.restored}")
        v.correct = committed is None
        v.action = WENT_ON.get(v.path, "restart from the previous committed checkpoint")
        return v

    @fault_kind("hang")
    def _hang(self) -> Verdict:
        rank, info = self._pick_rank()
        v = self._verdict("hang", f"rank {rank} ({info['host']})")
        os.kill(info["pid"], signal.SIGSTOP)
        try:
            seen = self._wait(lambda: self._latest("hang", v.injected_at), "hang report", 120)
        finally:  # a stopped process ignores SIGTERM; on the warm path its agent kills it
            with contextlib.suppress(ProcessLookupError):
                os.kill(info["pid"], signal.SIGKILL)
        self._judge_report(v, seen, rank)
        self._recovered(v, v.injected_at, info["host"])
        return v

    def _arm_ahead(self, kind: str, fault: str, keys: str = "") -> tuple[int, Verdict]:
        """Arms run-time ``fault`` (ACTION@POINT) at a rank 10 steps ahead of the last
        logged step (step events come every 5 steps: safely in the future)."""
        rank, info = self._pick_rank()
        at = self._step() + 10
        v = self._verdict(kind, f"rank {rank} ({info['host']})", at)
        with open(self.faults_file, "a") as f:
            f.write(f"{fault}:rank={rank},step={at},{keys}id={kind}{len(self.verdicts)}\n")
        return rank, v

    def _struck(self, v: Verdict, fault_id: str, rank: int) -> None:
        """An armed fault's clock starts when it struck, not when it was armed: the rank
        that struck left a marker then (see ``llmtrain.chaos.faults``)."""
        marker = Path(f"{self.faults_file}.fired") / f"{fault_id}.{rank}"
        if marker.exists():
            v.injected_at = marker.stat().st_mtime

    @fault_kind("desync")
    def _desync(self) -> Verdict:
        rank, v = self._arm_ahead("desync", "desync@step")
        node = self._ranks()[rank]["host"]
        seen = self._wait(lambda: self._latest("hang", v.injected_at)
                          or self._latest("collective_error", v.injected_at), "verdict", 180)
        self._struck(v, f"desync{len(self.verdicts)}", rank)
        self._judge_report(v, seen, rank)
        self._recovered(v, v.injected_at, node)
        return v

    @staticmethod
    def _judge_report(v: Verdict, seen: dict, rank: int) -> None:
        """A watchdog verdict: detected when the watchdog decided (before the dumps and the
        report), right if it names the rank as the one the others wait for."""
        v.detected = True
        v.detect_s = (seen["ts"] - seen.get("reported_after_s", 0)
                      + seen.get("detected_after_s", 0) - v.injected_at)
        v.diagnosis = seen.get("verdict") or seen["reason"]
        v.correct = rank in seen.get("culprits", [])
        v.action = f"flight-recorder report {seen['id']}"

    @fault_kind("slow_rank", keeps_ranks=True)
    def _slow_rank(self) -> Verdict:
        rank, info = self._pick_rank()
        v = self._verdict("slow_rank", f"rank {rank} ({info['host']})")
        stop = threading.Event()

        def throttle() -> None:  # about 3x slower: stopped 2/3 of every 150 ms
            while not stop.is_set():
                try:
                    os.kill(info["pid"], signal.SIGSTOP)
                    time.sleep(0.1)
                    os.kill(info["pid"], signal.SIGCONT)
                except ProcessLookupError:
                    return
                time.sleep(0.05)
        thread = threading.Thread(target=throttle, daemon=True)
        thread.start()
        try:
            seen = self._wait(lambda: self._latest("straggler", v.injected_at), "straggler", 90)
        finally:
            stop.set()
            thread.join()
            os.kill(info["pid"], signal.SIGCONT)
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        v.diagnosis = f"rank {seen['straggler_rank']} {seen['slowdown']}x slower"
        v.correct = seen["straggler_rank"] == rank
        v.action = "straggler event and metric; training goes on"
        v.recover_s, v.steps_lost = 0.0, 0
        return v

    @fault_kind("node_loss")
    def _node_loss(self) -> Verdict:
        rank, info = self._pick_rank()
        node = info["host"]
        v = self._verdict("node_loss", node)
        self.cluster.kill(node)
        seen = self._wait(lambda: self._latest("failure", v.injected_at), "failure", 120)
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        self._recovered(v, v.injected_at)
        try:  # the spare's startup event follows its first step
            self._wait(lambda: node not in self._hosts(), f"a world without {node}", 60)
        except TimeoutError:
            pass  # judged below
        hosts = self._hosts()
        v.diagnosis = f"world re-formed on {sorted(hosts)}"
        v.correct = node not in hosts and len(hosts) == self.cfg.nodes - (not self.spare_nodes)
        v.action = WENT_ON.get(v.path, "restart from the last checkpoint")
        self._back(v, node)  # repaired
        return v

    @fault_kind("partition", needs_netns=True)
    def _partition(self) -> Verdict:
        rank, info = self._pick_rank()
        node = info["host"]
        v = self._verdict("partition", f"rank {rank} ({node})")
        self.network.cut(node)
        try:
            seen = self._wait(lambda: self._latest("hang", v.injected_at), "hang report", 120)
            self._judge_report(v, seen, rank)
            self._recovered(v, v.injected_at)
            self._wait(lambda: node not in self._hosts(), f"a world without {node}", 60)
        finally:
            self.network.heal(node)
        healed = time.time()
        # Back on the network, the node's processes meet a job that re-formed without them
        # (they notice when TCP next resends: seconds later, or more after a long cut):
        # whatever they try to write into it is refused. A few seconds later the node is
        # repaired and becomes the next spare (tests/system/test_partition.py makes the
        # late write happen, every time).
        try:
            fenced = self._wait(lambda: [e for e in self._events("fenced", healed)
                                         if e.get("host") == node], "fenced", 5)
        except TimeoutError:
            fenced = []
        self.cluster.kill(node)
        self.cluster.nodes[node].wait()
        self._back(v, node)
        v.diagnosis = (f"world re-formed without {node}; on its return "
                       + (f"refused: {fenced[0]['what']}" if fenced else "it tried nothing")
                       + "; " + v.diagnosis)
        v.action = f"{v.action}; fenced on its return" if fenced else v.action
        return v

    @fault_kind("lossy_link", needs_netns=True, keeps_ranks=True)
    def _lossy_link(self) -> Verdict:
        rank, info = self._pick_rank()
        node = info["host"]
        v = self._verdict("lossy_link", node)
        self.network.degrade(node, "100mbit")

        def warnings() -> list[dict]:
            return [e for e in self._events("health", v.injected_at)
                    if e["check"] == "link" and e["severity"] == "warn"]
        try:
            first = self._wait(warnings, "link warning", 60)[0]
            time.sleep(8)  # more than a link window: a peer's link may be reported too
            reports = warnings()
        finally:
            self.network.restore(node)
        worst = max(reports, key=lambda e: e["value"])
        v.detected, v.detect_s = True, first["ts"] - v.injected_at
        v.diagnosis = "; ".join(f"{e['host']} resent {e['value']:.0%}" for e in reports)[:120]
        v.correct = worst["host"] == node
        v.action = "link health warning (event, metric); training goes on, slower"
        v.recover_s, v.steps_lost = 0.0, 0
        return v

    @fault_kind("preempt")
    def _preempt(self) -> Verdict:
        rank, info = self._pick_rank()
        node = info["host"]
        v = self._verdict("preempt", node)
        self.cluster.nodes[node].send_signal(signal.SIGTERM)  # Slurm's, to the launcher
        seen = self._wait(lambda: self._latest("preempted", v.injected_at), "preempted", 60)
        v.detected, v.detect_s, v.at_step = True, seen["ts"] - v.injected_at, seen["step"]
        ends = ("checkpoint_committed", "checkpoint_failed")
        saved = self._wait(lambda: [e for e in self._events(None, v.injected_at)
                                    if e["event"] in ends and e["step"] == v.at_step][:1],
                           "the preemption's save", 120)[0]
        self._wait(lambda: self.cluster.nodes[node].poll() is not None, f"{node} to exit", 120)
        code = self.cluster.nodes[node].returncode
        # The requeue brings the node back as a spare: the restart's round is short of its
        # place for a few seconds, and a waiting spare may take it first. Brought back as a
        # plain node, it then waited in the rendezvous, and no warm spare was left. With no
        # spares the job restarts without it, which takes it back after its maintenance.
        if self.spare_nodes:
            self._back(v, node)
        self._recovered(v, v.injected_at)
        if not self.spare_nodes:
            self._back(v, node)
        v.diagnosis = (f"signal {seen['signal']} at step {seen['step']}: saved step "
                       f"{saved['step']} ({saved['event']}), {node} exited {code}; resumed "
                       f"from step {v.restored}")
        v.correct = (saved["event"] == "checkpoint_committed" and saved["step"] == v.at_step
                     and v.restored == v.at_step and code == 75)
        v.action = "agreed save, exit 75 (requeue), " + (
            "the others went on without it, state from memory" if v.path == "shrink" else
            "restart from that save")
        return v

    def _storage_error(self, kind: str, errno_name: str) -> Verdict:
        v = self._verdict(kind, "checkpoint filesystem")
        self.mount.set_rules([{"ops": ["write", "create", "fsync"], "errno": errno_name,
                               "path": "*.distcp", "name": kind}])
        try:
            seen = self._wait(lambda: self._latest("checkpoint_failed", v.injected_at),
                              "checkpoint_failed", 180)
        finally:
            self.mount.clear()
        v.at_step = seen["step"]
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        v.diagnosis = seen["error"][:120]
        v.correct = errno_name in seen["error"] or os.strerror(
            {"ENOSPC": 28, "EIO": 5}[errno_name]) in seen["error"]
        after = self._wait(lambda: self._latest("checkpoint_committed", seen["ts"]),
                           "the next commit", 180)
        v.action = f"save failed, training went on; next commit at step {after['step']}"
        v.recover_s, v.steps_lost = 0.0, 0
        return v

    @fault_kind("enospc", keeps_ranks=True)
    def _enospc(self) -> Verdict:
        return self._storage_error("enospc", "ENOSPC")

    @fault_kind("eio", keeps_ranks=True)
    def _eio(self) -> Verdict:
        return self._storage_error("eio", "EIO")

    @fault_kind("unreadable_checkpoint", keeps_ranks=True)
    def _unreadable_checkpoint(self) -> Verdict:
        """An old committed checkpoint's manifest fails every read (EIO: a bad sector, an
        object gone to an archive tier): retention must pass it over and leave it, and go
        on retiring the others; then the storage heals."""
        since = time.time()
        committed = self._wait(lambda: [c for c in storage.list_checkpoints(str(self.mount.root))
                                        if c.committed][:-1] or None,
                               "two committed checkpoints", 180)
        oldest = committed[0].step
        name = Path(storage.step_dir("", oldest)).name
        v = self._verdict("unreadable_checkpoint", f"step {oldest} (its manifest)")
        self.mount.set_rules([{"ops": ["open"], "path": f"/{name}/{storage.MANIFEST}",
                               "errno": "EIO", "name": "unreadable_checkpoint"}])
        try:
            seen = self._wait(lambda: [e for e in self._events("checkpoint_passed_over", since)
                                       if e["step"] == oldest][:1], "checkpoint_passed_over",
                              180)[0]
            after = self._wait(lambda: self._latest("checkpoint_committed", seen["ts"]),
                               "the next commit", 180)
            time.sleep(1)  # its retention pass
        finally:
            self.mount.clear()
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        v.diagnosis = f"step {seen['step']} passed over by {seen['by']}: {seen['reason'][:80]}"
        failed = self._events("checkpoint_retention_failed", v.injected_at)
        kept = [c.step for c in storage.list_checkpoints(str(self.mount.root))]
        v.correct = not failed and oldest in kept
        v.action = (f"left in place; retention went on (next commit at step {after['step']})"
                    + (f"; {len(failed)} retention pass(es) failed" if failed else ""))
        v.recover_s, v.steps_lost = 0.0, 0
        return v

    @fault_kind("slow_retention", keeps_ranks=True)
    def _slow_retention(self) -> Verdict:
        """Every manifest read takes 1.5 s (an object store at scale): rank 0's write ends
        seconds after the others', after its retention pass, and saves fall due meanwhile.
        With ``if_busy = skip`` every rank must skip them together (one skipping alone
        deadlocks the job), and training must not stall."""
        v = self._verdict("slow_retention", "checkpoint manifests (reads 1.5 s slower)")
        self.mount.set_rules([{"ops": ["open"], "path": f"/*/{storage.MANIFEST}",
                               "delay": 1.5, "name": "slow_retention"}])
        try:
            seen = self._wait(lambda: [e for e in self._events("checkpoint_skipped", v.injected_at)
                                       if e["reason"].startswith("previous still writing")][:1],
                              "a save skipped while the previous one still writes", 180)[0]
        finally:
            self.mount.clear()
        after = self._wait(lambda: self._latest("checkpoint_committed", seen["ts"]),
                           "the next commit", 180)
        v.at_step = seen["step"]
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        v.diagnosis = f"save of step {seen['step']} skipped by all ranks: {seen['reason']}"
        trouble = [e["event"] for e in self._events(None, v.injected_at)
                   if e["event"] in ("hang", "failure", "collective_error")]
        v.correct = not trouble
        v.action = (f"skipped, training went on; next commit at step {after['step']}"
                    + (f"; then {', '.join(trouble)}" if trouble else ""))
        v.recover_s, v.steps_lost = 0.0, 0
        return v

    def _judge_store_fault(self, v: Verdict, action: str, ok: bool, hosts: set[str]) -> None:
        """A store fault's verdict: right if ``ok`` (detected, and whatever the kind
        checks) and nothing in its window was trouble (STORE_TROUBLE, a traceback).
        ``hosts``: the nodes that ran ranks before it; those a needless recovery left out
        are started again as spares, as after any recovery.
        Judged now, and again at the end: a launcher may fail a while after (the issue
        that made store_restart a kind: nodes exited 75 half a minute after a restart)."""
        def judge() -> None:
            trouble, tracebacks = self._store_trouble(v)
            until = self._window(v)[0]
            rec = [e for e in self._events(None, v.injected_at) if e["ts"] < until
                   and e["event"] in ("warm_recovery", "recovery")][:1]
            v.path = "" if not rec else "cold" if rec[0]["event"] == "recovery" else (
                "shrink" if rec[0]["kind"] == "shrink" else "warm")  # a needless recovery
            if rec:  # what it cost: the steps from the one it failed at to the restored one
                failed = max((e["step"] for e in self._events("step", v.injected_at)
                              if e["ts"] < rec[0]["ts"]), default=v.at_step)
                loaded = self._latest_before("checkpoint_loaded", v.injected_at, until)
                v.restored = (rec[0]["step"] if v.path != "cold" else
                              loaded["step"] if loaded else 0)
                v.steps_lost = max(0, failed - v.restored)
            seen = sorted(set(trouble))
            v.correct = ok and not trouble and not tracebacks
            v.action = action + (f"; then {', '.join(seen)}" if seen else "") + (
                f"; tracebacks: {'; '.join(tracebacks[:3])}" if tracebacks else "")
        judge()
        self.rejudge[self._index(v)] = judge
        if v.path in ("warm", "shrink"):  # a needless recovery: the nodes it left out
            for node in sorted(hosts - self._hosts()):  # come back as spares
                if self.cluster.nodes[node].poll() is None:
                    self.cluster.kill(node)
                    self.cluster.nodes[node].wait()
                self._back(v, node)

    @fault_kind("store_stall", keeps_ranks=True)
    def _store_stall(self) -> Verdict:
        """The rendezvous store's process stops (SIGSTOP: its connections stay up, nothing
        answers) for ``store_stall_s`` (30 s: fifteen fence timeouts, twice torchrun's
        keep-alive window), then goes on. Saves meanwhile are refused (the ranks cannot
        prove they are members); once it answers, saves commit again and nobody was
        fenced for good, nor restarted, and nothing printed a traceback."""
        stall_s = self.cfg.store_stall_s
        hosts = self._hosts()
        v = self._verdict("store_stall", f"the rendezvous store, {stall_s:.0f} s")
        os.kill(self.cluster.store.pid, signal.SIGSTOP)
        try:
            with contextlib.suppress(TimeoutError):  # (then a verdict of "not detected")
                seen = None
                seen = self._wait(lambda: self._latest("fence_unreachable", v.injected_at),
                                  "fence_unreachable", stall_s)
            time.sleep(max(0.0, v.injected_at + stall_s - time.time()))
        finally:
            os.kill(self.cluster.store.pid, signal.SIGCONT)
        resumed = time.time()
        after = self._wait(lambda: self._latest("checkpoint_committed", resumed),
                           "a commit after the stall", 180)
        time.sleep(max(0.0, resumed + AFTERMATH_S - time.time()))
        if seen:
            v.detected, v.detect_s = True, seen["ts"] - v.injected_at
            v.at_step = self._latest("step", seen["ts"] - 5)["step"]
            v.diagnosis = f"rank {seen['rank']}: {seen['what']} refused ({seen['error'][:60]})"
        v.recover_s, v.steps_lost = after["ts"] - resumed, 0
        self._judge_store_fault(v, f"writes refused while it lasted; commit at step "
                                   f"{after['step']} {after['ts'] - resumed:.1f}s after",
                                bool(seen), hosts)
        return v

    @fault_kind("store_restart", keeps_ranks=True)
    def _store_restart(self) -> Verdict:
        """The rendezvous store's process is killed (SIGKILL) and started again
        ``STORE_DOWN_S`` later, empty, on the same address and port: the fence's token,
        the spare pool, torchrun's rendezvous state and every failure watch's key are
        gone, and every connection to it was reset. Detected when a rank finds the
        fence's token gone and puts its own back (``fence_restored``); right if a save
        commits after that, nobody restarts, is fenced, or takes the reset connections
        for a preemption, no launcher, agent or worker prints a traceback (until the next
        fault, or the end), and the standby launchers are back in the (new) spare pool."""
        hosts = self._hosts()
        # the pool must come back only if a spare was in it (a needless recovery before may
        # have used them all)
        waiting = self.cfg.warm and self.spare_nodes and spares_waiting(self.spares) > 0
        v = self._verdict("store_restart", f"the rendezvous store, down {STORE_DOWN_S:.0f} s")
        self.cluster.restart_store(STORE_DOWN_S)
        # the harness's own connection died with the old store
        self.spares = job_namespace(self.cluster.store_client(), "local", self.cluster.env)
        with contextlib.suppress(TimeoutError):  # (then a verdict of "not detected")
            seen = None
            seen = self._wait(lambda: self._latest("fence_restored", v.injected_at),
                              "fence_restored", 120)
        since = seen["ts"] if seen else time.time()
        after = self._wait(lambda: self._latest("checkpoint_committed", since),
                           "a commit after the restart", 180)
        pool_back = True
        if waiting:  # the next fault may need a spare (a job that ended released them)
            try:
                self._wait(lambda: spares_waiting(self.spares) > 0
                           or self._latest("run_end", v.injected_at), "a spare back in the pool",
                           60)
            except TimeoutError:
                pool_back = False
        time.sleep(max(0.0, v.injected_at + STORE_DOWN_S + AFTERMATH_S - time.time()))
        if seen:
            v.detected, v.detect_s = True, seen["ts"] - v.injected_at
            v.at_step = self._latest("step", seen["ts"] - 5)["step"]
            v.diagnosis = (f"rank {seen['rank']} ({seen.get('host', '?')}): the fence's "
                           f"token was gone; put back")
        # from the kill: the store was out STORE_DOWN_S of it
        v.recover_s, v.steps_lost = after["ts"] - v.injected_at, 0
        action = (f"control state restored; commit at step {after['step']} "
                  f"{v.recover_s:.1f}s after the kill"
                  + ("" if pool_back else "; no spare back in the pool within 60 s"))
        self._judge_store_fault(v, action, bool(seen) and pool_back, hosts)
        return v

    @fault_kind("gpu_bad")
    def _gpu_bad(self) -> Verdict:
        rank, info = self._pick_rank()
        node = info["host"]
        v = self._verdict("gpu_bad", f"{node} GPU 0")
        self._gpu(node, healthy=False)
        seen = self._wait(lambda: [e for e in self._events("health", v.injected_at)
                                   if e["severity"] == "fatal"], "fatal health event", 60)[0]
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        v.diagnosis = f"{seen['check']} on {seen['host']} GPU {seen['gpu']}"
        v.correct = seen["check"] == "ecc_volatile" and seen["host"] == node
        self._wait(lambda: self.cluster.nodes[node].poll() is not None, f"{node} to exit", 120)
        v.correct &= self.cluster.nodes[node].returncode == 76
        self._recovered(v, v.injected_at)
        v.action = (f"{node} exited {self.cluster.nodes[node].returncode} (76 = excluded); "
                    + WENT_ON.get(
                        v.path, "spare admitted, restart from the last checkpoint"))
        # repaired: the GPU replaced, the exclusion lifted, back as a spare
        self._gpu(node, healthy=True)
        hosts = excluded_hosts(str(self.run))
        hosts.pop(node, None)
        (self.run / EXCLUDED_HOSTS).write_text(json.dumps(hosts))
        self._back(v, node)
        return v

    @fault_kind("truncated_shard")
    def _truncated_shard(self) -> Verdict:
        since = time.time()
        newest = self._wait(lambda: self._latest("checkpoint_committed", since),
                            "a commit", 180)["step"]
        shard = max((self.mount.root / Path(storage.step_dir(str(self.mount.mount), newest)).name)
                    .glob("*.distcp"), key=lambda p: p.stat().st_size)
        with open(shard, "r+b") as f:  # behind the filesystem's back, as bit rot would be
            f.truncate(shard.stat().st_size // 2)
        self.truncated.add(newest)
        v = self._verdict("truncated_shard", f"step {newest} ({shard.name})")
        for info in self._ranks().values():  # all at once: nobody is left to recover warm
            os.kill(info["pid"], signal.SIGKILL)  # before the next commit makes it not the newest
        seen = self._wait(lambda: self._latest("checkpoint_rejected", v.injected_at),
                          "checkpoint_rejected", 180)
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        v.diagnosis = f"step {seen['step']} rejected: {seen['problems'][0][:80]}"
        self._recovered(v, v.injected_at)
        loaded = self._latest("checkpoint_loaded", v.injected_at)
        v.correct = seen["step"] == newest and (loaded is None or loaded["step"] < newest)
        v.action = (f"fell back to step {loaded['step']}" if loaded else
                    "no older checkpoint: started over")
        return v

    @fault_kind("nan", keeps_ranks=True,
                trainer_only="it makes the loss NaN at the 'loss' fault point, which only "
                             "llmtrain's trainer calls")
    def _nan(self) -> Verdict:
        rank, v = self._arm_ahead("nan", "nan@loss")
        seen = self._wait(lambda: self._latest("step_skipped", v.injected_at), "step_skipped", 120)
        self._struck(v, f"nan{len(self.verdicts)}", rank)
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        v.at_step = seen["step"]
        v.diagnosis = (f"step {seen['step']} not applied ({seen['reason']}): non-finite loss "
                       f"on rank(s) {seen['ranks']}")
        v.correct = seen["reason"] == "nonfinite" and seen["ranks"] == [rank]
        v.action = "the step's update skipped on the device; training went on"
        v.recover_s, v.steps_lost = 0.0, 1
        return v

    @fault_kind("bitflip", keeps_ranks=True)
    def _bitflip(self) -> Verdict:
        rank, v = self._arm_ahead("bitflip", "bitflip@step", keys="bit=12,")
        seen = self._wait(lambda: self._latest("state_check_failed", v.injected_at),
                          "state_check_failed", 120)
        self._struck(v, f"bitflip{len(self.verdicts)}", rank)
        v.detected, v.detect_s = True, seen["ts"] - v.injected_at
        named = self._wait(lambda: self._latest("replica_diverged", v.injected_at),
                           "replica_diverged", 180)
        rolled = self._latest("rollback", v.injected_at)
        v.diagnosis = (f"replicas differ at step {seen['step']}; the replay names rank(s) "
                       f"{named['ranks']}")
        v.correct = named["ranks"] == [rank]
        v.action = f"rolled back to step {rolled['to_step']} and replayed"
        v.recover_s = named["ts"] - seen["ts"]
        v.steps_lost = seen["step"] - rolled["to_step"]
        return v

    # -- the end ----------------------------------------------------------------------------

    def _pool_state(self) -> dict:
        """The spare pool's counters and each registered spare's slot, as the store has
        them."""
        with contextlib.suppress(Exception):
            pool = self.spares
            registered = pool.add("spares/registered", 0)
            return {"registered": registered, "claimed": pool.add("spares/claimed", 0),
                    "left": pool.add("spares/left", 0),
                    "slots": {n: [pool.get(f"spares/{n}/state").decode()
                                  if pool.check([f"spares/{n}/state"]) else "",
                                  pool.check([f"spares/{n}/plan"])]
                              for n in range(1, registered + 1)}}
        return {}

    def _finish(self) -> dict:
        """Lets the job run to its end (its last step, or the step a stop request ended
        it at), then judges it."""
        def ended() -> dict | None:
            end, start = self._latest("run_end"), self._latest("attempt_start")
            if end is None or (start is not None and start["ts"] > end["ts"]):
                return None  # not ended, or an attempt began after (a restart)
            return end if end["steps"] == self.cfg.steps or end["stopped"] else None

        def gone() -> bool:
            """Every launcher that ran a rank has exited (75 after a failure it could not
            restart from): nothing restarts the job, and the spares' launchers would wait
            for it for ever."""
            hosts = [h for h in self._hosts() if h in self.cluster.nodes]
            return bool(hosts) and all(self.cluster.nodes[h].poll() is not None
                                       for h in hosts)
        # every node's launcher exits once the job has ended, a waiting spare released;
        # one that has not a minute after is killed and named in the verdict
        with contextlib.suppress(TimeoutError):  # (then the verdict says it did not finish)
            self._wait(lambda: ended() or gone() or all(p.poll() is not None
                                                        for p in self.cluster.nodes.values()),
                       "the job's end", 1800)
        deadline, killed = time.time() + 60, {}
        for name, proc in self.cluster.nodes.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:  # what the pool held, for the verdict
                killed[name] = self._pool_state()
                self.cluster.kill(name)
        for judge in self.rejudge.values():  # the faults whose effects may come late
            judge()
        end = ended()
        finished = end is not None
        last = self._latest("run_end")
        result = {"finished": finished, "steps": last and last["steps"],
                  "faults": len(self.verdicts),
                  "kinds": sorted({v.kind for v in self.verdicts}),
                  "detected": sum(v.detected for v in self.verdicts),
                  "correct": sum(v.correct for v in self.verdicts),
                  "committed_checkpoints_lost": self._lost_checkpoints()}
        result["left_out"] = self.left_out
        result["no_room"] = self.no_room
        # the job's last step, committed: a job that ended with its last save refused
        # (its store stalled) has trained steps that no restart gets back
        result["final_checkpoint_committed"] = finished and storage.read_manifest(
            storage.step_dir(str(self.mount.root), end["steps"])) is not None
        result["nodes_killed_after_the_end"] = killed
        recoveries = [v.recover_s for v in self.verdicts if v.recover_s]
        events = self._events()
        result.update(measured_ettr(events, recoveries, self.cfg.checkpoint_every))
        result["shrinks"] = sum(v.path == "shrink" for v in self.verdicts)
        result["grows"] = sum(v.returned == "grow" for v in self.verdicts)
        result["below_full_s"] = time_below(events, self.cfg.nodes)
        resized = {size for _, size in sizes(events)} != {self.cfg.nodes}
        if self.cfg.reference and finished and resized:  # other reduction orders
            result["reference"] = ("not compared: the job trained at other world sizes "
                                   "(its sums ran in other orders)")
        elif self.cfg.reference and finished and not result["final_checkpoint_committed"]:
            result["reference"] = f"not compared: the job's last step {end['steps']} was not saved"
            result["bitwise_equal_to_reference"] = False
        elif self.cfg.reference and finished:
            result["bitwise_equal_to_reference"] = self._compare(end["steps"])
        result["verdicts"] = [asdict(v) for v in self.verdicts]
        if self.cfg.mix:
            result["mix"] = {"weights": self.cfg.mix, "source": self.cfg.mix_source}
            result.update(weighted(result["verdicts"], self.cfg.mix))
        return result

    def _lost_checkpoints(self) -> list[int]:
        """Committed steps that are neither retired by retention, nor the one chaos broke,
        nor still whole."""
        # retired by retention while committed; a rejected one chaos did not break was lost
        removed = {e["step"] for e in self._events("checkpoint_removed") if e.get("committed")}
        wrongly_rejected = {e["step"] for e in self._events("checkpoint_rejected")} - self.truncated
        lost = sorted(wrongly_rejected)
        for e in self._events("checkpoint_committed"):
            step = e["step"]
            if step in removed or step in self.truncated or step in wrongly_rejected:
                continue
            url = storage.step_dir(str(self.mount.root), step)
            if storage.read_manifest(url) is None or storage.verify(url, checksums=True):
                lost.append(step)
        return sorted(set(lost))

    def _compare(self, final_step: int) -> bool:
        """Trains the same job without faults at the same world size, then compares the
        final weights bit for bit. The reference saves only its last step and checks no
        replicas (neither changes the weights): it is a quarter of a short soak's time."""
        import torch

        from llmtrain.checkpoint.shards import load_unsharded
        ref = self.dir / "reference"
        skips = ",".join(map(str, skipped_at_last(self._events())))
        # the job's LR schedule (llmtrain's trainer; a script's schedule is its own, and
        # must not depend on training.steps, which the reference ends at the job's end)
        worker = (["-m", "llmtrain", "train"] if not self.script else [self.script])
        schedule = [] if self.script else ["--optim.decay_steps", str(self.cfg.steps)]
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={self.cfg.nodes}", *worker,
             *self.train_args, "--training.steps", str(final_step), *schedule,
             "--training.run_dir", str(ref), "--health.monitor", "false",
             # (a script skips them only if its loop asks run.skipping())
             "--integrity.skip_steps", skips,
             "--checkpoint.interval_steps", str(final_step),
             "--integrity.sdc_every", "0"],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        (self.dir / "reference.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"chaos: the fault-free reference run exited {proc.returncode}; "
                               f"see {self.dir / 'reference.log'}")
        a, b = (load_unsharded(storage.step_dir(str(root), final_step))["model"]
                for root in (ref / "checkpoints", self.mount.root))
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sizes(events: list[dict]) -> list[tuple[float, int]]:
    """When the job changed size, and to what, in order: each attempt's start, and each
    shrink or grow (when agreed: every rank's trainer is built anew after it)."""
    changes = [(e["ts"], e["world_size"]) for e in events if e["event"] == "attempt_start"]
    changes += [(e["marks"]["agreed"], e["world_size"]) for e in events
                if e["event"] in ("warm_recovery", "warm_grow") and e["kind"] != "spare"]
    return sorted(changes)


def time_below(events: list[dict], full: int) -> float:
    """Seconds the job ran at fewer than ``full`` ranks (from a shrink, or a restart
    without a node, to the next change of size, or the end)."""
    changes = sizes(events)
    ends = [t for t, _ in changes[1:]] + [max((e["ts"] for e in events), default=0.0)]
    return sum(max(0.0, end - t) for (t, size), end in zip(changes, ends) if size < full)


def measured_ettr(events: list[dict], recover_s: list[float], checkpoint_every: int) -> dict:
    """The run's ETTR from its whole event log, the number ``llmtrain report`` states (the
    trainer's last ``goodput`` event is taken before the ranks' shutdown and the launchers'
    exit, and reads higher), against the Young/Daly model's for the save cost, the
    recoveries' mean time (``recover_s``, one per fault that cost one) and the failure rate
    measured."""
    b = goodput.account(events)
    step_times = sorted(e["step_time_s"] for e in events if e["event"] == "step")
    if b.wall_s == 0 or not step_times:
        return {}
    mtbf = b.wall_s / max(1, len(recover_s))
    restart_cost = sum(recover_s) / len(recover_s) if recover_s else 0.0
    predicted = goodput.expected_ettr(b.save_cost_s or 0.0,
                                      checkpoint_every * step_times[len(step_times) // 2],
                                      mtbf, restart_cost)
    return {"ettr": b.ettr, "ettr_predicted": predicted, "wall_s": b.wall_s,
            "badput_s": b.badput_s, "mtbf_s": mtbf, "restart_cost_s": restart_cost}


KINDS = tuple(FAULT_KINDS)  # every kind's name, as the registrations above made them


def skipped_at_last(events: list[dict]) -> list[int]:
    """The steps whose update a job skipped the last time it ran them: a restore to an
    earlier step (a warm recovery, a checkpoint, a rollback) replays a skipped step, and a
    NaN that struck once does not come again, so the replay applies it."""
    back = goodput.restores(events) + [(e["ts"], e["step"]) for e in events
                                       if e["event"] == "checkpoint_loaded"]
    last: dict[int, float] = {}
    for e in events:
        if e["event"] == "step_skipped":
            last[e["step"]] = max(last.get(e["step"], 0.0), e["ts"])
    return sorted(step for step, ts in last.items()
                  if not any(t > ts and to < step for t, to in back))


def _row(v: Verdict) -> str:
    def num(x):
        return "-" if x is None else f"{x:.1f}"
    return (f"{v.kind:<16} {v.target:<28} {'yes' if v.detected else 'NO':<4} "
            f"{num(v.detect_s):>7} {'ok' if v.correct else 'WRONG':<6} {_path(v):<11} "
            f"{num(v.recover_s):>8} {num(v.return_s):>8} "
            f"{'-' if v.steps_lost is None else v.steps_lost:>5}  {v.diagnosis[:70]}")


def _path(v: Verdict) -> str:
    """How the job recovered, and took the node back: warm, shrink+grow, cold..."""
    return "+".join(p for p in (v.path, v.returned) if p) or "-"


def table(result: dict) -> str:
    head = (f"{'fault':<16} {'target':<28} {'det':<4} {'detect_s':>7} {'diag':<6} "
            f"{'path':<11} {'recover_s':>8} {'return_s':>8} {'lost':>5}  diagnosis")
    rows = [_row(Verdict(**v)) for v in result["verdicts"]]
    summary = [f"job finished: {result['finished']} (step {result['steps']})",
               f"faults detected: {result['detected']}/{result['faults']}, diagnosed right: "
               f"{result['correct']}/{result['faults']}",
               f"committed checkpoints lost: {len(result['committed_checkpoints_lost'])}"]
    if result["finished"] and not result.get("final_checkpoint_committed", True):
        summary.append(f"the job's last step ({result['steps']}) has no committed checkpoint")
    for kind, why in result.get("left_out", {}).items():
        summary.append(f"left out: {kind} ({why})")
    if result.get("no_room"):
        summary.append(f"no room for: {', '.join(result['no_room'])} (the job neared its "
                       f"last step first: give more --steps)")
    if result.get("nodes_killed_after_the_end"):
        summary.append(f"launchers still running a minute after the job ended, killed: "
                       f"{', '.join(result['nodes_killed_after_the_end'])} (see their logs; "
                       f"the verdict has the spare pool as it was)")
    if result.get("shrinks") or result.get("grows"):
        summary.append(f"shrinks {result['shrinks']}, grows back {result['grows']}; "
                       f"{result['below_full_s']:.0f} s below full size")
    if "bitwise_equal_to_reference" in result:
        summary.append(f"final weights bitwise equal to a fault-free run: "
                       f"{result['bitwise_equal_to_reference']}")
    if "reference" in result:
        summary.append(f"final weights: {result['reference']}")
    if "ettr" in result:
        summary.append(f"ETTR measured {result['ettr']:.3f}, Young/Daly model "
                       f"{result['ettr_predicted']:.3f} (MTBF {result['mtbf_s']:.0f} s, "
                       f"restart {result['restart_cost_s']:.1f} s); badput: " + ", ".join(
                           f"{k} {v:.1f}s" for k, v in result["badput_s"].items() if v > 0.05))
    if "mix" in result:
        summary.append(f"weighted by the mix ({result['mix']['source']}): detected "
                       f"{result['weighted_detected']:.3f}, diagnosed right "
                       f"{result['weighted_correct']:.3f}, over kinds holding "
                       f"{result['mix_covered']:.3f} of its weight")
    return "\n".join([head, *rows, "", by_kind(result["verdicts"]), "", *summary])


def by_kind(verdicts: list[dict]) -> str:
    """Per fault kind: how many, detected and right, mean seconds to detect and recover,
    steps lost in all, the recovery paths taken."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return f"{sum(xs) / len(xs):.1f}" if xs else "-"
    lines = [f"{'kind':<16} {'n':>3} {'det':>4} {'right':>5} {'detect_s':>8} {'recover_s':>9} "
             f"{'lost':>5}  paths"]
    for kind in sorted({v["kind"] for v in verdicts}):
        vs = [v for v in verdicts if v["kind"] == kind]
        lines.append(f"{kind:<16} {len(vs):>3} {sum(v['detected'] for v in vs):>4} "
                     f"{sum(v['correct'] for v in vs):>5} "
                     f"{mean(v['detect_s'] for v in vs):>8} "
                     f"{mean(v['recover_s'] for v in vs):>9} "
                     f"{sum(v['steps_lost'] or 0 for v in vs):>5}  "
                     f"{','.join(sorted({_path(Verdict(**v)) for v in vs} - {'-'})) or '-'}")
    return "\n".join(lines)


def weighted(verdicts: list[dict], mix: dict[str, float]) -> dict:
    """Detection and diagnosis rates as the fleet would see them: each kind's rate
    weighted by its share of the mix, over the kinds that ran (``mix_covered``: their
    share of the mix's weight)."""
    ran = {v["kind"] for v in verdicts} & set(mix)
    total = sum(mix[k] for k in ran)

    def rate(field: str) -> float:
        return sum(mix[k] * sum(v[field] for v in verdicts if v["kind"] == k)
                   / sum(v["kind"] == k for v in verdicts) for k in ran) / total if total else 0.0
    return {"weighted_detected": rate("detected"), "weighted_correct": rate("correct"),
            "mix_covered": total / sum(mix.values())}


def passed(result: dict) -> bool:
    return (result["finished"] and result["detected"] == result["correct"] == result["faults"]
            and not result["committed_checkpoints_lost"] and not result.get("no_room")
            and result.get("final_checkpoint_committed", True)
            and result.get("bitwise_equal_to_reference", True))
