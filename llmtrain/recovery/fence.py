"""Fencing: a rank that was cut off from the job must not write into it once the job has
re-formed without it.

A partition leaves a node's processes alive: the rest of the job replaces them (a warm
spare, or a cold restart on a spare node), and when the link comes back the cut-off ranks
carry on where they stopped, in the middle of a checkpoint write perhaps. Their shard
files would land in the job's storage beside the new members' files (a cold restart that
replays the same step commits them, and the late writer overwrites its files), and their
events would read as the job's.

The job's membership has one name at a time, its token (``<round>/g<generation>``: the
torchrun round, numbered by the store as it forms, and the warm generation within it),
kept in the rendezvous store outside the workers, signed with the job's secret
(:mod:`llmtrain.distributed.signed_store`): a value nobody with the secret wrote names no
membership, is reported, and is replaced by the reader's own. Every member names it before its group
forms, so no member trains before the token names its membership. A token only ever moves
forward, by compare-and-set from the one it replaces: a member that comes late (a warm
spare that outlasted its budget while a new round formed) finds a newer token there and is
refused, instead of rolling the job back to its own and fencing every current member out.

Before a rank creates, commits or deletes a file in the checkpoint's storage, it reads the
token. Another token there proves the job went on without it: the write is refused, and
every later one; the rank writes one ``fenced`` event, naming what it was refused and why,
and no event after it. A store it cannot reach within ``reliability.fence_timeout_s``
proves nothing either way: that write is refused (the rank cannot show it is a member),
said once per outage, and the next one asks again, so a store that comes back (a restart,
a stalled host) costs at most the saves it missed, never the rest of the run. A store that
restarted empty has lost the token: the first member to look puts its own back (a
``fence_restored`` event), and a newer membership is always put back over an older one,
so a member cut off before the restart is still refused (it may write in the moment
between the two looks, the one window a restart leaves); :func:`round_of` numbers later
rounds past a restored token.

Without a store outside the workers (a plain ``torchrun --standalone`` job) nothing
outlives a round to compare against, and nothing is fenced: such a job has no way to go
on without one of its nodes anyway.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

from llmtrain.distributed.signed_store import Forged, SignedStore
from llmtrain.events import EventLog
from llmtrain.recovery.warm import outside_store

if TYPE_CHECKING:
    import torch.distributed as dist

# The job's membership token, which :class:`Fence` keeps.
KEY = "fence/token"

log = logging.getLogger(__name__)


def order(token: str) -> tuple[int, int]:
    """Where a membership stands in the job's history: (the round's number, the
    generation); see :func:`round_of`."""
    round_id, _, gen = token.rpartition("/g")
    return int(round_id.partition("-")[0]), int(gen)


def round_of(job_store: dist.Store, outside: SignedStore | None) -> str:
    """This torchrun round's name, agreed through the round's own store:
    ``<number>-<id>``, numbered by the store ``outside`` the workers (its counter only
    grows, and every rank of a later round draws after this round formed), so rounds
    order as they came (:func:`order`); 0 without one. A store that restarted counts
    from 1 again while the fence's token restored from before may name a later round:
    the count moves past it, or this round would order before the one it follows."""
    number = outside.add("rounds", 1) if outside is not None else 0
    held = outside.genuine(KEY) if outside is not None else None
    if held and order(held.decode())[0] >= number:
        number = outside.add("rounds", order(held.decode())[0] - number + 1)
    return job_store.compare_set("warm/round", "", f"{number}-{uuid.uuid4().hex[:12]}").decode()


class Fenced(RuntimeError):
    """This rank is no longer a member of the job: its write was refused."""


class Fence:
    """One rank's fence; ``store``: its own client of the job's namespace in the store
    outside the workers, with ``timeout_s`` as its timeout (None: no such store);
    ``connect``: how to open another (by default as ``store`` was,
    :func:`llmtrain.recovery.warm.outside_store`).

    Every request to the store is bounded by ``timeout_s`` here, on a thread of its own:
    a TCPStore client waits with no timeout of its own for the answer of a store that
    stalls with its connection up (a stopped process, a host that hangs): only ``get``'s
    wait for a key is bounded, and even its cancellation then waits. A client that did
    not answer in time is dropped (its thread left to end when the store does answer),
    and the next request opens a new one."""

    def __init__(self, store: SignedStore | None, events: EventLog, timeout_s: float,
                 connect: Callable[[], SignedStore | None] | None = None):
        self.store, self.events, self.timeout_s = store, events, timeout_s
        self.connect = connect or (lambda: outside_store(timedelta(seconds=timeout_s)))
        self.token = ""
        self.expected: str | None = None  # the membership a warm recovery is joining
        self.refused: str | None = None  # why this rank is no longer a member, for good
        self.outage = False  # the store did not answer the last request
        self._wedged = False  # the client did not answer in time: open another
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """A fence travels to a save's writer process (``checkpoint.mode=async_process``)
        with the checkpoint writer, and connects to the store again there."""
        return {"token": self.token, "refused": self.refused, "timeout_s": self.timeout_s,
                "events": (self.events.run_dir, self.events.rank),
                "outside": self.store is not None}

    def __setstate__(self, state: dict) -> None:
        timeout = timedelta(seconds=state["timeout_s"])
        self.__init__(outside_store(timeout) if state["outside"] else None,
                      EventLog(*state["events"]), state["timeout_s"])
        self.token, self.refused = state["token"], state["refused"]

    def join(self, token: str) -> None:
        """This rank is a member of ``token``'s membership; called by every member before
        its group forms. Raises Fenced when the store already names a newer one. The
        token changes under the lock that the watchdog's look holds: a look that read the
        store before the join, and compared what it read with the new token after it, took
        the membership this rank was leaving for a newer one without it, and fenced the
        rank out of the recovery it was joining (seen in a chaos run, which went cold)."""
        with self._lock:
            self.token, self.expected = token, None
        if self.store is None:
            return
        current = self._ask(lambda store: store.claim(KEY, token)).decode()
        while current != token:
            if order(current) > order(token):
                with self._lock:
                    self._refuse("joining the job", f"the job re-formed as {current} before "
                                 f"this rank joined {token}: it came too late")
                raise Fenced(f"joining {token} refused: {self.refused}")
            seen = current
            current = self._ask(lambda store: store.compare_set(KEY, seen, token)
                                if seen else store.claim(KEY, token)).decode()

    def membership(self) -> str:
        """The membership this rank joined (its token; "" before it joined one)."""
        return self.token

    def round_name(self, job_store: dist.Store | None) -> str | None:
        """This torchrun round's name (:func:`round_of`), numbered by the fence's store;
        None without one (nothing outlives a round to number it)."""
        return None if self.store is None else round_of(job_store, self.store)

    def expect(self, token: str) -> None:
        """This rank agreed to join ``token``'s membership (a warm recovery): a peer that
        joins it first does not make this rank a cut-off one meanwhile."""
        with self._lock:
            self.expected = token

    def check(self, what: str) -> None:
        """Raises Fenced unless the store names this rank's membership now."""
        if self.store is None:
            return
        with self._lock:
            if self.refused is None:
                try:
                    current = self._ask(self._current).decode()
                except (RuntimeError, OSError) as e:  # DistError, TimeoutError
                    self._unreachable(what, e)
                    raise Fenced(f"{what} refused: the rendezvous store could not be reached "
                                 f"within reliability.fence_timeout_s={self.timeout_s} to "
                                 f"prove membership ({type(e).__name__})") from e
                self.outage = False
                other = self._other(current)
                if other is not None:
                    self._refuse(what, other)
        if self.refused is not None:
            raise Fenced(f"{what} refused: {self.refused}")

    def stop_if_superseded(self, what: str) -> None:
        """Raises Fenced once the store names another membership (proof this rank was
        replaced); a store it cannot reach is no such proof, and lets it go on."""
        reason = self.superseded()
        if reason is not None:
            with self._lock:
                if self.refused is None:
                    self._refuse(what, reason)
        if self.refused is not None:
            raise Fenced(f"{what} refused: {self.refused}")

    def superseded(self) -> str | None:
        """Why this rank is no longer a member, once the store names another membership;
        None while it names this one, or cannot be reached (no proof either way). The
        watchdog of a warm job asks at every tick: a rank a partition cut off shares its
        round's namespace with the spare that replaced it, and must not speak there when
        its link comes back."""
        if self.store is None:
            return None
        with self._lock:
            try:
                current = self._ask(self._current).decode()
            except (RuntimeError, OSError):
                return None
            return None if current == self.expected else self._other(current)

    def _current(self, store: SignedStore) -> bytes:
        """The membership the store names, this rank's own put back where it names none
        or an older one:

        - a forged value (no holder of the job's secret wrote it: reported) names none,
          so a stranger can neither fence the job out nor keep it from proving membership;
        - no value: the store restarted and lost its keys (a ``fence_restored`` event);
        - an older membership: a rank cut off before the restart put its own back first.
          A membership only moves forward, so the newer one is put back over it, and that
          rank finds itself superseded at its next look.
        """
        if not self.token:
            return store.get(KEY)
        try:
            current = store.get(KEY) if store.check([KEY]) else b""
        except Forged as e:
            return store.replace(KEY, e.raw, self.token)
        if not current:
            restored = store.claim(KEY, self.token)
            if restored.decode() == self.token:
                log.warning("the rendezvous store had lost the fence's token: %s restored",
                            self.token)
                self.events.emit("fence_restored", mine=self.token, host=socket.gethostname())
            return restored
        while order(current.decode()) < order(self.token):
            current = store.compare_set(KEY, current, self.token)
        return current

    def _ask(self, request: Callable[[SignedStore], bytes]) -> bytes:
        """``request(store)``'s answer within ``timeout_s``; else TimeoutError, or the
        store's error, and the client is dropped for a new one."""
        answer: dict = {}
        wedged = self._wedged

        def run() -> None:
            try:
                answer["store"] = self.connect() if wedged else self.store
                if answer["store"] is None:
                    raise RuntimeError("no rendezvous store to connect to again")
                answer["value"] = request(answer["store"])
            except Exception as e:  # noqa: BLE001 - handed to the caller
                answer["error"] = e
        thread = threading.Thread(target=run, name="llmtrain-fence", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self._wedged = True
            raise TimeoutError(f"the rendezvous store did not answer within "
                               f"{self.timeout_s} s")
        if "error" in answer:
            self._wedged = True
            raise answer["error"]
        self.store, self._wedged = answer["store"], False
        return answer["value"]

    def _refuse(self, what: str, reason: str) -> None:
        """For good: this rank is no longer a member (the lock held)."""
        self.refused = reason
        self.events.emit("fenced", what=what, reason=reason, mine=self.token,
                         host=socket.gethostname())
        self.events.silence()

    def _unreachable(self, what: str, error: Exception) -> None:
        """Said once an outage (the lock held); the events go on: a member may be talking."""
        if not self.outage:
            self.outage = True
            self.events.emit("fence_unreachable", what=what, mine=self.token,
                             timeout_s=self.timeout_s,
                             error=f"{type(error).__name__}: {error}"[:300])

    def _other(self, current: str) -> str | None:
        if current != self.token:
            return f"the job re-formed as {current} without this rank (it was {self.token})"
        return None
