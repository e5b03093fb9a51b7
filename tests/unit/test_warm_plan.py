"""The warm path's agreement in a real store: who is lost, which spare takes each lost rank,
which snapshot step all restore, and every case that must go cold instead."""

import json
import threading
import time
from datetime import timedelta

import pytest

from llmtrain.config import WarmConfig
from llmtrain.distributed.process_group import node_name
from llmtrain.recovery.pool import (PoolPlace, assignment, claim, join_pool, leave_pool,
                                    spares_ready, spares_waiting)
from llmtrain.recovery.roll_call import coming, died_after_report, mark_gone, owner
from llmtrain.recovery.verdicts import Verdicts, agreements
from llmtrain.recovery.warm import ColdPath, Plan, WarmPath, buddy_of
from conftest import signed_store


def agree_all(store, holdings: dict[int, dict], world: int, local_world: int = 1,
              settle_s: float = 0.3, round_id: str = "round",
              shapes=None) -> dict[int, object]:
    """Runs ``agree`` for every reporting rank at once; rank -> Plan or ColdPath."""
    cfg = WarmConfig(enable=True, settle_s=settle_s, budget_s=5)
    out = {}

    def one(rank):
        path = WarmPath(cfg, store, round_id, rank, world, local_world, shapes=shapes)
        try:
            out[rank] = path.agree(holdings[rank], time.monotonic() + 5)
        except ColdPath as e:
            out[rank] = e
    threads = [threading.Thread(target=one, args=(r,)) for r in holdings]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def held(own, replicas, ward):
    return {"own": own, "replicas": replicas, "ward": ward}


