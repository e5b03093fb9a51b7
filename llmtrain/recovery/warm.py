"""The warm path's agreement: which ranks are lost, which spare replaces each, and which
snapshot step every rank restores.

Every meeting happens in the rendezvous store outside the workers (``llmtrain rdzv-store``
or an agent's), under ``llmtrain/warm/<rdzv id>``: spares register there at the job level,
and each torchrun round has its own namespace, in which each generation of the group (0 at
start, +1 per warm recovery) has its own keys and its own process-group prefix.

When a rank sees a collective fail, it reports what it can restore from (its own snapshot
steps, its ward's replica steps), then leaves the broken group at once, so that a rank
blocked on it fails and reports too. Each report costs a rank O(1) store requests whatever
the world size: a tally (``seen/<rank>``, whichever comes first of its report and a mark
that it is gone, from the rank as it leaves or its agent when it died), and one line
appended to the generation's report log. The first reporter decides: it waits in the store
(no polling) until the tally is complete, at most ``warm.settle_s``; reads the log in one
request; and stores the plan, under one key every survivor waits for. The ranks that
neither reported nor are gone are lost. The decider claims a warm spare for each lost
rank. A decider whose process dies before its decision is seen dying (its agent, the
presence listener): the survivors waiting for the plan are told at once, and the first of
them to claim the next term decides in its place. The first report also sets the
generation's ``failed`` key, which wakes each rank's
:class:`llmtrain.distributed.failure.FailureWatch`: it says the rank is coming (a rank
that computes meets the failure only at its next collective, and the decider waits for
it), and on NCCL it aborts the rank's communicators, so ranks blocked behind healthy peers
report before the plan closes. The plan is refused, and every
survivor takes the cold path (exit RETRYABLE, torchrun restarts the job from the durable
checkpoint), when a lost rank's buddy is lost too, or when no step is held by every
survivor and by every lost rank's buddy. When no spare is waiting, the plan is a shrink
(``warm.shrink``): the nodes that lost ranks leave the job, and the survivors go on at the
smaller world size, renumbered in order, their state resharded from the snapshots and
replicas they hold (:mod:`llmtrain.recovery.reshard`). A shrink drops whole nodes only,
stays within the launcher's ``--nnodes`` minimum and needs a config that trains at the
smaller size; otherwise the job goes cold. A rank whose own step failed
(:func:`llmtrain.distributed.failure.broke_a_collective` says no) does not report: it is
marked gone and replaced, never a healthy peer that was waiting for it.
``benchmarks/agreement.py`` measures the agreement at 256-16K simulated ranks.

The spares wait in the job's pool (:mod:`llmtrain.recovery.pool`); the ranks are counted
in by the roll call (:mod:`llmtrain.recovery.roll_call`).

Why not torchft or nvidia-resiliency-ext's in-process restart: torchft drops a failed
replica group and trains on with fewer (so not bitwise equal to a fault-free run, and a
plain FSDP job has no replica to drop) behind a per-step quorum with its own lighthouse
server; nvidia-resiliency-ext's in-process wrapper aborts CUDA/NCCL groups only and
re-runs the training function, which still rebuilds state from storage.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch.distributed as dist

from llmtrain.config import WarmConfig
from llmtrain.distributed.process_group import node_name, rendezvous_store
from llmtrain.distributed.signed_store import SignedStore, signed
from llmtrain.recovery import pool
from llmtrain.recovery.roll_call import (ORPHANED, coming, count_in, decider_key,
                                         decision_key, died_reporters, mark_gone, owner,
                                         stir, tally)
from llmtrain.recovery.sockets import cut

__all__ = ["ColdPath", "Plan", "WarmPath", "buddy_of", "ward_of", "outside_store",
           "job_namespace"]

log = logging.getLogger(__name__)
# how often a rank waiting for its generation to form looks for a member known dead
LOOK_S = 0.5


class ColdPath(RuntimeError):
    """The warm path cannot recover this failure; the message says why."""


@dataclass
class Plan:
    """What the survivors agreed on for generation ``gen``."""
    gen: int
    step: int                      # the snapshot step every rank restores
    world_size: int
    local_world_size: int
    round_id: str
    lost: list[int]
    sources: dict[str, int]        # lost rank -> the buddy that sends its replica
    spares: dict[str, int] = field(default_factory=dict)  # lost rank -> spare number
    # "spare": spares take the lost ranks' places; "shrink": no spare waited, and the
    # survivors go on without the lost nodes at ``world_size`` ranks
    kind: str = "spare"  # or "grow": spares join the running job, which grows by a node
    kept: list[int] = field(default_factory=list)  # old ranks in new rank order (-1: a spare)
    providers: dict[str, int] = field(default_factory=dict)  # old rank -> new rank holding it
    old_mesh: list[int] = field(default_factory=list)  # shrink: (dp_replicate, dp_shard)
    mesh: list[int] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)  # shrink: the survivors' times
    # shrink: live ranks that leave with their lost node-mates (a node's ranks go whole:
    # a tensor-parallel group is never split), where a whole replica stays without them
    dropped: list[int] = field(default_factory=list)

    @classmethod
    def from_assignment(cls, assignment: dict) -> "Plan":
        """The plan in a spare's assignment (which also names the spare's rank)."""
        return cls(**{k: v for k, v in assignment.items() if k != "rank"})

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        return cls(**json.loads(text))


def buddy_of(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank holding ``rank``'s replica: the same local rank on the next node."""
    if world_size <= local_world_size:
        return None
    return (rank + local_world_size) % world_size


