"""torchrun's elastic agent, taught two things: its rendezvous wakes at each change
(:mod:`llmtrain.distributed.rendezvous_wake`, on every launch), and a worker the warm path
replaced is not a failure of the node (with ``warm.enable``).

Stock torchrun answers any worker's death by stopping every other worker on the node and
re-forming the rendezvous, which makes every other node's agent restart its workers too:
the survivors a warm recovery keeps alive would be killed. With ``warm.enable``,
``llmtrain launch`` runs torchrun through this module instead. When a worker dies, the
agent says at once (on SIGCHLD) that its rank is gone, so the survivors need not wait for
its report, then waits (up to ``warm.budget_s``) for the warm path's verdict in the
rendezvous store: the rank was replaced by a spare (the agent forgets the worker and keeps
the others running), or the job goes cold (the agent does what torchrun always does). When
no survivor has begun to agree within a few seconds, nobody is left to recover warm (every
rank died at once) and the agent goes cold without waiting out the budget; a worker that
exited RETRYABLE (a preemption's save) sends it cold at once. After a warm recovery, an
agent whose workers were all replaced has nothing left to supervise and ends, and no agent
waits in torchrun's exit barrier, which a lost node's agent never reaches; an agent that
ends so leaves the rendezvous open for the job's later rounds. A worker a hang's report
named as stuck is killed by its agent when the watchdog asks
(:func:`llmtrain.recovery.eviction.evict`), so that its peers' collectives fail and the warm
path replaces it like any dead worker. Everything else is torchrun.

    python -m llmtrain.launch.agent [--warm] [--after-go] <torchrun arguments>
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta

from llmtrain import collector
from llmtrain.log import log_to_stderr

with collector.paused():  # torchrun's agent: 0.8 s less CPU to start (llmtrain.collector)
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from llmtrain.distributed.signed_store import job_secret, report_forged_to
    from llmtrain.events import EventLog
    from llmtrain.exit_codes import ExitCode
    from llmtrain.distributed.rendezvous_wake import close_all, wake
    from llmtrain.recovery.eviction import EvictionWatch
    from llmtrain.distributed.process_group import node_name
    from llmtrain.placement import refuse_if_excluded
    from llmtrain.recovery.presence import (RDZV_NODE, ROUND_NODES_ENV, GoneNodes,
                                            hold_presence, say_bye)
    from llmtrain.recovery.roll_call import mark_holder_gone, owner
    from llmtrain.recovery.verdicts import Verdicts
    from llmtrain.recovery.warm import outside_store
    from llmtrain.reliability.health.exclusion import excluded_hosts

# by name: run as ``python -m llmtrain.launch.agent``, __name__ is "__main__"
log = logging.getLogger("llmtrain.launch.agent")


class Agent(LocalElasticAgent):
    """torchrun's agent with its rendezvous woken by changes, and its node's death known
    at once: it holds a presence connection named for its rendezvous node, and drops the
    nodes whose connections closed (:mod:`llmtrain.recovery.presence`)."""

    _reported = 0  # the dropped nodes already said in the run's events
    _reported_early = 0  # the rounds completed at once already said

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        handler = worker_group.spec.rdzv_handler
        _refuse_if_excluded(handler)
        job = _job_store()
        woken = wake(handler, gone=GoneNodes(job) if job is not None else None)
        if job is not None and woken is not None:
            hold_presence(RDZV_NODE + str(handler._this_node), PRESENCE_TIMEOUT)
        super()._rendezvous(worker_group)
        if woken is not None:
            _say(woken.dropped[self._reported:], woken.closed_early[self._reported_early:])
            self._reported, self._reported_early = len(woken.dropped), len(woken.closed_early)

    def _start_workers(self, worker_group: WorkerGroup):
        # the round's nodes, which a cold generation's ranks watch while their group forms
        # (torch's c10d rendezvous; another handler's ranks watch none)
        holder = getattr(worker_group.spec.rdzv_handler, "_state_holder", None)
        if holder is not None:
            os.environ[ROUND_NODES_ENV] = ",".join(sorted(map(str, holder.state.participants)))
        return super()._start_workers(worker_group)


class WarmAgent(Agent):
    # set by main(): the rendezvous store is an `llmtrain rdzv-store`, not this agent's, so
    # this agent may end before the job does
    store_outside = False
    _store_out = False  # the last request to the store failed

    def _start_workers(self, worker_group: WorkerGroup):
        started = super()._start_workers(worker_group)
        budget = float(os.environ.get("LLMTRAIN_WARM_BUDGET_S", 30))
        if os.environ.get("LLMTRAIN_RUN_DIR"):  # where forged control keys are reported
            report_forged_to(EventLog(os.environ["LLMTRAIN_RUN_DIR"], rank=None))
        tolerate_store_outages(worker_group.spec.rdzv_handler)
        try:
            self._warm_store = outside_store(timedelta(seconds=budget))
            return self._watch_workers(budget, started)
        except (RuntimeError, OSError) as e:  # DistError: the store is out
            log.warning("the rendezvous store did not answer as the workers started (%s): "
                        "this node's workers are supervised as torchrun does, without the "
                        "warm path's verdicts", e)
            self._warm_store, self._replacements = None, 0
            return started


    def _watch_workers(self, budget: float, started):
        self._replaced: set[int] = set()  # local ranks
        # each worker by its process, not its rank: a shrink or a grow renumbers the ranks
        self._holders = {lr: owner(h.proc.pid)
                         for lr, h in self._pcontext.subprocess_handlers.items()}
        self._verdicts = Verdicts(self._warm_store, list(self._holders.values()), budget) \
            if self._warm_store is not None else None
        self._replacements = self._count("replacements")
        self._evictions = EvictionWatch(self._warm_store, list(self._holders.values())) \
            if self._warm_store is not None else None
        self._said_gone: set[int] = set()
        if self._warm_store is not None:
            signal.signal(signal.SIGCHLD, self._child_exited)
        return started

    def _child_exited(self, _signum, _frame) -> None:
        """A worker ended (SIGCHLD): one that failed is marked gone at once, so that the
        survivors' agreement need not wait ``warm.settle_s`` for its report, nor until the
        agent's next look (``--monitor-interval``). A clean exit, or a RETRYABLE one (an
        agreed stop), is no loss."""
        handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None) or {}
        for local_rank, handler in handlers.items():
            code = handler.proc.poll()
            if code in (None, 0, ExitCode.RETRYABLE) or local_rank in self._said_gone:
                continue
            self._said_gone.add(local_rank)
            with self._store_may_fail("saying a dead worker's rank is gone"):
                mark_holder_gone(self._warm_store, self._holders[local_rank])

    @contextlib.contextmanager
    def _store_may_fail(self, doing: str):
        """A store that errs or stalls (a reset connection, a restart) must not reach
        torchrun's loop, which would stop every worker of the node: what needed the store
        is skipped, and said in a log line."""
        try:
            yield
        except (RuntimeError, OSError, ValueError) as e:  # DistError, a broken reply
            if not self._store_out:  # once an outage: the monitor looks every second
                log.warning("the rendezvous store failed while %s (%s: %s); the workers go "
                            "on", doing, type(e).__name__, e)
            self._store_out = True
        else:
            self._store_out = False

    def _count(self, key: str) -> int:
        if self._warm_store is not None:
            with self._store_may_fail(f"reading {key}"):
                return self._warm_store.add(key, 0)
        return 0

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        handlers = getattr(self._pcontext, "subprocess_handlers", None)
        if self._warm_store is None or handlers is None:
            return super()._monitor_workers(worker_group)
        self._kill_evicted(worker_group, handlers)
        codes = {lr: h.proc.poll() for lr, h in handlers.items() if lr not in self._replaced}
        failed = [lr for lr, code in codes.items() if code not in (None, 0)]
        # A worker that exited RETRYABLE stopped on purpose (a preemption's agreed save, a
        # cold verdict): no spare replaces it, so there is no verdict to wait for.
        if failed and (any(codes[lr] == ExitCode.RETRYABLE for lr in failed)
                       or not all(self._was_replaced(lr) for lr in failed)):
            return super()._monitor_workers(worker_group)  # cold: what torchrun does
        if not self._replaced:
            return super()._monitor_workers(worker_group)
        left = {lr: code for lr, code in codes.items() if lr not in self._replaced}
        if (left or self.store_outside) and all(code == 0 for code in left.values()):
            if not left:
                self._leave_rendezvous_open(worker_group)
            return RunResult(state=WorkerState.SUCCEEDED, return_values={  # torchrun
                w.global_rank: None for w in worker_group.workers})  # wants every worker
        # Workers still running, or none left here while this agent holds the job's store:
        # the launcher stops an idle agent once the run has ended.
        return RunResult(state=WorkerState.HEALTHY)

    def _kill_evicted(self, worker_group: WorkerGroup, handlers: dict) -> None:
        """Kills the workers (and their children) a hang's watchdog asked to evict, and
        says so; their deaths then take the usual way to a warm verdict."""
        asked = []
        with self._store_may_fail("looking for evictions"):
            asked = self._evictions.asked()
        for lr, holder in self._holders.items():
            if holder in asked and lr not in self._replaced:
                self._evictions.kill(holder, handlers[lr].proc.pid)

    @staticmethod
    def _leave_rendezvous_open(worker_group: WorkerGroup) -> None:
        """torchrun closes the rendezvous for every node when its agent ends (a run that
        finished: no round may follow). This agent ends because the warm path replaced
        all its workers, while the job goes on: a later cold restart needs the rendezvous
        open, and would fail in every node's agent with RendezvousClosedError."""
        worker_group.spec.rdzv_handler.shutdown = lambda: True

    def _exit_barrier(self) -> None:
        """torchrun's barrier waits (300 s) for every agent of the round; after a warm
        recovery in this round, a lost node's agent never comes, so it is skipped. So it
        is when the store restarted during the run: torch's client of it stays broken,
        and the barrier would end in a traceback."""
        if self._count("replacements") != self._replacements:
            return
        try:
            self._store.check(["llmtrain/exit-barrier"])
        except (RuntimeError, OSError) as e:  # DistNetworkError
            log.warning("torchrun's connection to the rendezvous store broke during the run "
                        "(the store restarted: %s); its exit barrier is skipped",
                        str(e).splitlines()[0][:200])
            return
        super()._exit_barrier()

    def _was_replaced(self, local_rank: int) -> bool:
        """Waits for the warm path's verdict on a dead worker's rank."""
        if local_rank not in self._replaced:
            # a store that fails now gives no verdict: the worker is dead, so the node
            # goes cold as torchrun would
            with self._store_may_fail("waiting for the warm path's verdict"):
                if self._verdicts.replaced(self._holders[local_rank]):
                    self._replaced.add(local_rank)
        return local_rank in self._replaced