def test_buddies_are_on_the_next_node():
    assert [buddy_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert buddy_of(0, 4, 4) is None  # one node: a replica would die with it


def test_a_lost_rank_gets_a_spare_and_the_newest_common_step():
    store = signed_store()
    assert store.add("spares/registered", 1) == 1
    # 3 nodes of one rank; rank 1 lost; its buddy is rank 2
    store.set("round/g0/owner/1", "node2:4242")  # the process that held it
    out = agree_all(store, {0: held([9, 10], [9, 10], 2), 2: held([10, 11], [9, 10], 1)}, 3)
    assert out[0] == out[2]
    plan = out[0]
    assert (plan.gen, plan.lost, plan.step, plan.sources, plan.spares) == (
        1, [1], 10, {"1": 2}, {"1": 1})
    told = json.loads(store.get("spares/1/plan"))
    assert told["rank"] == 1 and told["step"] == 10
    assert store.add("replaced/node2:4242", 0) == 1  # what rank 1's agent waits for


def test_an_agreement_is_open_from_its_start_until_it_is_decided():
    """An agent whose workers all died waits for a warm verdict only while a survivor is
    agreeing. An agreement that ended before must not count: it did, and a cold restart
    after any earlier warm recovery waited out the agent's whole budget (35 s, not 10)."""
    store = signed_store()
    store.add("spares/registered", 1)
    start = agreements(store)
    decided = agree_all(store, {0: held([10], [10], 2), 2: held([10], [10], 1)}, 3)
    assert decided[0].lost == [1]
    entered, left = agreements(store)
    assert entered - start[0] == left - start[1] == 2
    # rank 0 alone of 3 reports, and waits out the settle time before deciding
    lone = threading.Thread(target=agree_all, args=(store, {0: held([10], [10], 2)}, 3),
                            kwargs={"settle_s": 1.0, "round_id": "round2"})
    lone.start()
    time.sleep(0.3)
    entered, left = agreements(store)
    assert entered - left == 1
    lone.join()
    entered, left = agreements(store)
    assert entered == left


def test_a_rank_said_gone_is_not_waited_for_and_saying_it_twice_counts_once():
    """Rank 1 leaves (its GPU failed) and its agent says so too. Ranks 0 and 2 report at
    once, rank 3 a second later: the survivors wait for rank 3 (one "gone" counted twice
    would make them stop before it and count it lost), then agree without waiting out
    the rest of warm.settle_s."""
    store = signed_store()
    store.add("spares/registered", 1)
    cfg = WarmConfig(enable=True, settle_s=10.0, budget_s=20)
    paths = {r: WarmPath(cfg, store, "round", r, 4, 1) for r in range(4)}
    paths[1].leave()  # as it leaves
    mark_gone(store, 1)  # its agent, when the process is gone
    out = {}

    def one(rank, delay):
        time.sleep(delay)
        out[rank] = paths[rank].agree(held([4], [4], (rank - 1) % 4), time.monotonic() + 20)
    threads = [threading.Thread(target=one, args=(r, 1.0 if r == 3 else 0)) for r in (0, 2, 3)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start < 5  # not the 10 s settle
    assert [out[r].lost for r in (0, 2, 3)] == [[1], [1], [1]], out


@pytest.mark.parametrize("holdings, world, why", [
    ({0: held([5], [5], 1), 1: held([5], [5], 0)}, 2, "every rank is alive"),
    ({0: held([5], [5], 1)}, 3, "with its buddy"),                      # 1 and 2 lost
    ({0: held([4], [4], 2), 2: held([5], [5], 1)}, 3, "no snapshot step"),
])
def test_what_cannot_go_warm_goes_cold_for_every_survivor(holdings, world, why):
    store = signed_store()
    store.add("spares/registered", 2)
    out = agree_all(store, holdings, world)
    assert all(isinstance(v, ColdPath) and why in str(v) for v in out.values()), out
    assert store.add("cold", 0) == 1  # agents of dead workers restart them


def test_without_a_spare_it_goes_cold_and_the_next_spare_is_used():
    store = signed_store()
    out = agree_all(store, {0: held([3], [3], 1)}, 2)
    assert "no warm spare" in str(out[0])
    assert spares_waiting(store) == 0  # the failed claim took nothing
    assert store.add("spares/registered", 1) == 1  # a spare arrives, for the next round
    plan = agree_all(store, {0: held([7], [7], 1)}, 2, round_id="after the cold restart")[0]
    assert plan.spares == {"1": 1} and json.loads(store.get("spares/1/plan"))["rank"] == 1
    assert spares_waiting(store) == 0


def test_a_spare_is_claimed_or_withdrawn_never_both():
    """A spare leaves the pool to join a cold restart (or at the job's end) by the same
    compare-and-set that claims it: the claim skips a withdrawn spare, a claimed spare
    cannot withdraw, and a claim that finds too few spares leaves the pool as it was."""
    store = signed_store()
    first = join_pool(store)
    assert leave_pool(store, first) and spares_waiting(store) == 0
    out = agree_all(store, {0: held([3], [3], 1)}, 2)
    assert "no warm spare" in str(out[0]) and spares_waiting(store) == 0
    second = join_pool(store)
    assert spares_waiting(store) == 1
    plan = agree_all(store, {0: held([7], [7], 1)}, 2, round_id="after the cold restart")[0]
    assert plan.spares == {"1": second} and assignment(store, second)["rank"] == 1
    assert assignment(store, first) is None
    assert not leave_pool(store, second)  # claimed: its plan is what it gets
    assert spares_waiting(store) == 0


def test_a_lost_nodes_ranks_go_to_one_standby_nodes_spares():
    """Each standby launcher registers its spares (one per local rank) as one block of
    pool numbers, and a claim takes the pool in order: the 2 ranks of a lost node go to
    the 2 spares of the standby node that registered first, not one from each."""
    store = signed_store()
    first, second = join_pool(store, 2), join_pool(store, 2)
    assert (first, second) == (1, 3)
    assert claim(store, 2) == [1, 2] and spares_waiting(store) == 2


def test_a_dead_workers_late_gone_mark_does_not_count_the_spare_that_took_its_rank():
    """An agent sees its worker (rank 1) dead only after a spare took rank 1 in the next
    generation: its mark names the dead process, so the spare is not counted gone there
    (it was, and the spare could not report in the next recovery: that went cold)."""
    store = signed_store()
    cfg = WarmConfig(enable=True)
    WarmPath(cfg, store, "round", 1, 2, 1)  # the worker, in generation 0
    dead = owner()  # (this process stands for it)
    WarmPath(cfg, store, "round", 1, 2, 1, gen=1)  # the spare holds rank 1 now
    store.set("round/g1/owner/1", "spare-host:4242")
    mark_gone(store, 1, holder=dead)  # the agent's late mark
    assert store.add("round/g1/gone", 0) == 0 and not store.check(["round/g1/seen/1"])
    mark_gone(store, 1, holder="spare-host:4242")  # the spare's own agent, when it dies
    assert store.add("round/g1/gone", 0) == 1


def test_reports_still_coming_in_keep_the_agreement_open_past_the_settle_time():
    """Five survivors report 0.2 s apart (at scale, thousands fail over a second), one
    rank is lost. With warm.settle_s = 0.5 the last reports come after it: the agreement
    stays open while they come, counts none of them lost, then closes about half a settle
    time after the last one."""
    store = signed_store()
    store.add("spares/registered", 1)
    cfg = WarmConfig(enable=True, settle_s=0.5, budget_s=10)
    paths = {r: WarmPath(cfg, store, "round", r, 6, 1) for r in range(5)}
    out = {}

    def one(rank):
        time.sleep(0.2 * rank)
        out[rank] = paths[rank].agree(held([4], [4], (rank - 1) % 6), time.monotonic() + 10)
    threads = [threading.Thread(target=one, args=(r,)) for r in paths]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[r].lost for r in paths] == [[5]] * 5, out
    assert time.monotonic() - start < 0.8 + 0.5 + 1.0


def test_a_rank_that_said_it_is_coming_is_waited_for_past_the_settle_time():
    """Rank 1 died with its node's kernel (nobody says it is gone). Ranks 2 and 3 were in
    the middle of a step's computation when rank 0 reported: their failure watches said at
    once that they are coming. Rank 2 reports 1 s later, far past warm.settle_s = 0.3 (on
    gloo a computing rank meets the failure only at its next collective): the decider
    waits for it and does not count it lost (the whole plan went cold then: "lost with its
    buddy"). Rank 3 never reports (stuck, its watch alive): it is lost once half of
    warm.budget_s has passed."""
    store = signed_store()
    store.add("spares/registered", 2)
    cfg = WarmConfig(enable=True, settle_s=0.3, budget_s=3.0)
    paths = {r: WarmPath(cfg, store, "round", r, 4, 1) for r in range(4)}
    out = {}

    def one(rank, delay):
        time.sleep(delay)
        try:
            out[rank] = paths[rank].agree(held([4], [4], (rank - 1) % 4),
                                          time.monotonic() + 5).lost
        except ColdPath as e:
            out[rank] = str(e)
    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(0, 0.0))]
    threads[0].start()
    store.wait(["round/g0/failed"], timedelta(seconds=5))  # what wakes the watches
    for r in (2, 3):
        paths[r].stirring()(store)
    paths[2].stirring()(store)  # said twice, counted once
    threads.append(threading.Thread(target=one, args=(2, 1.0)))
    threads[1].start()
    for t in threads:
        t.join()
    assert out == {0: [1, 3], 2: [1, 3]}, out
    assert 1.5 <= time.monotonic() - start < 3.0  # rank 3 waited for, up to budget_s / 2
    assert coming(store, "round/g0/") == 1  # rank 3's, never counted in
    paths[3].stirring()(store)  # a watch that wakes after its rank was counted: nothing
    assert coming(store, "round/g0/") == 1