def ward_of(rank: int, world_size: int, local_world_size: int) -> int | None:
    if world_size <= local_world_size:
        return None
    return (rank - local_world_size) % world_size


def outside_store(timeout: timedelta, client: dist.Store | None = None) -> SignedStore | None:
    """The job's warm-path namespace in the rendezvous store, or None without one
    (``llmtrain launch`` passes ``LLMTRAIN_RDZV_ENDPOINT`` and ``LLMTRAIN_RDZV_ID``);
    through ``client`` (a connection to that store a thread already has), else a new
    connection. It connects again after the store restarted."""
    store = client if client is not None else rendezvous_store(timeout)
    if store is None:
        return None
    return job_namespace(store, os.environ.get("LLMTRAIN_RDZV_ID", "job"),
                         reconnect=lambda: rendezvous_store(timeout))


def job_namespace(store: dist.Store, rdzv_id: str, env: Mapping[str, str] = os.environ,
                  reconnect: Callable[[], dist.Store] | None = None) -> SignedStore:
    """The job's keys in the rendezvous store, their values signed with the job's secret
    (``env``'s, :mod:`llmtrain.distributed.signed_store`); ``reconnect``: a new client
    of that store, for after it restarted."""
    name = f"llmtrain/warm/{rdzv_id}"
    return signed(dist.PrefixStore(name, store), name, env,
                  reconnect and (lambda: dist.PrefixStore(name, reconnect())))