PRESENCE_TIMEOUT = timedelta(seconds=30)


def _excluded() -> bool:
    """Whether this node was excluded from the run (its record in the run directory); a
    record that cannot be read is said and counts as none (the agent says its bye)."""
    run_dir = os.environ.get("LLMTRAIN_RUN_DIR")
    try:
        return bool(run_dir) and node_name() in excluded_hosts(run_dir)
    except (OSError, ValueError) as e:
        log.warning("could not read the run's excluded hosts (%s)", e)
        return False


def _refuse_if_excluded(handler) -> None:
    """Exits EXCLUDE_NODE, before its agent joins another round, when this node was
    excluded from the run (a failed GPU, a corrupted replica). Its workers refuse to start
    anyway; had the agent joined the round first, the others' ranks waited out the
    process group's creation timeout (300 s) for ranks that had already left. The
    rendezvous stays open for the others."""
    if _excluded():
        handler.shutdown = lambda: True
        refuse_if_excluded(os.environ["LLMTRAIN_RUN_DIR"])


def _job_store():
    """The job's signed namespace in an external rendezvous store, or None."""
    if "LLMTRAIN_RDZV_ENDPOINT" not in os.environ or job_secret() is None:
        return None
    try:
        return outside_store(PRESENCE_TIMEOUT)
    except (RuntimeError, OSError) as e:  # the store out: torch's keep-alive still expires
        log.warning("the rendezvous store did not answer (%s); dead nodes leave the "
                    "rendezvous when their keep-alive expires", e)
        return None


