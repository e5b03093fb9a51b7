"""A hang's stuck ranks made to leave, for the warm path to replace them.

The watchdog asks (:func:`evict`), each stuck rank's supervisor (an agent, a standby
launcher whose spare holds a rank) kills it (:class:`EvictionWatch`), and its peers'
collectives then fail once its connections close. A rank whose supervisor does not
answer (its node cut off) is marked gone instead, and its peers shut their own ends of
the connections it published (:func:`publish_endpoints`).
"""

from __future__ import annotations

import json
import time

from llmtrain.distributed.signed_store import SignedStore
from llmtrain.process_origin import kill_holder
from llmtrain.recovery.roll_call import mark_gone, rank_of, where
from llmtrain.recovery.sockets import endpoints


def evict(store: SignedStore, ranks: list[int], wait_s: float) -> dict[int, list[str]]:
    """Has ``ranks`` (a hang's stuck ranks) leave, for the warm path to replace them.

    Each one's agent is asked to kill it (:class:`llmtrain.launch.agent.WarmAgent`): its
    peers' collectives then fail once its connections close. An agent that does not answer
    in ``wait_s`` is cut off from the store (a partitioned node): its rank is marked gone
    here instead, and its peers must shut their own ends of its connections. Returns those
    ranks, each with the connection ends it published (:func:`publish_endpoints`). Its
    ends and generation are read before asking: once it is gone (its agent's kill, or one
    from elsewhere), a spare may take its rank, and that spare must not be cut or marked
    gone in its stead; a rank a spare already holds counts as answered."""
    done = {r: store.add(f"evicted/{r}", 0) for r in ranks}
    was = {r: (where(store, r), json.loads(store.genuine(f"endpoints/{r}") or "[]"))
           for r in ranks}
    for r in ranks:  # asked of the process that holds it, which its supervisor knows
        holder = store.genuine(f"{was[r][0]}owner/{r}") if was[r][0] is not None else None
        if holder is not None:  # its agent still kills it, should it come back
            key = f"evict/{holder.decode()}"
            store.set(key, str(_evictions_asked(store, key) + 1))
    store.add("evictions", 1)  # what agents poll: one key, however many ranks
    deadline = time.monotonic() + wait_s

    def unanswered() -> list[int]:  # no kill said, nor a spare in its place (it died anyway)
        return [r for r in ranks if store.add(f"evicted/{r}", 0) <= done[r]
                and where(store, r) == was[r][0]]
    while (silent := unanswered()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for r in silent:
        mark_gone(store, r, was[r][0])
    return {r: was[r][1] for r in silent}


def _evictions_asked(store: SignedStore, key: str) -> int:
    """How many evictions of one process were asked: a signed count, so that an ask
    replayed from earlier is not a new one, and nobody without the job's secret asks."""
    return int(store.genuine(key) or 0)


class EvictionWatch:
    """What a supervisor of workers (an agent, a standby launcher whose spare holds a rank)
    reads to learn that the watchdog asked it to kill one (:func:`evict`): one store read
    a tick, and more only when some eviction was asked. Asks name the process
    (:func:`llmtrain.recovery.roll_call.owner`), not the rank, whose number a shrink or a
    grow changes. Only asks made after the watch began count, so a key from an earlier
    round never kills a later worker."""

    def __init__(self, store: SignedStore, holders: list[str]):
        self.store = store
        self._evictions = store.add("evictions", 0)
        self._asked = {h: _evictions_asked(store, f"evict/{h}") for h in holders}

    def asked(self) -> list[str]:
        """The processes whose eviction was asked since the last call."""
        evictions = self.store.add("evictions", 0)
        if evictions == self._evictions:
            return []
        if evictions < self._evictions:  # the store restarted: its counts begin again
            self._asked = dict.fromkeys(self._asked, 0)
        self._evictions = evictions
        new = []
        for h, seen in self._asked.items():
            if (now := _evictions_asked(self.store, f"evict/{h}")) > seen:
                self._asked[h] = now
                new.append(h)
        return new

    def kill(self, holder: str, pgid: int) -> None:
        """Kills ``holder``'s process group ``pgid`` (the worker and its children, or the
        prepared worker its hand-off process passed the attempt to), then
        says so for the rank it holds: its peers need not wait for it, and the asker
        knows."""
        kill_holder(pgid)  # with a prepared worker it handed its attempt to
        rank = rank_of(self.store, holder)
        if rank is not None:
            mark_gone(self.store, rank, holder=holder)
            self.store.add(f"evicted/{rank}", 1)


def publish_endpoints(store: SignedStore, rank: int) -> None:
    """This rank's connection ends, once its groups are formed: what its peers cut should
    it stop answering with its agent out of reach (:func:`evict`)."""
    store.set(f"endpoints/{rank}", json.dumps(endpoints()))