class WarmPath:
    """One rank's side of the agreement; ``gen`` moves on with each warm recovery."""

    def __init__(self, cfg: WarmConfig, store: SignedStore, round_id: str, rank: int,
                 world_size: int, local_world_size: int, gen: int = 0,
                 shapes: Callable[[int], tuple[int, int] | str] | None = None):
        """``shapes``: the mesh the job trains at with a given number of ranks, or why it
        cannot (None: no shrink, a lost rank without a spare goes cold)."""
        self.cfg, self.store, self.round_id, self.shapes = cfg, store, round_id, shapes
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        self.enter(gen)

    def enter(self, gen: int) -> None:
        """This rank is in generation ``gen`` now; its agent learns where to say it died."""
        self.gen = gen
        self.store.set(self._key("size"), str(self.world_size))
        self.store.set(self._key(f"owner/{self.rank}"), owner())
        self.store.set(f"where/{self.rank}", self._key(""))
        self.store.set(f"rank_of/{owner()}", str(self.rank))

    def hosts(self, ranks: list[int], gen: int) -> dict[int, str]:
        """The node each of ``ranks`` ran on in generation ``gen`` (the holder each set
        as it entered it); a rank whose key is gone is left out."""
        found = {}
        for r in ranks:
            holder = self.store.genuine(self._key(f"owner/{r}", gen))
            if holder is not None:
                found[r] = holder.decode().rpartition(":")[0]
        return found

    def cut_from_peers(self) -> int:
        """Shuts this rank's ends of its connections to the other ranks (their published
        ends, :func:`llmtrain.recovery.eviction.publish_endpoints`), as it leaves a broken
        generation on gloo: a live peer blocked in a collective with it fails at once and
        reports, rather than when this process drops its groups (after the plan, too late
        to count as a survivor).
        gloo in torch 2.13 has no abort that closes a group's connections. Two store
        requests a rank: on gloo only, where worlds are small."""
        peers = set()
        for r in range(self.world_size):
            key = f"endpoints/{r}"
            if r != self.rank:
                peers |= set(json.loads(self.store.genuine(key) or "[]"))
        return cut(peers)

    def failed_key(self) -> str:
        """The key set when this generation fails (what a FailureWatch waits for)."""
        return self._key("failed")

    def stirring(self) -> Callable[[SignedStore], None]:
        """What this rank's failure watch says, on its own connection, when this
        generation fails: that the rank lives and will report (:func:`stir`)."""
        prefix, rank = self._key(""), self.rank
        return lambda store: stir(store, prefix, rank)

    def leave(self) -> None:
        """This rank leaves on purpose: its GPU failed, so its node leaves the job. The
        node's waiting spares leave the pool first, so that the survivors (whom the mark
        wakes) claim none of them; then the survivors need not wait ``warm.settle_s`` for
        its report."""
        pool.withdraw_node(self.store, node_name())
        mark_gone(self.store, self.rank)

    @property
    def buddy(self) -> int | None:
        return buddy_of(self.rank, self.world_size, self.local_world_size)

    @property
    def ward(self) -> int | None:
        return ward_of(self.rank, self.world_size, self.local_world_size)

    def _key(self, name: str, gen: int | None = None) -> str:
        return f"{self.round_id}/g{self.gen if gen is None else gen}/{name}"

    def group_store(self) -> dist.Store:
        """Where this generation's process groups meet."""
        return dist.PrefixStore(self._key("pg"), self.store.raw)  # gloo's and NCCL's keys

    def agree(self, holdings: dict, deadline: float,
              leave: Callable[[], None] = lambda: None) -> Plan:
        """Reports ``holdings``, leaves the broken group (``leave``: a rank blocked on this
        one then fails too, and reports in time), and returns the plan every survivor
        follows; ColdPath when there is none."""
        # a request made twice to no harm first: after a store restart it connects again,
        # so that the counts below are not the requests that meet the broken connection
        self.store.check([self._key("size")])
        self.store.add("agreeing", 1)  # agents of dead workers: someone is left to agree
        try:
            decides = self.report(holdings)
            leave()
            if decides:
                self.decide()
            return self._plan(deadline)
        finally:  # decided: replaced/<its holder> or cold is set (or this rank gave up)
            self.store.add("agreed", 1)

    def report(self, holdings: dict) -> bool:
        """This rank's report, in O(1) store requests whatever the world size; True for
        the first reporter, which decides. Its report also wakes the generation's blocked
        ranks (``failed``)."""
        if not count_in(self.store, self._key(""), self.rank, "report"):
            raise ColdPath(f"rank {self.rank} was counted as lost before it reported")
        self.store.append(self._key("reports"),
                          json.dumps({"rank": self.rank, **holdings}) + "\n")
        tally(self.store, self._key(""), self.world_size)
        me = str(self.rank)
        first = self.store.claim(self._key(decider_key(0)), me).decode() == me
        if first:
            self.store.set(self._key("failed"), "1")
        return first

    def decide(self, term: int = 0) -> None:
        """The decider's part (``term``: 0 for the first reporter, one more for each
        decider that died before its decision): waits until every rank has reported or is
        gone, or the reports have settled; reads all reports in one request; stores the
        plan and claims the spares. The ranks that did not report are lost, and so are
        those that reported and died since."""
        self._settle()
        reports = {}
        for line in self.store.records(self._key("reports")):
            report = json.loads(line)
            reports.setdefault(report.pop("rank"), report)
        for rank in died_reporters(self.store, self._key("")):
            reports.pop(rank, None)
        proposal = self._propose(reports)
        if self.store.claim(self._key(f"plan/{term}"), proposal).decode() == proposal:
            self._claim_spares(proposal, term)

    def _settle(self) -> None:
        """Waits in the store for ``all_in``, half of ``warm.settle_s`` at a time: done
        when it is set, or once ``settle_s`` has passed, the last half brought no report,
        and no rank that said it is coming is still awaited. Reports that still come in
        (thousands of ranks failing over a second) keep it open, and so does a rank whose
        failure watch said it lives while its step computes (on gloo it meets the failure
        only at its next collective): a healthy rank that reports late is not counted
        lost. One said coming that has not reported within half of ``warm.budget_s``
        (stuck, its watch alive) is."""
        began, half = time.monotonic(), self.cfg.settle_s / 2
        tally = self.store.add(self._key("accounted"), 0)
        while True:
            if self.store.wait_genuine(self._key("all_in"), timedelta(seconds=half)):
                return
            before, tally = tally, self.store.add(self._key("accounted"), 0)  # half passed
            waited = time.monotonic() - began
            if tally == before and waited >= self.cfg.settle_s:
                awaited = coming(self.store, self._key(""))
                if awaited <= 0:
                    return
                if waited >= self.cfg.budget_s / 2:
                    log.warning("%d rank(s) of generation %d said they were coming and did "
                                "not report within half of warm.budget_s=%g: they count as "
                                "lost", awaited, self.gen, self.cfg.budget_s)
                    return

    def _plan(self, deadline: float) -> Plan:
        """The generation's decision; where its decider died before making it, the first
        survivor to claim the next term decides in its place (a process killed between its
        report and its decision: a node's processes killed one by one, the OOM killer)."""
        term, me = 0, str(self.rank)
        while (plan_text := self._wait(self._key(decision_key(term)), deadline)
               ).startswith(ORPHANED):
            term += 1
            if self.store.claim(self._key(decider_key(term)), me).decode() == me:
                log.warning("rank %s died deciding generation %d's plan: rank %d decides "
                            "instead", plan_text.removeprefix(ORPHANED), self.gen, self.rank)
                self.decide(term)
        if plan_text.startswith("cold:"):
            raise ColdPath(plan_text[5:])
        plan = Plan.from_json(plan_text)
        if self.rank in plan.lost:
            raise ColdPath(f"rank {self.rank} reported too late and was counted as lost")
        return plan

    def assemble(self, deadline: float, plan: Plan) -> None:
        """Waits until every member of this generation (survivors and spares of ``plan``)
        has come to form its group. ColdPath as soon as one is known dead
        (:meth:`_lost_before_forming`), or when one has not come by ``deadline`` (a claimed
        spare too slow), so that no rank waits in the group's creation for its much longer
        timeout (``reliability.init_timeout_s``). (A spare claimed by a survivor that was
        killed next, as a node's ranks are killed one by one, waited out warm.budget_s;
        its launcher then joined the job, which had restarted cold without it meanwhile,
        as a node, and the healthy job restarted once more.)"""
        if self.store.add(self._key("arrived"), 1) == self.world_size:
            self.store.set(self._key("assembled"), "1")
        while True:
            try:
                self._wait(self._key("assembled"), min(deadline, time.monotonic() + LOOK_S))
                return
            except ColdPath:
                if time.monotonic() >= deadline:
                    missing = self.world_size - self.store.add(self._key("arrived"), 0)
                    raise ColdPath(f"{missing} member(s) of generation {self.gen} did not "
                                   f"come within warm.budget_s={self.cfg.budget_s}") from None
            lost = self._lost_before_forming(plan)
            if lost:
                raise ColdPath(lost)

    def _lost_before_forming(self, plan: Plan) -> str | None:
        """Why this generation cannot form, where a member is known dead already: one that
        entered it and died or left (its supervisor, or the presence listener, marked it
        gone here), or a survivor of ``plan`` that reported in the failed generation and
        died after (:func:`died_after_report`). None while none is known; a store that does
        not answer tells nothing (the budget still bounds the wait)."""
        survivors = ({r for r in plan.kept if r >= 0} if plan.kept
                     else set(range(plan.world_size)) - set(plan.lost))
        try:
            if self.store.check([self.failed_key()]):
                return (f"a member of generation {self.gen} was lost before it formed (its "
                        f"process died, or it left)")
            died = died_reporters(self.store, self._key("", plan.gen - 1)) & survivors
        except RuntimeError:  # DistError: the store went away for now
            return None
        if died:
            return (f"rank(s) {sorted(died)} reported the failure of generation "
                    f"{plan.gen - 1}, then died before generation {self.gen} formed")
        return None

    def _propose(self, reports: dict[int, dict]) -> str:
        lost = [r for r in range(self.world_size) if r not in reports]
        if not lost:
            return "cold:every rank is alive: the failure was not a lost rank"
        sources = {}
        for r in lost:
            b = buddy_of(r, self.world_size, self.local_world_size)
            if b is None or b in lost:
                return (f"cold:rank {r} was lost " + ("with its buddy, rank " + str(b) if b
                        is not None else "and the job has one node: no replica exists"))
            sources[str(r)] = b
        held = [set(reports[a]["own"]) for a in reports]
        held += [set(reports[b]["replicas"]) for b in sources.values()]
        common = set.intersection(*held)
        if not common:
            return (f"cold:no snapshot step is held by every survivor and by the buddies "
                    f"of rank(s) {lost}")
        return Plan(gen=self.gen + 1, step=max(common), world_size=self.world_size,
                    local_world_size=self.local_world_size, round_id=self.round_id,
                    lost=lost, sources=sources).to_json()

    def _claim_spares(self, proposal: str, term: int) -> None:
        """The winning proposer's part: a registered spare for each lost rank."""
        if proposal.startswith("cold:"):
            self._go_cold(proposal, term)
            return
        plan = Plan.from_json(proposal)
        # not on the lost ranks' nodes, where another node's spare waits; nor beside
        # their buddies and wards, where another node's spare waits
        avoid = frozenset(self.hosts(plan.lost, self.gen).values())
        apart = frozenset(self.hosts(self._kin(plan.lost), self.gen).values()) - avoid
        taken = pool.claim(self.store, len(plan.lost), avoid, apart)
        if len(taken) < len(plan.lost):
            r = plan.lost[len(taken)]
            self._publish(self._shrink(plan, f"cold:no warm spare waits for rank {r}"), term)
            return
        plan.spares = {str(r): number for r, number in zip(plan.lost, taken)}
        pool.assign(self.store, asdict(plan))
        self._publish(plan.to_json(), term)

    def _kin(self, lost: list[int]) -> list[int]:
        """The surviving buddies and wards of the ``lost`` ranks."""
        kin = {k for r in lost for k in (buddy_of(r, self.world_size, self.local_world_size),
                                         ward_of(r, self.world_size, self.local_world_size))}
        return sorted(kin - {None} - set(lost))

    def _publish(self, plan: str, term: int = 0) -> None:
        """The decision every survivor waits for: a plan, or the cold verdict. Published
        by compare-and-set, so a generation has one decision even with two deciders (a
        store that restarted mid-agreement lost the key that made the first one); the
        later one's is dropped, and says so."""
        if plan.startswith("cold:"):
            self._go_cold(plan, term)
            return
        if not self._decided(plan, term):
            return
        decided = Plan.from_json(plan)
        leaving = decided.lost + decided.dropped
        for r in leaving:  # the agents of the lost (and dropped) ranks must not restart them
            holder = self._key(f"owner/{r}")
            if (process := self.store.genuine(holder)) is not None:
                self.store.add(f"replaced/{process.decode()}", 1)
        self.store.add("replacements", len(leaving))  # no agent waits for them at the end

    def _decided(self, decision: str, term: int) -> bool:
        """Whether ``decision`` is the generation's (no other came first)."""
        if self.store.claim(self._key(decision_key(term)), decision).decode() == decision:
            return True
        log.warning("rank %d's decision for generation %d was not published: another "
                    "decider's came first", self.rank, self.gen)
        return False

    def _staying(self, leaving: list[int], drop: bool = False
                 ) -> tuple[list[int], tuple[int, int], list[int]] | str:
        """The ranks that stay when the nodes of ``leaving`` go, the mesh they train at,
        and the live ranks of those nodes that go with them (``drop``: a failure's shrink
        may drop them where a whole replica stays; a preemption's leavers are whole nodes
        already); or why the job cannot go on without those nodes: a shrink drops whole
        nodes, and stays within ``--nnodes`` and what the config can train at."""
        per_node, world = self.local_world_size, self.world_size
        gone = {r // per_node for r in leaving}
        kept = [r for r in range(world) if r // per_node not in gone]
        stranded = [r for r in range(world) if r // per_node in gone and r not in leaving]
        if stranded and not (drop and self._whole_replica(kept)):
            return (f"rank(s) {stranded} live on a node that loses others, and a shrink "
                    f"drops whole nodes" + (" where a whole replica stays without them"
                                            if drop else ""))
        shape = self.shapes(len(kept)) if kept else "no node stays"
        if isinstance(shape, str):
            return f"no shrink to {len(kept)} ranks: {shape}"
        return kept, shape, stranded

    def _whole_replica(self, kept: list[int]) -> bool:
        """Whether ``kept`` holds every place of a data-parallel replica (every shard of
        every tensor-parallel piece): then what the others held is not needed."""
        old = self.shapes(self.world_size)
        if isinstance(old, str) or not kept:
            return False
        size = self.world_size // old[0]  # a replica's ranks: dp_shard x tp
        return {r % size for r in kept} == set(range(size))

    def _shrink(self, plan: Plan, cold: str) -> str:
        """No spare for every lost rank: the plan in which the survivors go on without the
        nodes that lost them, or ``cold`` with the reason they cannot."""
        if self.shapes is None or not self.cfg.shrink:
            return cold
        staying = self._staying(plan.lost, drop=True)
        if isinstance(staying, str):
            return f"{cold}, and {staying}"
        kept, shape, dropped = staying
        new = {old: n for n, old in enumerate(kept)}
        providers = {str(o): new[o] for o in kept}
        sources = {} if dropped else plan.sources  # a whole replica stays: nothing is sent
        providers |= {r: new[b] for r, b in sources.items()}
        return Plan(gen=plan.gen, step=plan.step, world_size=len(kept),
                    local_world_size=self.local_world_size, round_id=self.round_id,
                    lost=plan.lost, sources=sources, kind="shrink", kept=kept,
                    providers=providers, old_mesh=list(self.shapes(self.world_size)),
                    mesh=list(shape), dropped=dropped).to_json()

    def without(self, leaving: list[int], step: int) -> Plan | str:
        """The plan in which the other ranks go on at ``step`` without ``leaving`` (a
        preemption's nodes, alive, the step saved), or why they cannot. Every rank computes
        it alike from the same inputs, so nobody waits for a decider; the state comes from
        the ranks that stay, which must hold every shard (whole HSDP replicas): the
        leavers send nothing."""
        if self.shapes is None or not self.cfg.shrink:
            return "no shrink (warm.shrink off, or no launcher said --nnodes)"
        staying = self._staying(leaving)
        if isinstance(staying, str):
            return staying
        kept, shape, _ = staying
        old = self.shapes(self.world_size)
        if isinstance(old, str) or {o % old[1] for o in kept} != set(range(old[1])):
            return "the nodes that stay do not hold every shard (no whole replica stays)"
        return Plan(gen=self.gen + 1, step=step, world_size=len(kept),
                    local_world_size=self.local_world_size, round_id=self.round_id,
                    lost=sorted(leaving), sources={}, kind="shrink", kept=kept,
                    providers={str(o): n for n, o in enumerate(kept)},
                    old_mesh=list(old), mesh=list(shape))

    def grow(self, step: int, deadline: float) -> Plan | None:
        """The plan to take in waiting spares at ``step`` (every rank voted for it): rank 0
        claims a node's worth of them and stores it, the others wait for it. None when
        too few spares are left by then, or the config cannot train at the larger size.
        Each grow has a key of its own (the step it was voted at): a generation may try
        more than once, and an earlier try's answer must not answer a later one."""
        key = self._key(f"grow/{step}")
        if self.rank == 0:
            self.store.set(key, self._claim_growth(step))
        text = self._wait(key, deadline)
        return None if text.startswith("none:") else Plan.from_json(text)

    def _claim_growth(self, step: int) -> str:
        world, per_node = self.world_size, self.local_world_size
        shape = self.shapes(world + per_node)
        if isinstance(shape, str):
            return f"none:{shape}"
        taken = pool.claim(self.store, per_node)
        if len(taken) < per_node:
            return "none:too few spares wait"
        plan = Plan(gen=self.gen + 1, step=step, world_size=world + per_node,
                    local_world_size=per_node, round_id=self.round_id, lost=[], sources={},
                    spares={str(world + i): n for i, n in enumerate(taken)}, kind="grow",
                    kept=[*range(world), *[-1] * per_node],
                    providers={str(o): o for o in range(world)},
                    old_mesh=list(self.shapes(world)), mesh=list(shape))
        pool.assign(self.store, asdict(plan))
        return plan.to_json()

    def give_up(self) -> None:
        """The plan failed after it was made (a replica failed its check, the budget ran
        out): the agents of the survivors' workers must restart them, not wait."""
        self.store.add("cold", 1)

    def _go_cold(self, verdict: str, term: int) -> None:
        if self._decided(verdict, term):
            self.store.add("cold", 1)  # agents waiting on a dead worker restart it

    def _wait(self, key: str, deadline: float) -> str:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ColdPath("the warm path ran out of its time budget (warm.budget_s)")
        try:
            value = self.store.wait_genuine(key, timedelta(seconds=left))
        except RuntimeError:  # DistError: the store went away
            value = None
        if value is None:
            raise ColdPath(f"no plan within warm.budget_s={self.cfg.budget_s}")
        return value.decode()
