"""The job's pool of warm spares, in the rendezvous store outside the workers.

A spare registers at the job level (``spares/registered`` numbers it) and waits; a decider
claims spares for the lost ranks it replaces, or for a grow, and tells each its place
(``spares/<number>/plan``). A spare leaves the pool when the job ends, or when a cold
restart's round waits for a node it lacks (the warm path could not replace one): then it
joins that round as a node. Each spare's slot is claimed or withdrawn by one
``compare_set``, so a spare is never both claimed by a survivor and gone.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from llmtrain.distributed.signed_store import SignedStore

log = logging.getLogger(__name__)


def spares_waiting(store: SignedStore) -> int:
    """Spares in a job's pool, neither claimed nor withdrawn."""
    return (store.add("spares/registered", 0) - store.add("spares/claimed", 0)
            - store.add("spares/left", 0))


def spares_ready(store: SignedStore, wanted: int) -> bool:
    """Whether the ``wanted`` spares a claim would take have said they are ready (imports
    done, the model built once): a grow waits for that, while a lost rank takes any spare,
    ready or not."""
    chosen = _choose(store, _open_places(store), wanted, frozenset())
    return len(chosen) == wanted and all(_ready(store, n) for n in chosen)


def _open_places(store: SignedStore) -> list[int]:
    """The pool's places neither claimed nor left, in order."""
    number, registered = store.add("spares/claimed", 0), store.add("spares/registered", 0)
    return [n for n in range(number + 1, registered + 1)
            if not store.genuine(f"spares/{n}/state")]


def _ready(store: SignedStore, number: int) -> bool:
    return store.check([f"spares/{number}/ready"])


def _host(store: SignedStore, number: int) -> str | None:
    """The node of place ``number``'s spare (None: its holder was not said)."""
    holder = store.genuine(f"spares/{number}/holder")
    return holder.decode().rpartition(":")[0] if holder else None


def _choose(store: SignedStore, places: list[int], wanted: int, avoid: frozenset[str],
            apart: frozenset[str] = frozenset()) -> list[int]:
    """Which of the open ``places`` a claim of ``wanted`` takes: several from one node (a
    lost node's ranks go to one standby node); a node not in ``avoid`` before one that
    is, then one not in ``apart`` before one that is; ready spares before spares still
    importing; else pool order. Empty when no node has that many open places (the
    in-order claim then takes what there is)."""
    # a place's node is read only where it decides: one place wanted and none to avoid
    needed = wanted > 1 or bool(avoid) or bool(apart)
    hosts = {n: _host(store, n) if needed else None for n in places}
    if wanted == 1:
        groups = [[n] for n in places]
    else:
        by_host: dict[str | None, list[int]] = {}
        for n in places:
            by_host.setdefault(hosts[n], []).append(n)
        groups = [mine[:wanted] for mine in by_host.values() if len(mine) >= wanted]
    if not groups:
        return []
    return min(groups, key=lambda g: (hosts[g[0]] in avoid, hosts[g[0]] in apart,
                                      not all(_ready(store, n) for n in g), g[0]))


def _claim_ahead(store: SignedStore, places: list[int]) -> bool:
    """Claims ``places`` out of order (state ``AHEAD``: the in-order claim passes over
    them, as over withdrawn ones, and they count in ``spares/left`` until then); all or
    none (False: one was withdrawn or claimed meanwhile)."""
    taken = []
    for n in places:
        if store.claim(f"spares/{n}/state", AHEAD).decode() != AHEAD:
            for t in taken:
                store.set(f"spares/{t}/state", "")
            store.add("spares/left", -len(taken))
            return False
        taken.append(n)
        store.add("spares/left", 1)
    return True


AHEAD = "claimed-ahead"  # a place's state: claimed out of order (see claim)


def join_pool(store: SignedStore, count: int = 1) -> int:
    """A spare's number in the job's pool (its plan will come to ``spares/<number>/plan``),
    or the first of ``count`` consecutive numbers, one node's spares (a claim of several
    takes one node's, see :func:`claim`)."""
    return store.add("spares/registered", count) - count + 1