def test_a_grow_waits_until_the_spares_it_would_take_say_they_are_ready():
    """A lost rank takes any spare (waiting for its imports beats going cold); a grow, which
    nothing forces, only spares that are ready: one anywhere in the pool (a claim of one
    takes it), or a node's block next in order."""
    store = signed_store()
    first, second = join_pool(store, 2), join_pool(store, 2)
    assert spares_waiting(store) == 4 and not spares_ready(store, 1)
    store.set(f"spares/{second + 1}/ready", "1")
    assert spares_ready(store, 1)  # a claim of one would take it, out of order
    store.set(f"spares/{second}/ready", "1")
    assert not spares_ready(store, 2)  # the first block would be claimed, and it is not ready
    assert leave_pool(store, first) and leave_pool(store, first + 1)
    assert spares_ready(store, 2) and not spares_ready(store, 3)


def test_a_lost_rank_takes_a_ready_spare_before_one_still_importing():
    """The next spare in the pool still imports (its standby node just came back), a later
    one is ready: one lost rank takes the ready one. The pool's count stays right, the
    spare still importing is next, and a node's worth is still taken in order."""
    store = signed_store()
    importing, ready = join_pool(store), join_pool(store)
    store.set(f"spares/{ready}/ready", "1")
    assert claim(store, 1) == [ready] and spares_waiting(store) == 1
    assert not leave_pool(store, ready)  # claimed: its plan is what it gets
    assert claim(store, 1) == [importing] and spares_waiting(store) == 0
    assert claim(store, 1) == [] and spares_waiting(store) == 0  # passed over, not reused
    block = join_pool(store, 2)
    store.set(f"spares/{block + 1}/ready", "1")
    assert claim(store, 2) == [block, block + 1] and spares_waiting(store) == 0
    none_ready = join_pool(store, 2)
    assert claim(store, 1) == [none_ready]  # none ready: the next, in order


