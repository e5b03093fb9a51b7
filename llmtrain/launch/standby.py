"""A spare node's launcher (``llmtrain launch --standby``): it waits outside the
rendezvous and joins only when a round is short of nodes (:func:`await_vacancy`), or, with
the warm path on, runs one warm spare per local rank and supervises those that take a
lost rank's place (:func:`serve_warm`).

In torch 2.13, a spare sitting in the rendezvous while a rank (not its whole node) fails
makes the agents restart for ever: after the restart one of the three lands in the
round's wait list, the others see a "new node" and restart to admit it, and so on. A
standby launcher reads the rendezvous state from the store instead, and joins when a round
has waited for nodes for ``STANDBY_GRACE_S``: a node is gone.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import select
import subprocess
import sys
import time

from llmtrain.config import JobConfig
from llmtrain.distributed.rendezvous_wake import changes_key
from llmtrain.events import EventTail
from llmtrain.exit_codes import ExitCode
from llmtrain.launch.children import forward_signals, worker_command, worker_env
from llmtrain.launch.config import LaunchConfig
from llmtrain.launch.template import Process, Spawn
from llmtrain.reliability.health.exclusion import excluded_hosts

log = logging.getLogger(__name__)


STANDBY_GRACE_S = 3.0


class Vacancies:
    """The job's rendezvous as a spare sees it. A round is short when it has waited for
    nodes for ``STANDBY_GRACE_S`` (forming with fewer than the minimum, or running with
    fewer than the maximum), or at once when as many nodes of the last full round are known
    dead (:class:`llmtrain.recovery.presence.GoneNodes`): no survivor is still on its way; a spare takes a ticket for its place, so that no more spares
    join a round than it lacks nodes. ``restarts_only``: only a restart's round counts
    (not the first, whose nodes may still be starting, nor a running one, which a warm
    recovery may have left with a dead node's agent missing)."""

    def __init__(self, lc: LaunchConfig, restarts_only: bool = False):
        self.endpoint, self.timeout_s = lc.rdzv_endpoint, lc.join_timeout_s
        self.rdzv_id, self.restarts_only = lc.rdzv_id, restarts_only
        self._connect()
        self.min_nodes, self.max_nodes = lc.node_range
        self.short_since: float | None = None
        self._changes = 0  # the rendezvous changes announced before the last read
        self.members: set[str] = set()  # the last full round's nodes (torch's names)
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

        from llmtrain.distributed.signed_store import job_secret
        from llmtrain.recovery.presence import GoneNodes
        from llmtrain.recovery.warm import job_namespace
        self.store = self.client()
        self.backend = C10dRendezvousBackend(self.store, self.rdzv_id)
        self.gone = GoneNodes(job_namespace(self.store, self.rdzv_id)) \
            if job_secret() is not None else None
        self.broken = False

    def _known_dead(self) -> int:
        """How many nodes of the last full round this standby saw are known dead (their
        agents' presence connections closed): their places need no grace."""
        return len(self.members & self.gone()) if self.gone is not None else 0

    def _missing(self):
        """(the round's ticket key, nodes it lacks) or None."""
        self._changes = self.store.add(changes_key(self.rdzv_id), 0)  # before the state
        got = self.backend.get_state()
        state = rendezvous_state(got[0]) if got else None
        if state is None or state.closed or (self.restarts_only and state.round == 0):
            return None
        have = len(state.participants)
        if state.complete and have >= self.min_nodes:
            self.members = {str(n) for n in state.participants}
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
        if not missing or missing[0] == self.refused or (
                now - self.short_since < STANDBY_GRACE_S and self._known_dead() < missing[1]):
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


    def sleep(self, seconds: float) -> None:
        """Until the rendezvous's next announced change (a node joined, left, was dropped
        as dead: :mod:`llmtrain.distributed.rendezvous_wake`), at most ``seconds``."""
        import datetime
        try:
            self.store.wait([f"{changes_key(self.rdzv_id)}/{self._changes + 1}"],
                            datetime.timedelta(seconds=seconds))
        except store_errors():  # no change within it (or the store out: the next call says)
            pass


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
        vacancies.sleep(0.5)


class _Spare:
    """One warm spare process of a standby node, bound to the GPU ``local_rank`` from its
    start (whatever rank it takes, two spares of one node never share a device, nor a
    metrics port), and its place in the job's pool."""

    def __init__(self, cfg: JobConfig, lc: LaunchConfig, host: str, train_args: list[str],
                 local_rank: int, spawn: Spawn):
        ready, says_ready = os.pipe()
        # in a session of its own, as torchrun's workers are: an eviction kills its children too
        command = worker_command(lc) if lc.script else [sys.executable, "-m", "llmtrain", "spare"]
        self.proc = spawn(
            [*command, *train_args], stdin=subprocess.PIPE, text=True, start_new_session=True,
            env={**worker_env(cfg, lc, host), "LLMTRAIN_SPARE": "1",  # see llmtrain.start
                 "LLMTRAIN_SPARE_READY_FD": str(says_ready),
                 "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(lc.nproc_per_node)},
            pass_fds=(says_ready,))
        os.close(says_ready)
        self.ready = open(ready, "rb", buffering=0)
        from llmtrain.recovery.roll_call import owner
        self.me = owner(self.proc.pid, host)  # the process, as its presence names it
        self.place = None  # its PoolPlace, once this node's spares have joined the pool
        self.said_ready = False
        self.holder: str | None = None  # who holds a rank (roll_call.owner), once it does
        self.evictions = self.verdicts = None
        self.code: int | None = None  # its exit code, once it ended or left the pool
        self.rejoin = False  # it held a rank that the warm path did not replace
        self.replaced = False  # it held a rank, lost and replaced: the job goes on

    @property
    def waiting(self) -> bool:
        """In the pool, no rank taken yet."""
        return self.holder is None and self.code is None

    @property
    def holding(self) -> bool:
        """Running as the rank it took."""
        return self.holder is not None and self.code is None

    def look_ready(self) -> bool:
        """Whether the spare has said it is ready (imports done, its presence held); its
        place, if it has one, is marked so."""
        if not self.said_ready and select.select([self.ready], [], [], 0)[0]:
            self.said_ready = bool(self.ready.read(64))
        if self.place is not None and self.said_ready:
            self.place.ready = True
        return self.said_ready

    def take(self, plan: dict, pool, budget_s: float) -> None:
        """Hands the spare ``plan`` (a lost rank's place); from now on it is supervised as
        an agent supervises its workers."""
        from llmtrain.recovery.eviction import EvictionWatch
        from llmtrain.recovery.verdicts import Verdicts
        self.holder = self.me
        self.evictions = EvictionWatch(pool, [self.holder])
        self.verdicts = Verdicts(pool, [self.holder], budget_s)
        try:
            self.proc.stdin.write(json.dumps(plan) + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:  # it died just now: the survivors go cold in budget
            pass

    def release(self) -> None:
        """Ends a spare that left the pool: end of input, and it exits CLEAN."""
        self.proc.stdin.close()
        self.code = self.proc.wait()
        self.ready.close()

    def ended(self, rc: int, signalled: list[int]) -> None:
        """The spare holding a rank ended with ``rc``: whether this node must join a cold
        restart as a node, as an agent would restart its worker (its rank ended and the
        warm path did not replace it; once every rank ran in a spare, the job waited for a
        restart that nobody started)."""
        self.code = rc
        self.ready.close()
        done = rc in (ExitCode.CLEAN, ExitCode.FATAL, ExitCode.EXCLUDE_NODE)
        self.rejoin = not (done or signalled) and (
            rc == ExitCode.RETRYABLE or not _replaced(self.verdicts, self.holder))
        self.replaced = not (done or signalled or self.rejoin)


def serve_warm(cfg: JobConfig, lc: LaunchConfig, host: str, train_args: list[str],
               since: float, spawn: Spawn) -> tuple[int | None, list[int], bool]:
    """Warm spares, one per local rank (``--nproc-per-node``): each ``llmtrain spare``
    imports torch once, then waits for a plan on its stdin, while this launcher holds its
    place in the job's pool and hands it the plan that assigns it a lost rank. A lost
    node of N ranks finds N spares on one standby node; its ranks take this node's
    places in pool order, one device each. The spares join the pool at once (a lost rank
    is better off waiting for its imports than going cold) and say when they are ready,
    seconds later: a grow waits for that (its survivors waited 3 s for a spare's imports,
    not 0.3).

    Returns the spares' exit code, the signals forwarded to them, and whether this node
    must join a cold restart as a node (a rank one of them took ended and the warm path
    did not replace it). The code is CLEAN if the job finished (with or without them), the
    first other code of a spare that ended otherwise, and None when a cold restart's round
    lacks a node (the warm path could not replace one): the spares left the pool, and
    this node holds a place in that round, one place for the node, however many spares
    it ran.

    A spare whose rank was lost, and replaced, is followed by a new one on its device:
    the node stays warm. Once the node is excluded (a spare's GPU failed), its waiting
    spares leave the pool: a rank given to one would refuse to start there."""
    return _WarmStandby(cfg, lc, host, train_args, since, spawn).serve()


class _WarmStandby:
    """:func:`serve_warm`'s state: the node's spares, their pool, what is known of the
    job (ended, this node excluded, a restart's round joined)."""

    def __init__(self, cfg: JobConfig, lc: LaunchConfig, host: str, train_args: list[str],
                 since: float, spawn: Spawn):
        from llmtrain.recovery.pool import PoolPlace, join_pool
        from llmtrain.recovery.warm import job_namespace
        self.cfg, self.lc, self.host, self.train_args, self.since = (cfg, lc, host,
                                                                      train_args, since)
        self.spawn = spawn
        self.vacancies = Vacancies(lc, restarts_only=True)
        self.pool = job_namespace(self.vacancies.store, lc.rdzv_id,
                                  reconnect=self.vacancies.client)
        self.spares = [_Spare(cfg, lc, host, train_args, k, spawn)
                       for k in range(lc.nproc_per_node)]
        self.procs = [s.proc for s in self.spares]
        self.signalled = forward_signals(self.procs)  # preemption reaches a rank held
        # one block of numbers: the pool hands a lost node's ranks to one node's spares
        first = join_pool(self.pool, len(self.spares))
        for k, s in enumerate(self.spares):
            s.place = PoolPlace(self.pool, cfg.warm.budget_s, first + k, holder=s.me)
        self.vacancy = self.done = self.excluded = False
        self.outage = _StoreOutage("warm spare")
        self.ends = EventTail(cfg.training.run_dir, keep=frozenset({"run_end"}))  # what is new

    def serve(self) -> tuple[int | None, list[int], bool]:
        """Until no spare runs; :func:`serve_warm`'s outcome."""
        looked = time.monotonic()
        while any(s.code is None for s in self.spares):
            for k, s in enumerate(self.spares):  # a rank's end is known without the
                if s.holding and (rc := s.proc.poll()) is not None:  # store, its verdict
                    self._end(k, rc)  # is not
            try:
                self._look()
                self.outage.answered()
            except store_errors() as e:  # no plan can come meanwhile: look again
                self.outage.failed(e)
                self._ended()
                if self.done or self.excluded:  # the job ended without them (and without
                    self._release()  # its store perhaps), or none may take a rank here
                time.sleep(0.5)
                continue
            if time.monotonic() - looked > 0.5:
                looked = time.monotonic()
                self._leave_if_unneeded()
            time.sleep(0.05)
        self._ended()
        rc = None if self.vacancy and not self.done else next(
            (s.code for s in self.spares if s.code != ExitCode.CLEAN), ExitCode.CLEAN)
        return rc, self.signalled, not self.done and any(s.rejoin for s in self.spares)

    def _ended(self) -> None:
        self.done = self.done or finished(self.ends.read(), self.cfg.training.steps, self.since)

    def _look(self) -> None:
        """Each spare's turn: a waiting one kept in the pool and handed its plan once one
        comes; a rank held, its eviction answered. Store errors raise."""
        from llmtrain.recovery.pool import PoolPlace, assignment, leave_pool
        for k, s in enumerate(self.spares):
            if s.waiting:
                ready = s.look_ready()
                if s.place is None:  # a new spare, after one whose rank was lost: in the
                    if not ready:  # pool once ready, its presence held (a node killed
                        if s.proc.poll() is not None:  # before then left a place that
                            s.release()  # no grow got past)
                        continue
                    s.place = PoolPlace(self.pool, self.cfg.warm.budget_s, holder=s.me)
                    s.place.ready = True
                s.place.keep()  # in the pool, ready when the spare is, after a restart too
                if (plan := assignment(self.pool, s.place.number)) is not None:
                    s.take(plan, self.pool, self.cfg.warm.budget_s)
                elif s.proc.poll() is not None:  # it died waiting (a signal): no
                    leave_pool(self.pool, s.place.number)  # survivor may count on it
                    s.code = s.proc.returncode
            elif s.holding and answer_evictions(s.proc, s.evictions):
                self._end(k, s.proc.wait())

    def _end(self, k: int, rc: int) -> None:
        """Spare ``k``, which held a rank, ended with ``rc``; one whose rank was replaced
        is followed by a new spare on its device."""
        self.spares[k].ended(rc, self.signalled)
        self.excluded = self.excluded or self.host in excluded_hosts(self.cfg.training.run_dir)
        if self.spares[k].replaced and not (self.done or self.excluded or self.signalled):
            log.info("warm spare: the rank held on local rank %d was lost and replaced; a "
                     "new spare waits on that device", k)
            self.spares[k] = _Spare(self.cfg, self.lc, self.host, self.train_args, k,
                                    self.spawn)
            self.procs.append(self.spares[k].proc)

    def _leave_if_unneeded(self) -> None:
        """The waiting spares leave the pool once the job ended, this node was excluded,
        a rank one held was not replaced (the job goes cold), or a restart's round lacks a
        node (this node holds a ticket for its place, taken only while no spare holds a
        rank: the node joins a round with all its devices)."""
        self._ended()
        rejoin = any(s.rejoin for s in self.spares)
        try:
            self.vacancy = self.vacancy or (
                not (self.done or rejoin or any(s.holding for s in self.spares))
                and self.vacancies.claim())
            if self.done or self.vacancy or rejoin or self.excluded:
                self._release(leave=True)
        except store_errors() as e:
            self.outage.failed(e)

    def _release(self, leave: bool = False) -> None:
        """Ends the waiting spares (``leave``: those whose place leaves the pool now; a
        claimed one waits for its plan)."""
        for s in self.spares:
            if s.waiting and (not leave or s.place is None or s.place.leave()):
                s.release()


def _replaced(verdicts, holder: str) -> bool:
    """The warm path's verdict on the rank a spare held; a store that is out gives none,
    and this node joins the cold restart, as a dead worker's agent would restart it."""
    try:
        return verdicts.replaced(holder)
    except store_errors() as e:
        _StoreOutage("warm spare's launcher").failed(e)
        return False


def answer_evictions(spare: Process, evictions) -> bool:
    """One look, for a spare that took a rank, at what an agent watches for its workers:
    the spare is killed (True) when a hang's watchdog asked
    (:func:`llmtrain.recovery.eviction.evict`; without this, a stopped spare went
    unanswered and its peers cut a later one). A store that is out raises (nobody can
    ask meanwhile)."""
    for holder in evictions.asked():  # it watches this spare alone
        with contextlib.suppress(*store_errors()):  # killed first, then said
            evictions.kill(holder, spare.pid)
        return True
    return False


def finished(events: list[dict], steps: int, since: float) -> bool:
    """The run has ended since ``since``: at its last step, or early on a stop request."""
    return any(e["event"] == "run_end" and e["ts"] >= since
               and (e["steps"] == steps or e.get("stopped")) for e in events)