def leave_pool(store: SignedStore, number: int) -> bool:
    """Takes spare ``number`` out of the pool (the job ended, or a cold restart needs it as
    a node). False when a survivor claimed it first: its plan is on the way. One that left
    already (:func:`withdraw`, its process gone) is not counted again."""
    state = f"spares/{number}/state"
    if store.genuine(state) == b"left":
        return True
    if store.claim(state, "left").decode() != "left":
        return False
    store.add("spares/left", 1)
    return True


def withdraw(store: SignedStore, holder: str) -> bool:
    """Takes the place of the waiting spare process ``holder`` (see
    :func:`llmtrain.recovery.roll_call.owner`) out of the pool, its process gone without a
    word (its node died, its launcher was killed): a claim no longer picks it, where the
    recovery that did waited ``warm.budget_s`` for it, then went cold. False when it held
    no place, or was claimed or left already."""
    number = store.genuine(f"spares/of/{holder}")
    if number is None or store.genuine(f"spares/{int(number)}/state"):
        return False
    if not leave_pool(store, int(number)):
        return False
    log.info("spare %s (place %d) is gone: out of the pool", holder, int(number))
    return True


def withdraw_node(store: SignedStore, host: str) -> list[int]:
    """Takes every spare waiting on node ``host`` out of the pool, as that node leaves the
    job (a GPU of its failed: the node is excluded, its launcher exits, and its spares go
    with it); returns their places. Done before the node's rank says it is gone: a claim
    made meanwhile took such a spare, which never came, and the recovery waited
    ``warm.budget_s`` for it, then went cold (seen in a chaos run with tensor parallelism:
    66 s, where a spare elsewhere, or a shrink, takes seconds)."""
    gone = [n for n in _open_places(store) if _host(store, n) == host and leave_pool(store, n)]
    if gone:
        log.info("the spare(s) at place(s) %s leave the pool with their node %s", gone, host)
    return gone


def claim(store: SignedStore, wanted: int, avoid: frozenset[str] = frozenset(),
          apart: frozenset[str] = frozenset()) -> list[int]:
    """Claims ``wanted`` spares of the pool; returns their numbers. Fewer than ``wanted``
    (as many as were found before the pool ran out): too few spares wait, and none stays
    claimed, the pool put back as it was, so that the spares that register later get used.

    Which: several from one standby node (a lost node's ranks); a spare on none of the
    nodes in ``avoid`` first (the nodes that lost the ranks: one lost whole may still
    list its waiting spares, one excluded for a failed GPU is about to take them out, and
    a claim of such a spare waited ``warm.budget_s`` for it, then went cold); then on
    none of the nodes in ``apart`` (those of the lost ranks' buddies and wards: a rank
    there shares a node with the rank that holds its replica, or whose replica it holds,
    and that node's loss would take both, which only the cold path recovers; taken where
    no other spare waits, and said); a spare that is ready before one still importing (a
    standby node that came back: seconds on a CPU, more with a GPU's context); else in
    pool order, passing over spares that withdrew meanwhile."""
    places = _open_places(store)
    chosen = _choose(store, places, wanted, avoid, apart)
    if chosen and chosen != places[:wanted] and _claim_ahead(store, chosen):
        _say_if_beside(store, chosen, apart)
        return chosen
    taken, skipped = [], 0
    while len(taken) < wanted:
        number = store.add("spares/claimed", 1)
        if number > store.add("spares/registered", 0):
            _unclaim(store, taken, skipped)
            return taken
        if store.claim(f"spares/{number}/state", "claimed").decode() == "claimed":
            taken.append(number)
        else:  # withdrawn (to join a cold restart, or the job ended), or claimed ahead
            skipped += 1
            store.add("spares/left", -1)
    _say_if_beside(store, taken, apart)
    return taken


def _say_if_beside(store: SignedStore, taken: list[int], apart: frozenset[str]) -> None:
    beside = sorted({h for n in taken if apart and (h := _host(store, n)) in apart})
    if beside:
        log.warning("no other spare waited: spare(s) %s take lost ranks on %s, beside the "
                    "buddy or ward of one; a loss of that node now needs the cold path",
                    taken, ", ".join(beside))