def test_a_lost_ranks_spare_comes_from_another_node_and_a_lost_nodes_from_one():
    """The next spare waits on the node that lost the rank (lost whole, its spare may still
    be listed; excluded, its spare is about to leave): the claim takes another node's. A
    lost node's two ranks go to the two spares of one node, passing over a node with one
    left. With only the lost node's spare left, it is still taken (a killed worker's node
    lives on)."""
    store = signed_store()
    dying = PoolPlace(store, budget_s=5, holder=owner(11, "node4"))
    other = PoolPlace(store, budget_s=5, holder=owner(12, "node3"))
    pair = [PoolPlace(store, budget_s=5, holder=owner(p, "node5")) for p in (13, 14)]
    assert claim(store, 1, frozenset({"node4"})) == [other.number]
    assert claim(store, 2, frozenset({"node1"})) == [p.number for p in pair]
    assert spares_waiting(store) == 1
    assert claim(store, 1, frozenset({"node4"})) == [dying.number]
    assert spares_waiting(store) == 0 and claim(store, 1) == []


def test_a_spare_claimed_ahead_whose_decider_died_leaves_after_the_budget():
    """As below, for a spare claimed out of order: it leaves once the budget has passed,
    and the pool still counts the one before it."""
    store = signed_store()
    importing = PoolPlace(store, budget_s=0.3)
    ahead = PoolPlace(store, budget_s=0.3)
    store.set(f"spares/{ahead.number}/ready", "1")
    assert claim(store, 1) == [ahead.number]  # and no plan is ever written
    assert not ahead.leave()  # a plan may still come
    time.sleep(0.4)
    assert ahead.leave()
    assert spares_waiting(store) == 1 and claim(store, 1) == [importing.number]


def test_a_supervisor_learns_whether_its_dead_workers_rank_was_replaced_or_the_job_went_cold():
    """What an agent, or the standby launcher of a spare that took a rank, waits for when
    its worker dies: replaced (the job goes on without it) or cold (it restarts it, or joins
    the restart as a node: once every rank ran in a spare, a job that went cold waited for
    a restart nobody started). Verdicts given before it started do not count."""
    store = signed_store()
    store.add("replaced/node1:7", 1)
    store.add("cold", 1)
    verdicts = Verdicts(store, ["node1:7", "node2:8"], budget_s=5)
    store.add("agreeing", 1)  # a survivor is agreeing
    store.add("replaced/node1:7", 1)
    assert verdicts.replaced("node1:7")
    store.add("cold", 1)
    start = time.monotonic()
    assert not verdicts.replaced("node2:8")
    assert time.monotonic() - start < 1  # the cold count answers at once
    quiet = Verdicts(store, ["node3:9"], budget_s=30)  # nobody agrees: every rank died
    start = time.monotonic()
    assert not quiet.replaced("node3:9")
    assert 4 < time.monotonic() - start < 10


