"""The watchdog's control plane: heartbeats reduced per node then across nodes give rank 0
the same diagnoses as reading every rank, in a bounded size."""

import json
import time


from llmtrain.reliability.heartbeats import (LISTED, ControlPlane, awaited, desync_in,
                                             not_arrived, positions, verdict)
from conftest import signed_store

ALL_REDUCE, ALL_GATHER = "gloo:all_reduce sizes=[[16]]", "gloo:all_gather sizes=[[16]]"


def planes(world: int, block: int, interval: float = 1.0) -> list[ControlPlane]:
    store = signed_store()
    return [ControlPlane(store, r, world, block, interval) for r in range(world)]


def beat(at: dict | None, wall: float | None = None) -> dict:
    return {"step": 3, "phase": "backward", "wall": wall or time.time(), "host": "h",
            "progress_age": 2.0, "long": False, "at": at}


def world_of(ps: list[ControlPlane], beats: dict[int, dict]):
    for r, b in beats.items():
        ps[r].publish(b)
    for p in ps:
        if p.leader:
            p.summarize()
    return ps[0].world()


def test_ranks_inside_one_collective_with_different_calls_are_a_desync():
    """Across nodes (blocks of 2), as the flat reading named them."""
    ps = planes(3, block=2)
    sig = {0: ALL_REDUCE, 1: ALL_GATHER, 2: ALL_REDUCE}
    world = world_of(ps, {r: beat({"default_pg": [7, s, True, 1.0, 0.1]}) for r, s in sig.items()})
    assert desync_in(world) == (f"desync in default_pg at collective #7: rank(s) [0, 2] called "
                                f"{ALL_REDUCE}; rank(s) [1] called {ALL_GATHER}")
    # rank 1 not inside #7 yet, or not quiet: no desync
    behind = {"default_pg": [6, ALL_GATHER, False, 0, 0.1]}
    assert desync_in(world_of(ps, {1: beat(behind)})) is None
    assert desync_in(world_of(ps, {1: beat(None)})) is None


def test_a_quiet_rank_behind_is_named_once_the_others_wait_past_the_usual_duration():
    """Ranks inside #7 for more than factor x its usual duration (floor at least), a quiet
    rank of the group whose newest collective is #6: named at once, and only then."""
    ps = planes(4, block=2)

    def judged(wait: float, usual: float | None = 0.1, behind: dict | None = None,
               factor: float = 10.0, floor: float = 0.5):
        inside = {"default_pg": [7, ALL_REDUCE, True, wait, usual]}
        at = behind if behind is not None else {"default_pg": [6, ALL_GATHER, False, 0.0, 0.1]}
        world = world_of(ps, {0: beat(inside), 1: beat(inside), 2: beat(at), 3: beat(inside)})
        return not_arrived(world, factor, floor)

    assert judged(wait=0.9) is None  # under 10 x 0.1 s
    reason, ranks = judged(wait=1.5)
    assert ranks == [2]
    assert reason == ("rank(s) [2] have not arrived at gloo:all_reduce #7 on default_pg: "
                      "rank(s) [0, 1, 3] have waited there 1.5 s, over 10x its usual 0.10 s")
    assert judged(wait=1.5, usual=0.01) is not None  # 10 x 0.01 s is under the floor...
    assert judged(wait=0.4, usual=0.01) is None  # ...which still holds
    assert judged(wait=1.5, factor=20) is None
    assert judged(wait=100, factor=0) is None  # off
    assert judged(wait=100, usual=None) is None  # never seen done: the hang timeout's case
    assert judged(wait=100, behind={}) is None  # rank 2 not quiet: it is making progress
    # behind in another group only: nothing keeps #7 of default_pg from finishing
    assert judged(wait=100, behind={"tp": [3, ALL_GATHER, False, 0.0, 0.1]}) is None