def _say(dropped: list[str], closed_early: list[tuple[int, list[str], list[str]]]) -> None:
    """The run's events of the nodes this agent's rendezvous dropped as dead, and of the
    rounds it completed without torch's last call."""
    if not os.environ.get("LLMTRAIN_RUN_DIR") or not (dropped or closed_early):
        return
    events = EventLog(os.environ["LLMTRAIN_RUN_DIR"], rank=None)
    for node in dropped:  # torch's node name: host_pid_n
        events.emit("rendezvous_node_dropped", node=node, host=node.rsplit("_", 2)[0],
                    why="its agent's presence connection closed")
    for round_, nodes, dead in closed_early:
        events.emit("rendezvous_round_completed_early", round=round_, nodes=nodes,
                    dead=dead)
    events.close()


def tolerate_store_outages(handler) -> None:
    """torchrun's agent asks its rendezvous ``handler`` every monitor interval whether
    nodes wait to join; a store that stalls or restarts made that raise, and torchrun then
    stopped every worker of the node (SIGTERM: they took it for a preemption). While the
    store is out, no node waits as far as the agent can know: it says so, once an outage.
    (torch's client of a store that restarted stays broken: the agent's next rendezvous,
    a cold restart, fails, and its launcher exits RETRYABLE for the scheduler.) A SIGTERM
    that torchrun's handler turns into an exception while the look runs is not an outage:
    taken for one, it was lost, and the node's preemption never began."""
    if getattr(handler, "_llmtrain_tolerant", False):
        return
    from torch.distributed.elastic.multiprocessing.api import SignalException
    asked, out = handler.num_nodes_waiting, [False]

    def num_nodes_waiting() -> int:
        try:
            waiting = asked()
        except SignalException:  # torchrun's SIGTERM handler raised it here (a preemption):
            raise                # the agent's, not the store's
        except Exception as e:  # noqa: BLE001 - RendezvousError, DistError, ...
            if not out[0]:
                log.warning("the rendezvous store did not answer torchrun's look for waiting "
                            "nodes (%s: %s); the workers go on", type(e).__name__, e)
            out[0] = True
            return 0
        out[0] = False
        return waiting
    handler.num_nodes_waiting = num_nodes_waiting
    handler._llmtrain_tolerant = True