def _unclaim(store: SignedStore, taken: list[int], skipped: int) -> None:
    """Puts the pool back as it was before a claim that found too few spares."""
    for number in taken:
        store.set(f"spares/{number}/state", "")
    store.add("spares/left", skipped)
    store.add("spares/claimed", -(len(taken) + skipped + 1))


def assign(store: SignedStore, plan: dict) -> None:
    """Tells each spare ``plan`` (a :class:`llmtrain.recovery.warm.Plan` as a dict) claimed
    its place: the plan, with the spare's rank in it (what :func:`assignment` reads)."""
    for rank, number in plan["spares"].items():
        store.set(f"spares/{number}/plan", json.dumps({**plan, "rank": int(rank)}))


def assignment(store: SignedStore, number: int) -> dict | None:
    """Spare ``number``'s plan (with its ``rank``) once a survivor has written it."""
    text = store.genuine(f"spares/{number}/plan")
    return json.loads(text) if text else None


class PoolPlace:
    """A spare's place in the job's pool, as its standby launcher holds it."""

    KEEP_EVERY_S = 0.5

    def __init__(self, store: SignedStore, budget_s: float, number: int | None = None,
                 holder: str | None = None):
        """Joins the pool (``number``: the place :func:`join_pool` gave it already) for the
        spare process ``holder`` (:func:`llmtrain.recovery.roll_call.owner`), whose
        death withdraws it (:func:`withdraw`)."""
        self.store, self.budget_s, self.holder = store, budget_s, holder
        self.me = uuid.uuid4().hex
        self.ready = False  # set once the spare says it is (imports done, model built)
        self._join(number)
        self._claimed_seen: float | None = None

    def _join(self, number: int | None = None) -> None:
        self.number = number or join_pool(self.store)
        self.store.set(f"spares/{self.number}/who", self.me)
        if self.holder is not None:
            self.store.set(f"spares/{self.number}/holder", self.holder)  # its node, for claims
            self.store.set(f"spares/of/{self.holder}", str(self.number))
        self._said_ready, self._kept = False, time.monotonic()

    def keep(self) -> None:
        """Keeps this spare in the pool: says it is ready once :attr:`ready`, and every
        ``KEEP_EVERY_S`` looks that its place still names it. A store that restarted
        empty has lost the pool (and may have given the number to another spare since):
        the spare joins it again, under a new number."""
        if time.monotonic() - self._kept > self.KEEP_EVERY_S:
            self._kept = time.monotonic()
            if self.store.genuine(f"spares/{self.number}/who") != self.me.encode():
                log.warning("spare %d is no longer in the pool (the rendezvous store lost "
                            "it): it joins again", self.number)
                self._join()
        if self.ready and not self._said_ready:
            self.store.set(f"spares/{self.number}/ready", "1")
            self._said_ready = True

    def leave(self) -> bool:
        """Takes this spare out of the pool (the job ended, or a cold restart needs it as a
        node); False while a survivor's claim on it stands, its plan on the way. A claim
        whose plan has not come within ``warm.budget_s`` of this spare first finding it
        is void (its decider died between claiming and writing the plan, and the
        survivors went cold): the spare leaves all the same, where it waited claimed for
        ever, never joining the restart."""
        if leave_pool(self.store, self.number):
            return True
        now = time.monotonic()
        self._claimed_seen = self._claimed_seen or now
        if now - self._claimed_seen < self.budget_s or assignment(self.store, self.number):
            return False
        key = f"spares/{self.number}/state"
        if all(self.store.compare_set(key, claimed, "left").decode() != "left"
               for claimed in ("claimed", AHEAD)):
            return False
        log.warning("spare %d was claimed but no plan came within warm.budget_s=%g s: its "
                    "decider died; the spare leaves the pool", self.number, self.budget_s)
        return True  # the claim counted it out of the pool already (spares/claimed)