def test_a_silent_rank_its_peers_wait_for_is_named_before_the_hang_timeout():
    """Rank 2 (a node of its own) is frozen: its last heartbeat says it was computing, and
    its node's summary is its own, stale too. Ranks 0, 1 and 3 wait inside #7. Once its
    heartbeat is one and a half intervals old and they have waited that long, rank 0 names
    it, though the hang timeout is 300 s; not before, nor with nobody waiting for it."""
    ps = planes(4, block=1)

    def judged(silent_s: float, wait: float, inside: bool = True):
        at = {"default_pg": [7, ALL_REDUCE, inside, wait if inside else 0.0, 0.1]}
        frozen_at = time.time() - silent_s
        ps[2].publish(beat(None, wall=frozen_at))
        ps[2].store.set("node/2", json.dumps({"wall": frozen_at, "silent": [], "at": []}))
        return world_of(ps[:2] + ps[3:], {0: beat(at), 1: beat(at), 2: beat(at)})

    world = judged(silent_s=1.7, wait=1.8)
    assert world.stale == [2] and 1.6 < world.silent[2][0] < 2.5
    reason, ranks = awaited(world, ps[0].stale_s, 10.0)
    assert ranks == [2] and "waited 1.8 s" in reason, reason
    assert verdict(world, 300.0, 10.0, 3.0, ps[0].stale_s) == ("hang", reason)
    assert awaited(judged(silent_s=1.2, wait=1.8), ps[0].stale_s, 10.0) is None  # beats
    assert awaited(judged(silent_s=1.7, wait=1.2), ps[0].stale_s, 10.0) is None  # not yet
    assert awaited(judged(silent_s=5, wait=0, inside=False), ps[0].stale_s, 10.0) is None
    assert awaited(judged(silent_s=5, wait=1.8), ps[0].stale_s, 20.0) is None  # 20 x 0.1


def test_summaries_stay_bounded_and_a_stale_leader_is_read_around():
    ps = planes(40, block=20)
    inside = {"default_pg": [5, ALL_REDUCE, True, 2.0, 0.1]}
    world = world_of(ps, {r: beat(inside) for r in range(40)})
    [party] = world.at.values()
    assert party.count == 40 and party.ranks == list(range(LISTED))
    assert party.named() == f"{list(range(LISTED))} and {40 - LISTED} more"
    assert world.silent == {} and world.stale == []
    # rank 20, the second node's leader, stops: its summary goes stale, rank 0 reads the
    # node's heartbeats itself and finds rank 20 silent
    ps[20].publish(beat(None, wall=time.time() - 100))
    summary = json.loads(ps[0].store.get("node/20"))
    ps[0].store.set("node/20", json.dumps({**summary, "wall": summary["wall"] - 100}))
    world = world_of(ps[:20], {0: beat(None)})
    assert world.stale == [20] and list(world.silent) == [20] and world.silent[20][0] > 99


def arrivals(rank: int, late_ns: int, n: int = 40) -> list[dict]:
    """gloo recorder entries of ``n`` collectives 10 ms apart, this rank ``late_ns`` late."""
    return [{"process_group": ["0", "default_pg"], "collective_seq_id": s, "retired": True,
             "time_created_ns": 10**12 + s * 10**7 + late_ns} for s in range(1, n + 1)]


def test_stragglers_across_nodes_match_the_flat_estimate_in_a_fixed_size():
    """Rank 5 arrives 5 ms late at every 10 ms collective: twice as slow. Reduced per node
    (blocks of 2) it gets the same slowdown as over all ranks at once."""
    late = {r: 5 * 10**6 if r == 5 else r * 1000 for r in range(12)}
    found = {}
    for block in (12, 2):
        ps = planes(12, block)
        for r, p in enumerate(ps):
            p.publish_arrivals(arrivals(r, late[r]))
        for p in ps:
            if p.leader:
                p.reduce_arrivals()
        found[block] = ps[0].stragglers()
    flat, nodes = found[12], found[2]
    assert flat.ranks == nodes.ranks == 12 and flat.collectives == nodes.collectives == 40
    assert nodes.top == flat.top and len(nodes.top) == LISTED
    assert nodes.top[0][0] == 5 and 1.9 < nodes.top[0][1] < 2.1
    assert abs(nodes.p50 - 1.0) < 0.01 and nodes.p99 == flat.p99 > 1.9


def test_a_warm_recoverys_spare_is_compared_only_with_the_new_generation():
    """After a warm recovery the survivor's recorder still holds the old groups' entries,
    with the names the new groups (and the spare's) reuse: only the new ones count."""
    ps = planes(2, 2)
    old = arrivals(0, 0)  # generation 0, one minute before the new groups formed
    new = arrivals(0, 1000)
    spare = arrivals(1, 2000)  # the spare's recorder: the new groups only
    for e in old:
        e["time_created_ns"] -= 60 * 10**9
    for entries, pg_id in ((old, 0), (new, 7), (spare, 0)):  # ids count every group made
        for e in entries:
            e["pg_id"] = pg_id
    for p in ps:
        p.since_ns = 10**12  # the new generation formed
    ps[0].publish_arrivals(old + new)
    ps[1].publish_arrivals(spare)
    ps[0].reduce_arrivals()
    scores = ps[0].stragglers()
    assert scores.collectives == 40 and all(s < 1.01 for _, s in scores.top), scores


