"""torchrun's c10d rendezvous, woken by its changes instead of polled once a second.

Stock torchrun's dynamic rendezvous learns of another node's move by reading the whole
rendezvous state from the store: a node waiting for a round sleeps a second between reads,
and a running agent asks whether nodes wait at most once a second (the state holder's
one-second cache). A cold restart of a rank whose agent lives pays each of those in turn:
the failed node joins the wait list and sleeps, the others see it at their next look,
leave the round and sleep in the next one: 2.3 to 3.4 s of a 3.7 s restart on a 2-core
machine, most of it sleeping.

:class:`RendezvousWake` keeps torch's rendezvous and its state, and changes when a node
looks:

- a node whose write changed the round's membership (joined, left, the wait list, a round
  completed or closed; not a keep-alive heartbeat) announces it: it bumps a counter key
  and sets a key named for the counter's new value;
- each agent's watcher thread waits in the store (``wait``, no polling) for the key of
  the next change, on a connection of its own; when it comes, the agent's next read of the
  state goes to the store instead of the cache, and a node sleeping between reads of a
  round wakes at once.

With no change announced the agent reads as torch does (once a second at most), so a
store that loses the keys or an announcement that fails costs only the speed. The store
carries one small key per membership change, not per heartbeat: a job of N nodes adds
about 3N keys a cold restart, and no steady-state traffic beyond torch's own.

This reaches into torch's ``dynamic_rendezvous`` internals (its state holder, its op
executor's actions, its module-level ``_delay``), checked against torch 2.13; where they
are not as expected, the rendezvous is left as torch made it and a warning says so.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

log = logging.getLogger(__name__)

# The op executor's actions that change who is in which round; a heartbeat does not.
MEMBERSHIP_ACTIONS = ("_add_to_participants", "_add_to_wait_list", "_add_to_redundancy_list",
                      "_remove_from_participants", "_remove_from_wait_list",
                      "_remove_from_redundancy_list", "_mark_rendezvous_complete",
                      "_mark_rendezvous_closed")


@dataclass
class WakeConfig:
    # torch's own sleep between a waiting node's reads: the longest a node sleeps when no
    # change is announced (a dead node's expiry is found by reading, not announced)
    max_sleep_s: float = 1.0
    # how long the watcher's one wait in the store lasts before it is renewed
    watch_s: float = 30.0


def changes_key(run_id: str) -> str:
    """The counter of a rendezvous's announced changes (``<key>/<n>``: the n-th's key)."""
    return f"torch.rendezvous.{run_id}/llmtrain-changes"


def announce_change(store, run_id: str) -> None:
    """Wakes every node of rendezvous ``run_id`` that waits or looks (``store``: a client
    of its store): they read its state at once. Raises what the store raises."""
    n = store.add(changes_key(run_id), 1)
    store.set(f"{changes_key(run_id)}/{n}", b"")


class RendezvousWake:
    """Installs the wake on one torchrun rendezvous ``handler`` (a c10d
    ``DynamicRendezvousHandler``); :meth:`close` stops its watcher."""

    def __init__(self, handler, cfg: WakeConfig | None = None,
                 gone: Callable[[], set[str]] | None = None) -> None:
        """``gone``: the rendezvous nodes (as torch names them, ``host_pid_n``) known to be
        dead, which this node drops from the state it reads without waiting out their
        keep-alive (:class:`llmtrain.recovery.presence.GoneNodes`)."""
        self.cfg = cfg or WakeConfig()
        self._handler = handler
        self._holder = handler._state_holder
        self._store = handler._store
        self._run_id = handler._settings.run_id
        self._key = changes_key(self._run_id)
        self._gone = gone
        self.dropped: list[str] = []  # the nodes this one dropped as gone, in order
        self._node = handler._this_node
        self._min_nodes = handler._settings.min_nodes
        # the nodes of the last complete round this one read, those that left it since
        # included
        self._members: set[str] = set()
        self._members_round = -1
        # (round, its nodes, the last round's nodes it went without) for each round this
        # node completed at once
        self.closed_early: list[tuple[int, list[str], list[str]]] = []
        self._changed = threading.Event()
        self._membership_moved = False
        self._closed = threading.Event()
        self._wrap_actions(handler._op_executor)
        self._wrap_sync()
        self._watcher = threading.Thread(target=self._watch, name="rendezvous-wake",
                                         daemon=True)
        self._watcher.start()

    def _wrap_actions(self, executor) -> None:
        for name in MEMBERSHIP_ACTIONS:
            action = getattr(executor, name)

            def moved(action=action) -> None:
                action()
                self._membership_moved = True
            setattr(executor, name, moved)

    def _wrap_sync(self) -> None:
        holder, sync = self._holder, self._holder.sync

        def woken_sync():
            if self._changed.is_set() and not holder._dirty:
                self._changed.clear()
                holder._last_sync_time = -1  # past the cache: read the store
            read_at = holder._last_sync_time
            wrote = sync()
            if holder._last_sync_time != read_at and self._gone is not None:
                gone = self._read_gone()
                if gone is not None:
                    self._drop_gone(gone)
                    self._close_early(gone)
            if wrote and self._membership_moved:
                self._membership_moved = False
                self._announce()
            return wrote
        holder.sync = woken_sync

    def _read_gone(self) -> set[str] | None:
        """The nodes known dead, one store read a sync; None where the store did not
        answer (torch's keep-alive and last call still end their waits)."""
        try:
            return self._gone()
        except (RuntimeError, OSError, ValueError) as e:
            log.warning("could not read which rendezvous nodes are gone (%s)", e)
            return None

    def _drop_gone(self, gone: set[str]) -> None:
        """Drops the nodes known dead (``gone``) from the state just read, as torch drops
        a node whose keep-alive expired (its heartbeat made older than any expiry), and
        writes the state back at the next sync, so that the others, and a standby
        watching the round, see it too."""
        state = self._holder.state
        dead = [n for n in state.last_heartbeats if str(n) in gone]
        if not dead:
            return
        for node in dead:
            state.last_heartbeats[node] = datetime.fromtimestamp(0, timezone.utc)
        self._holder._sanitize()
        self._holder.mark_dirty()
        self._membership_moved = True
        self.dropped += [str(n) for n in dead]
        log.info("rendezvous %s: dropped %s, known dead (their connections closed), "
                 "without waiting out their keep-alive", self._run_id,
                 ", ".join(map(str, dead)))

    def _close_early(self, gone: set[str]) -> None:
        """Completes a forming round at once, instead of after torch's last call, when
        it holds at least the minimum of nodes and every node of the last complete round,
        and every node on the wait list, is in it or known dead: nobody it waits for is
        on the way. A node that was in neither (a standby, a new node) comes in a later
        round, as it would after the last call."""
        state = self._holder.state
        if state.complete:  # its members, with those that left it to restart
            if state.round != self._members_round:
                self._members, self._members_round = set(), state.round
            self._members |= {str(n) for n in state.participants}
            return
        have = {str(n) for n in state.participants}
        if (state.closed or not self._members or self._node not in state.participants
                or len(have) < self._min_nodes or state.deadline is None):
            return
        missing = (self._members | {str(n) for n in state.wait_list}) - have - gone
        now = datetime.now(timezone.utc)
        if missing or state.deadline <= now:
            return
        # torch's join op completes the round once its last call's deadline has passed
        state.deadline = now - timedelta(milliseconds=1)
        if self.closed_early and self.closed_early[-1][0] == state.round:
            return  # its state read again after another node's write: said already
        dead = sorted(self._members - have)
        self.closed_early.append((state.round, sorted(have), dead))
        log.info("rendezvous %s: round %d completed at once with %d node(s): the others "
                 "of the last round (%s) are known dead", self._run_id, state.round,
                 len(have), ", ".join(dead))

    def _announce(self) -> None:
        try:
            announce_change(self._store, self._run_id)
        except (RuntimeError, OSError) as e:  # DistError: the others read within a second
            log.warning("could not announce a rendezvous change (%s); the other nodes see "
                        "it at their next read", e)

    def sleep(self, seconds: float) -> None:
        """What a waiting node does between its reads: until the next announced change,
        at most ``seconds``."""
        self._changed.wait(min(seconds, self.cfg.max_sleep_s))

    def _watch(self) -> None:
        from torch.distributed import TCPStore
        try:
            store = TCPStore(self._store.host, self._store.port, is_master=False,
                             timeout=timedelta(seconds=self.cfg.watch_s))
            seen = store.add(self._key, 0)
        except (RuntimeError, OSError, AttributeError) as e:
            log.warning("the rendezvous wake's watcher could not connect (%s); this node "
                        "reads the rendezvous once a second, as torchrun does", e)
            return
        while not self._closed.is_set():
            try:
                store.wait([f"{self._key}/{seen + 1}"], timedelta(seconds=self.cfg.watch_s))
            except (RuntimeError, OSError):  # the wait's timeout, or the store out
                if self._closed.wait(0.5):
                    return
                continue
            try:
                seen = store.add(self._key, 0)  # past every change since: one wake
            except (RuntimeError, OSError):
                seen += 1
            self._changed.set()

    def close(self) -> None:
        """Stops the watcher: an announcement ends its wait (the others take it for a
        change, and read the state once more). Call before the process exits: a thread
        left waiting in the store's client aborts the interpreter's exit."""
        self._closed.set()
        self._announce()
        self._watcher.join(timeout=5)


_installed: dict[int, RendezvousWake] = {}


def close_all() -> None:
    """Stops every wake this process installed."""
    while _installed:
        _installed.popitem()[1].close()


def wake(handler, cfg: WakeConfig | None = None,
         gone: Callable[[], set[str]] | None = None) -> RendezvousWake | None:
    """The wake of ``handler``, installed on the first call; None (and a warning) where
    the handler is not torch's c10d dynamic rendezvous as this module knows it."""
    if id(handler) in _installed:
        return _installed[id(handler)]
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
        woken = RendezvousWake(handler, cfg, gone)
    except AttributeError as e:
        log.warning("torchrun's rendezvous is not the one the wake knows (%s); it is "
                    "polled once a second, as torch does", e)
        return None
    _installed[id(handler)] = woken
    executor, run = handler._op_executor, handler._op_executor.run

    def woken_run(*args, **kwargs):
        _running.wake = woken  # the sleeps of this call are this handler's
        try:
            return run(*args, **kwargs)
        finally:
            _running.wake = None
    executor.run = woken_run
    if not hasattr(dynamic_rendezvous._delay, "llmtrain_wake"):
        plain = dynamic_rendezvous._delay

        def delay(seconds) -> None:
            # the op executor's sleep between a waiting node's reads is
            # ``_delay(seconds=1)``; a first round's random skew (a tuple) stays as it is
            current = getattr(_running, "wake", None)
            if current is None or isinstance(seconds, tuple):
                plain(seconds)
            else:
                current.sleep(seconds)
        delay.llmtrain_wake = True
        dynamic_rendezvous._delay = delay
    return woken


_running = threading.local()  # the wake whose handler's op executor runs in this thread