def main(argv: list[str]) -> None:
    log_to_stderr()
    with collector.paused(freeze=True):  # torch's modules live as long as the agent
        import torch.distributed.launcher.api as launcher
        from torch.distributed.run import main as torchrun
    warm = argv[:1] == ["--warm"]
    argv = argv[1:] if warm else argv
    if argv[:1] == ["--after-go"]:  # a standby's: imported, it joins when told
        argv = argv[1:]
        with collector.paused(freeze=True):  # what torchrun imports as it starts
            importlib.import_module("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend")
            importlib.import_module("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
        if sys.stdin.readline().strip() != "go":
            return
    launcher.LocalElasticAgent = WarmAgent if warm else Agent
    WarmAgent.store_outside = any(a.startswith("--rdzv-conf") and "is_host=0" in a
                                  for a in argv)
    try:
        torchrun(argv)
    finally:
        # An agent that ends is no loss (one killed is), but an excluded node's leaves
        # for good, whether it left before a round or its worker stopped it (SIGTERM):
        # without its bye, the others' rendezvous drops it at once, where a restart's
        # round waited for it until torchrun's keep-alive expired
        if not _excluded():
            say_bye()
        close_all()


def exit_without_teardown(run: Callable[[], None]) -> None:
    """Runs ``run`` and exits with the code Python would give it, without the
    interpreter's teardown: a thread still inside a store client's C++ call when the
    agent ends (its workers replaced, the job over) made that teardown abort the agent
    (SIGABRT, "terminate called without an active exception", its launcher exiting 75
    where the node had ended clean; in a CI run here). An exception is logged with its
    traceback; logs and stdio are flushed first."""
    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if isinstance(e.code, str):
            log.error("%s", e.code)
    except KeyboardInterrupt:
        raise  # Python's own exit: by the signal
    except BaseException:
        log.exception("the agent failed")
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(lambda: main(sys.argv[1:]))