def test_positions_come_from_the_flight_recorder():
    """The newest collective per group, how long it has been waited in, and the op's usual
    duration: gloo records no completion, so the time to the rank's next collective."""
    base = 10**18

    def entry(seq, op, created_ms, retired=True, pg=("0", "default_pg")):
        return {"collective_seq_id": seq, "profiling_name": op, "process_group": list(pg),
                "input_sizes": [[16]], "input_dtypes": ["Float"], "retired": retired,
                "state": "scheduled", "time_created_ns": base + created_ms * 10**6}
    entries = [entry(1, "gloo:all_reduce", 0), entry(2, "gloo:all_gather", 100),
               entry(3, "gloo:all_reduce", 300), entry(4, "gloo:all_gather", 350),
               entry(5, "gloo:all_reduce", 1000, retired=False),
               entry(1, "gloo:broadcast", 20, pg=("1", "tp"))]
    at = positions(entries, base + 3000 * 10**6)
    assert at["default_pg"] == [5, "gloo:all_reduce sizes=[[16]] dtypes=['Float']", True,
                                2.0, 0.075]  # median of 0.1 and 0.05 s
    assert at["tp"] == [1, "gloo:broadcast sizes=[[16]] dtypes=['Float']", False, 0.0, None]


def test_a_lost_ranks_old_beat_is_no_silence_of_the_spare_that_replaces_it():
    """Rank 1 stopped 10 s ago and a warm recovery began a new generation just now: until
    the spare in its place publishes its first beat, rank 1 has been silent only since
    the generation began (the CI saw a second hang declared from the old beat)."""
    ps = planes(2, block=1)
    ps[0].publish(beat(None))
    ps[1].publish(beat(None, wall=time.time() - 10))
    ps[0].summarize()
    assert list(ps[0].world().silent) == [1]
    ps[0].since_ns = time.time_ns()  # Watchdog.new_generation
    assert ps[0].world().silent == {}
    assert time.time() - ps[0].beats([1])[1]["wall"] < 1


def test_an_older_generations_positions_are_not_judged_in_the_new_one():
    """Just before a warm recovery, node 2's leader summarized its block: rank 3 waiting
    long in #9, rank 2 still at #8 (as the old groups stood, blocked by a stopped rank).
    A spare that became rank 0 read that summary, fresh by the clock, and declared a hang
    in the new generation (a chaos run went cold on it). Once the new generation began
    (its groups formed with every member), neither that summary nor a beat published
    before it is judged; a leader's summary made after it is."""
    ps = planes(4, block=2)
    waiting = {"default_pg": [9, ALL_REDUCE, True, 5.3, 0.4]}
    behind = {"default_pg": [8, ALL_REDUCE, False, 0.0, 0.4]}
    world = world_of(ps, {0: beat(None), 1: beat(waiting), 2: beat(behind), 3: beat(waiting)})
    assert not_arrived(world, 10.0, 3.0)[1] == [2]  # as the old generation stood
    time.sleep(0.01)
    for p in ps:
        p.since_ns = time.time_ns()  # Watchdog: started, or new_generation
    fresh = ps[0].world()
    assert fresh.stale == [0, 2] and not_arrived(fresh, 10.0, 3.0) is None
    assert verdict(fresh, 300.0, 10.0, 3.0, ps[0].stale_s) is None
    assert fresh.silent == {}  # the old beats count as beaten at the generation's start
    # the new generation's beats are judged again: rank 2 behind in the new groups' #4
    new_waiting = {"default_pg": [4, ALL_REDUCE, True, 5.3, 0.4]}
    new_behind = {"default_pg": [3, ALL_REDUCE, False, 0.0, 0.4]}
    world = world_of(ps, {0: beat(None), 1: beat(new_waiting), 2: beat(new_behind),
                          3: beat(new_waiting)})
    assert world.stale == [] and not_arrived(world, 10.0, 3.0)[1] == [2]