def test_a_preemption_drops_whole_replicas_and_nothing_else():
    """Every rank computes the same plan without the preempted nodes: with whole HSDP
    replicas (2 shards a node) the other node goes on; a node preempted in part, or a
    plain FSDP job whose leavers hold shards nobody else has, cannot."""
    store = signed_store()
    cfg = WarmConfig(enable=True)

    def path(shard: int) -> WarmPath:
        return WarmPath(cfg, store, "round", 2, 4, 2,
                        shapes=lambda n: (n // shard, shard) if n >= 2 else "too few")
    plan = path(2).without([0, 1], step=40)
    assert (plan.kind, plan.kept, plan.world_size, plan.mesh, plan.old_mesh, plan.step) == (
        "shrink", [2, 3], 2, [1, 2], [2, 2], 40)
    assert "live on a node that loses others" in path(2).without([0], step=40)
    assert "do not hold every shard" in path(4).without([0, 1], step=40)
    assert "no shrink to 0 ranks" in path(2).without([0, 1, 2, 3], step=40)


def test_a_lost_tp_rank_without_a_spare_drops_its_whole_node_and_its_live_peer_leaves():
    """Two nodes of a tp 2 group each (a replica a node): rank 0 is lost and no spare
    waits. The survivors shrink to node2's replica; rank 1, alive on node1, is dropped
    with it (a TP group is never split), and its agent is told it was replaced, not
    failed. Where no whole replica would stay, it goes cold and says why."""
    store = signed_store()
    for r, process in ((0, "node1:10"), (1, "node1:11")):
        store.set(f"round/g0/owner/{r}", process)
    tp2 = lambda n: (n // 2, 1) if n >= 2 else "too few"  # noqa: E731 - (replicas, shard)
    survivors = {1: held([8], [8], 3), 2: held([8], [8], 0), 3: held([8], [8], 1)}
    out = agree_all(store, survivors, 4, local_world=2, shapes=tp2)
    plan = out[1]
    assert all(p == plan for p in out.values()), out
    assert (plan.kind, plan.lost, plan.dropped, plan.kept, plan.world_size, plan.mesh) == (
        "shrink", [0], [1], [2, 3], 2, [1, 1])
    assert plan.sources == {} and plan.providers == {"2": 0, "3": 1}  # nothing is sent
    # neither agent restarts its worker: both ranks were replaced, by the shrink (a
    # survivor names its own process as it reports)
    holders = [store.genuine(f"round/g0/owner/{r}").decode() for r in (0, 1)]
    assert holders[0] == "node1:10"
    assert [store.add(f"replaced/{h}", 0) for h in holders] == [1, 1]
    # plain FSDP over 2 nodes of 2 shards: node2 alone holds half the shards
    store = signed_store()
    fsdp = lambda n: (1, n)  # noqa: E731
    out = agree_all(store, survivors, 4, local_world=2, shapes=fsdp)
    assert all(isinstance(v, ColdPath) and "where a whole replica stays" in str(v)
               for v in out.values()), out


def test_a_rank_whose_gpu_failed_takes_its_nodes_waiting_spare_out_of_the_pool_first():
    """Two replicas of a tp 2 group. Rank 0 runs as the spare of a standby node, whose
    other spare still waits, and its GPU fails: the node is excluded, and its launcher's
    exit takes that spare along. Rank 0 takes it out of the pool as it leaves, before its
    peers learn it is gone, so they shrink to the other replica rather than claim it.
    (Seen in a chaos run: claimed, it never came; the recovery waited warm.budget_s, 30 s,
    for it, then went cold, 66 s in all.)"""
    store = signed_store()
    here = node_name()  # the leaving rank's node, as the spare's launcher names it
    doomed = PoolPlace(store, budget_s=5, holder=owner(11, here))
    cfg = WarmConfig(enable=True, settle_s=0.3, budget_s=5)
    WarmPath(cfg, store, "round", 0, 4, 2).leave()  # its GPU failed
    assert spares_waiting(store) == 0 and doomed.leave()  # out of the pool, as said
    tp2 = lambda n: (n // 2, 1) if n >= 2 else "too few"  # noqa: E731 - (replicas, shard)
    survivors = {1: held([8], [8], 3), 2: held([8], [8], 0), 3: held([8], [8], 1)}
    out = agree_all(store, survivors, 4, local_world=2, shapes=tp2)
    assert {(p.kind, tuple(p.kept), tuple(p.spares.items())) for p in out.values()} == {
        ("shrink", (2, 3), ())}, out


def test_a_second_grow_in_a_generation_is_not_answered_by_the_first_ones_none():
    """The first grow of a generation finds too few spares (one left between the vote and
    the claim): every rank trains on. A node's worth of spares comes, and the next grow's
    followers must follow rank 0's plan, not read the first one's answer (they trained on
    while rank 0 grew alone)."""
    store = signed_store()
    cfg = WarmConfig(enable=True, budget_s=5)
    paths = [WarmPath(cfg, store, "round", r, 2, 1, shapes=lambda n: (1, n)) for r in (0, 1)]

    def grow_all(step: int) -> list:
        out: dict[int, object] = {}
        threads = [threading.Thread(target=lambda p=p: out.__setitem__(
            p.rank, p.grow(step, time.monotonic() + 5))) for p in reversed(paths)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [out[0], out[1]]
    assert grow_all(10) == [None, None]  # no spare waits
    spare = join_pool(store)
    store.set(f"spares/{spare}/ready", "1")
    plans = grow_all(20)
    assert plans[0] is not None and plans[1] == plans[0]
    assert plans[0].world_size == 3 and plans[0].spares == {"2": spare}


def test_a_spare_claimed_by_a_decider_that_died_before_its_plan_leaves_after_the_budget():
    """The decider claimed the spare and died before writing the plan; the survivors went
    cold. The spare's launcher, asked to join the restart, may not leave while a plan may
    still come, and leaves once the warm budget has passed without one (it waited claimed
    for ever). A spare whose plan came stays."""
    store = signed_store()
    place = PoolPlace(store, budget_s=0.3)
    number = store.add("spares/claimed", 1)  # the decider's claim, and nothing after it
    assert store.claim(f"spares/{number}/state", "claimed") == b"claimed"
    assert not place.leave()  # its plan may be on the way
    time.sleep(0.35)
    assert place.leave()
    assert store.get(f"spares/{number}/state") == b"left" and spares_waiting(store) == 0
    served = PoolPlace(store, budget_s=0.0)  # claimed, and its plan written
    assert store.claim(f"spares/{store.add('spares/claimed', 1)}/state", "claimed")
    store.set(f"spares/{served.number}/plan", json.dumps({"rank": 1}))
    time.sleep(0.05)
    assert not served.leave() and not served.leave()


def test_a_generation_has_one_decision_even_with_two_deciders():
    """A store that restarted mid-agreement lost the counter that made one rank the first
    reporter, and a second rank decides too: the first decision published stands for
    every survivor (each published its own over the other's), and the agents count one
    cold verdict."""
    store = signed_store()
    cfg = WarmConfig(enable=True, budget_s=2)
    first, second = (WarmPath(cfg, store, "round", r, 2, 1) for r in (0, 1))
    first._publish("cold:rank 1 was lost with its buddy")
    second._publish("cold:no warm spare waits for rank 0")
    deadline = time.monotonic() + 2
    for path in (first, second):
        with pytest.raises(ColdPath, match="rank 1 was lost with its buddy"):
            path._plan(deadline)
    assert store.add("cold", 0) == 1


def test_a_lost_ranks_spare_is_not_put_beside_its_buddy_or_ward(monkeypatch, caplog):
    """Three one-rank nodes; rank 1 (node2) is lost. Its buddy and ward, ranks 2 and 0,
    both run on node7 (spares took their places earlier). The pool's next spare waits on
    node7, a later one on node8: rank 1 takes node8's, for on node7 one loss would take
    rank 1 with the rank that holds its replica, and only the cold path recovers that
    (seen in a chaos run). With node7's spare the only one left, it is taken (better than
    going cold now), and said."""
    monkeypatch.setenv("LLMTRAIN_HOST", "node7")  # where the survivors run
    survivors = {0: held([10], [10], 2), 2: held([10], [10], 1)}
    for round_id in ("first", "second"):
        store = signed_store()
        store.set(f"{round_id}/g0/owner/1", "node2:11")
        beside = PoolPlace(store, budget_s=5, holder=owner(13, "node7"))
        if round_id == "first":
            away = PoolPlace(store, budget_s=5, holder=owner(14, "node8"))
        with caplog.at_level("WARNING", logger="llmtrain.recovery.pool"):
            plan = agree_all(store, survivors, 3, round_id=round_id)[0]
        said = [r.getMessage() for r in caplog.records if "beside the buddy" in r.message]
        if round_id == "first":
            assert plan.spares == {"1": away.number} and said == []
        else:
            assert plan.spares == {"1": beside.number} and "node7" in said[0], said


def test_a_decider_that_dies_before_its_plan_is_replaced_by_a_survivor_at_once():
    """A node's processes killed one by one: rank 0 dies without a word, rank 1 reports
    first (so it decides) and dies before it has decided. Its supervisor sees it die,
    which tells the survivors waiting for its plan at once, and one of them decides in
    its place, counting rank 1 among the lost: the job shrinks to node2's replica, well
    within the budget (before, they waited out warm.budget_s for a plan, then went cold)."""
    store = signed_store()
    tp2 = lambda n: (n // 2, 1) if n >= 2 else "too few"  # noqa: E731 - (replicas, shard)
    cfg = WarmConfig(enable=True, settle_s=0.3, budget_s=5)
    decider = WarmPath(cfg, store, "round", 1, 4, 2, shapes=tp2)
    WarmPath(cfg, store, "round", 0, 4, 2, shapes=tp2)
    for r, process in ((0, "node1:10"), (1, "node1:11")):
        store.set(f"round/g0/owner/{r}", process)
    assert decider.report(held([8], [8], 3))  # the first report: rank 1 decides
    survivors = threading.Thread(target=lambda: out.update(agree_all(
        store, {2: held([8], [8], 0), 3: held([8], [8], 1)}, 4, local_world=2, shapes=tp2)))
    out, start = {}, time.monotonic()
    survivors.start()
    time.sleep(0.2)  # the survivors wait for rank 1's plan
    mark_gone(store, 0, holder="node1:10")
    mark_gone(store, 1, holder="node1:11")  # its supervisor saw it die
    survivors.join()
    plan = out[2]
    assert out[3] == plan, out
    assert (plan.kind, plan.lost, plan.kept, plan.world_size) == ("shrink", [0, 1], [2, 3], 2)
    assert time.monotonic() - start < 4  # not the budget's 5 s
    assert store.add("cold", 0) == 0


def test_a_generation_whose_member_is_known_dead_is_given_up_at_once_not_after_the_budget():
    """Generation 1 of 2 ranks: rank 0 was lost and a spare takes its place; rank 1, the
    survivor, reported the failure of generation 0. The spare waits for the generation to
    form: when rank 1 dies now (its supervisor records it), or when a member that entered
    generation 1 dies there, the spare goes cold within a look or two, not after its 30 s
    budget (a spare waited out its budget, then its launcher joined the job that had
    restarted without it, as a node, and the job restarted once more). A lost rank that
    reported and died before the plan is the spare's own place: no reason to give up."""
    cfg = WarmConfig(enable=True, budget_s=30)
    plan = Plan(gen=1, step=10, world_size=2, local_world_size=1, round_id="round",
                lost=[0], sources={"0": 1})

    def waits(store) -> tuple[float, str]:
        spare = WarmPath(cfg, store, "round", 0, 2, 1, gen=1)
        began = time.monotonic()
        with pytest.raises(ColdPath) as e:
            spare.assemble(time.monotonic() + cfg.budget_s, plan)
        return time.monotonic() - began, str(e.value)

    store = signed_store()
    died_after_report(store, "round/g0/", 0)  # the lost rank: the spare takes its place
    threading.Timer(0.3, died_after_report, args=(store, "round/g0/", 1)).start()
    took, why = waits(store)
    assert took < 2.0 and why == ("rank(s) [1] reported the failure of generation 0, then "
                                  "died before generation 1 formed"), (took, why)

    store = signed_store()
    WarmPath(cfg, store, "round", 1, 2, 1, gen=1)  # rank 1 enters generation 1...
    threading.Timer(0.3, mark_gone, args=(store, 1)).start()  # ...and dies there
    took, why = waits(store)
    assert took < 2.0 and "was lost before it formed" in why, (took, why)

    short = WarmConfig(enable=True, budget_s=1)  # nobody known dead: the budget still ends it
    with pytest.raises(ColdPath, match="did not come within warm.budget_s=1"):
        WarmPath(short, signed_store(), "round", 0, 2, 1, gen=1).assemble(
            time.monotonic() + 1, plan)
