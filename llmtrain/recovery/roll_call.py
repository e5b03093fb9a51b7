"""A failed generation's roll call, and where each rank answers now.

Each rank of a generation is counted once (``seen/<rank>``): by its report, or by a mark
that it is gone, whichever comes first; the mark comes from the rank as it leaves, or
from its supervisor (an agent, a standby launcher) when its process died. A live rank
that has yet to meet the failure says first that it is coming (:func:`stir`), and the
``coming`` counter holds how many said so and are not counted yet: the decider waits for
them (:meth:`llmtrain.recovery.warm.WarmPath.decide`). A rank whose process dies after it
reported is recorded as such, and if it was deciding, a survivor takes over
(:func:`died_after_report`). The keys say
where to mark it: the generation a rank reports to now (``where/<rank>``), the process
that holds it there (``owner/<rank>``), and the rank a process holds (``rank_of/<holder>``),
which a shrink or a grow renumbers.
"""

from __future__ import annotations

import uuid

from llmtrain.distributed.process_group import node_name
from llmtrain.distributed.signed_store import SignedStore
from llmtrain.process_origin import holder_pid


def where(store: SignedStore, rank: int) -> str | None:
    """The key prefix of the generation ``rank`` reports to now."""
    prefix = store.genuine(f"where/{rank}")
    return prefix.decode() if prefix else None


def owner(pid: int | None = None, host: str | None = None) -> str:
    """Which process holds a rank: its node's name (default: this one's) and its id."""
    return f"{host or node_name()}:{pid or holder_pid()}"


def rank_of(store: SignedStore, holder: str) -> int | None:
    """The rank process ``holder`` (see :func:`owner`) holds now. A shrink or a grow
    renumbers the ranks: a supervisor that acted on the number its worker started with
    killed, or counted gone, another rank's process."""
    rank = store.genuine(f"rank_of/{holder}")
    return int(rank) if rank else None


def mark_holder_gone(store: SignedStore, holder: str) -> None:
    """:func:`mark_gone` for the rank process ``holder`` holds now (its supervisor saw it
    die); nothing if it never held one."""
    rank = rank_of(store, holder)
    if rank is not None:
        mark_gone(store, rank, holder=holder)


def mark_gone(store: SignedStore, rank: int, prefix: str | None = None,
              holder: str | None = None) -> None:
    """Tells the survivors of ``rank``'s generation (``prefix``; default: its current one)
    that it will not report, once however many say so (the rank as it leaves, its agent
    when the process is gone), and wakes that generation's blocked ranks
    (:class:`llmtrain.distributed.failure.FailureWatch`). With ``holder`` (an agent's dead
    worker, see :func:`owner`), only if that process holds the rank there: a spare may
    have taken it in a new generation meanwhile, and must not be counted gone."""
    prefix = prefix or where(store, rank)
    if prefix is None:
        return
    if holder is not None and store.genuine(f"{prefix}owner/{rank}") != holder.encode():
        return
    size = store.genuine(f"{prefix}size")
    store.set(f"{prefix}failed", "1")
    if not size:
        return
    if count_in(store, prefix, rank, f"gone-{uuid.uuid4().hex}"):
        tally(store, prefix, int(size))
        store.add(f"{prefix}gone", 1)
    elif holder is not None:  # it reported, then its process died
        died_after_report(store, prefix, rank)


def decider_key(term: int) -> str:
    """Who decides a generation's plan: the first reporter (term 0), or the survivor that
    took over from a decider that died (term 1, 2...)."""
    return f"decider/{term}"


def decision_key(term: int) -> str:
    """Where term ``term``'s decider publishes the plan (or the cold verdict), or where
    :func:`died_after_report` says that decider died (:data:`ORPHANED`)."""
    return f"decision/{term}"


ORPHANED = "orphaned:"


def died_after_report(store: SignedStore, prefix: str, rank: int) -> None:
    """``rank`` reported, then its process died (its supervisor saw it): it is recorded,
    for a decider to count it lost; and were it deciding, the survivors waiting for its
    decision, which will never come, are told at once to choose another decider."""
    store.append(f"{prefix}died", str(rank))
    term = 0
    while (decider := store.genuine(f"{prefix}{decider_key(term)}")) is not None:
        if decider.decode() == str(rank):  # already decided: this claim changes nothing
            store.claim(f"{prefix}{decision_key(term)}", f"{ORPHANED}{rank}")
            return
        term += 1


def died_reporters(store: SignedStore, prefix: str) -> set[int]:
    """The ranks that reported and then died (:func:`died_after_report`)."""
    key = f"{prefix}died"
    return {int(r) for r in store.records(key)} if store.check([key]) else set()


def count_in(store: SignedStore, prefix: str, rank: int, token: str) -> bool:
    """Whether ``rank`` is counted in its generation by this call: by whichever comes
    first, its report or a mark that it is gone (False: the other came first)."""
    if store.claim(f"{prefix}seen/{rank}", token).decode() != token:
        return False
    if store.claim(f"{prefix}stirred/{rank}", "in").decode() != "in":
        store.add(f"{prefix}coming", -1)  # it said it was coming: it has come
    return True


def stir(store: SignedStore, prefix: str, rank: int) -> None:
    """``rank`` lives and will report (its failure watch woke while the rank computes,
    far from its next collective); nothing once it is counted in. Two store requests."""
    token = f"coming-{uuid.uuid4().hex}"  # this call's: a second one counts nothing
    if store.claim(f"{prefix}stirred/{rank}", token).decode() == token:
        store.add(f"{prefix}coming", 1)


def coming(store: SignedStore, prefix: str) -> int:
    """How many ranks said they are coming and are not counted in yet (0 or less: none;
    a rank counted in between its two requests in :func:`stir` makes it -1 briefly)."""
    return store.add(f"{prefix}coming", 0)


def tally(store: SignedStore, prefix: str, world_size: int) -> None:
    """Counts one more rank in (after its report is stored); whoever completes the tally
    sets ``all_in``, which the decider waits for in the store: nobody polls."""
    if store.add(f"{prefix}accounted", 1) == world_size:
        store.set(f"{prefix}all_in", "1")
