"""In-memory snapshots and their replicas, between two real gloo processes: a replica
restores bit for bit, one corrupted in memory is caught by its checksum and never used, and
a replication that fails says so in the event log."""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from ranks import spawn

from llmtrain.checkpoint.snapshots import Schedule, SnapshotError, Snapshots
from llmtrain.state_registry import state_tensors
from llmtrain.events import EventLog, read_events


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _worker(rank: int, run_dir: str, out: str) -> None:
    store = dist.FileStore(f"{out}.store", 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    events = EventLog(run_dir, rank)
    snaps = Snapshots(Schedule(1), rank, buddy=1 - rank, ward=1 - rank, events=events)
    snaps.start(group, None, 0)
    model, optimizer = _model_and_optimizer(seed=rank)
    for step in (1, 2, 3):  # three rounds through two slots: the oldest is reused
        for p in model.parameters():
            p.data.add_(step)
        assert snaps.take(step, state_tensors(model, optimizer, []), {"marker": step})
        assert snaps.wait_idle(30)
    snaps.stop(30)
    result = {"holdings": snaps.holdings()}
    # rank 1 hands rank 0's state back (as to a replacement): it restores bit for bit
    if rank == 1:
        snaps.send_replica(3, 0, group)
    else:
        replica = Snapshots.receive(1, group, timeout_s=30)
        fresh_model, fresh_opt = _model_and_optimizer(seed=99)
        header = replica.restore_into(state_tensors(fresh_model, fresh_opt, []))
        result["marker"] = header["marker"]
        result["equal"] = all(torch.equal(a, b) for a, b in zip(
            state_tensors(model, optimizer, []), state_tensors(fresh_model, fresh_opt, [])))
    # a bit flipped in the replica rank 1 holds: caught before it is handed on
    if rank == 1:
        snaps.replicas.at(3).buffer[100] ^= 4
        snaps.send_replica(3, 0, group)
    else:
        try:
            Snapshots.receive(1, group, timeout_s=30)
            result["corrupt_caught"] = False
        except SnapshotError as e:
            result["corrupt_caught"] = "failed its checksum" in str(e)
    # a buddy that sends nothing (it failed, or hangs): the replacement gives up in time
    silent = dist.new_group(backend="gloo")
    if rank == 0:
        began = time.monotonic()
        try:
            Snapshots.receive(1, silent, timeout_s=0.5)
        except SnapshotError as e:
            result["silent"] = [time.monotonic() - began, "did not come within" in str(e)]
    dist.barrier()
    # a thread that stop() left behind mid-exchange keeps nothing it receives later:
    # rank 0's thread waits for rank 1's sizes when it is stopped; rank 1 then sends them
    late = dist.new_group(backend="gloo")
    snaps.start(late, None, 3)
    if rank == 0:
        snaps.take(4, state_tensors(model, optimizer, []), {"marker": 4})
        while snaps._work is not None:  # until the thread has taken it up
            time.sleep(0.01)
        snaps.stop(0.2)
    dist.barrier()
    if rank == 1:
        snaps.take(4, state_tensors(model, optimizer, []), {"marker": 4})
        snaps.wait_idle(1)  # it never is: rank 0's thread sends nothing after the sizes
    else:
        result["stale_finished"] = snaps.wait_idle(30)
        result["after_stale"] = snaps.holdings()["replicas"]
    dist.barrier()
    if rank == 1:  # its thread waits for rank 0's header until rank 0's sockets close
        snaps.stop(30)
    events.close()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_a_replica_restores_bitwise_and_a_corrupted_or_missing_one_is_refused(tmp_path):
    out = str(tmp_path / "result")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn(_worker, args=(str(tmp_path), out), nprocs=2)
    r0, r1 = (json.load(open(f"{out}.{r}")) for r in (0, 1))
    assert r0["holdings"] == {"own": [2, 3], "ward": 1, "replicas": [2, 3]}
    assert r0["marker"] == 3 and r0["equal"]
    assert r0["corrupt_caught"]
    waited, said = r0["silent"]  # given up within its budget, not the group's 30 minutes
    assert said and 0.4 < waited < 10, r0["silent"]
    assert r0["stale_finished"] and r0["after_stale"] == [2, 3]
    (corrupt,) = read_events(str(tmp_path), "snapshot_corrupt")
    assert corrupt["rank"] == 1 and corrupt["step"] == 3 and corrupt["when"] == "before restore"
    # rank 1's thread, left behind by stop(), fails once rank 0's sockets close: said, as
    # stale (expected after a recovery, and not counted as a failure by the metrics)
    (stale,) = read_events(str(tmp_path), "snapshot_replication_failed")
    assert stale["rank"] == 1 and stale["step"] == 4 and stale["stale"] is True, stale


def _failing_worker(rank: int, run_dir: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}.store", 2), rank=rank,
                            world_size=2)
    events = EventLog(run_dir, rank)
    snaps = Snapshots(Schedule(1), rank, buddy=1 - rank, ward=1 - rank, events=events)
    snaps.start(dist.new_group(backend="gloo"), None, 0)
    model, optimizer = _model_and_optimizer(seed=rank)
    assert snaps.take(1, state_tensors(model, optimizer, []), {})
    assert snaps.wait_idle(30)  # one exchange that works
    dist.barrier()
    if rank == 1:  # the buddy goes away (its process ends) without taking step 2
        snaps.stop(30)
        events.close()
        return
    # rank 0's thread sends its sizes and waits for rank 1's until rank 1's sockets close
    assert snaps.take(2, state_tensors(model, optimizer, []), {})
    finished = snaps.wait_idle(60)
    events.close()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"finished": finished, "replicas": snaps.holdings()["replicas"]}, f)
    # gloo, its peer gone, at times aborts the interpreter's exit ("terminate called
    # without an active exception"): everything this test checks is written by now
    os._exit(0)


def test_a_replication_that_fails_says_why(tmp_path):
    """The exchange with the buddy raises (its process is gone): the thread ends, and the
    rank's event log says which exchange failed and with what error."""
    out = str(tmp_path / "result")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn(_failing_worker, args=(str(tmp_path), out), nprocs=2)
    r0 = json.load(open(f"{out}.0"))
    assert r0["finished"] and r0["replicas"] == [1]
    (failed,) = read_events(str(tmp_path), "snapshot_replication_failed")
    assert {k: failed[k] for k in ("rank", "buddy", "ward", "step", "stale")} == {
        "rank": 0, "buddy": 1, "ward": 1, "step": 2, "stale": False}
    name, _, message = failed["error"].partition(": ")
    assert name.isidentifier() and message and len(failed["error"]) <= 500, failed


def test_a_layout_that_does_not_match_is_refused():
    snaps = Snapshots(Schedule(1), 0, buddy=None, ward=None, events=None)
    model, optimizer = _model_and_optimizer(seed=0)
    snaps.take(1, state_tensors(model, optimizer, []), {})
    other = torch.nn.Linear(8, 2)
    with pytest.raises(SnapshotError, match="layout"):
        snaps.own.at(1).restore_into([other.weight])


def test_the_interval_grows_until_snapshots_fit_the_budget():
    schedule = Schedule(every=2, budget=0.03, max_every=50)
    assert schedule.proposal() == 2  # nothing measured yet
    schedule.steps.add(0.075)  # 75 ms a step
    for cost in (0.012, 0.011, 0.9, 0.012):  # 12 ms a snapshot, once 0.9 s (a save beside)
        schedule.costs.add(cost)
    assert schedule.proposal() == 6  # 12 / (0.03 * 75) = 5.3: 6 steps keep it under 3%
    schedule.costs.values.clear()
    schedule.costs.add(0.001)
    assert schedule.proposal() == 2  # never below snapshot_every
    schedule.costs.add(10.0)
    schedule.costs.add(10.0)
    assert schedule.proposal() == 50  # nor above snapshot_max_every
    assert Schedule(every=3).proposal() == 3  # no budget: a fixed interval


def test_a_generation_a_warm_recovery_made_snapshots_at_its_first_step():
    """A spare that joined at step 20 holds no snapshot of its own: with ``soon`` (what a
    warm generation's start passes), the first comes at step 21, not at 30."""
    def taken(schedule: Schedule) -> list[int]:
        steps = []
        for step in range(21, 42):
            if schedule.due(step):
                steps.append(step)
                schedule.advance(step, 0.0, None)
        return steps
    schedule = Schedule(every=10)
    schedule.restart(20, None)
    assert taken(schedule) == [30, 40]
    schedule.restart(20, None, soon=True)
    assert taken(schedule) == [21, 31, 41]


def _schedule_worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}.store", 2), rank=rank,
                            world_size=2)
    schedule = Schedule(every=1, budget=0.05, max_every=40)
    schedule.restart(0, dist.new_group(backend="gloo"))
    taken, proposals, replicated = [], [], None
    for step in range(1, 151):
        time.sleep(0.01)  # a 10 ms step (or longer, on a busy machine)
        if schedule.due(step):
            taken.append(step)
            cost = 0.001 * (1 + 4 * rank)  # rank 1's snapshots cost five times rank 0's
            time.sleep(cost)
            schedule.advance(step, cost, replicated)
            replicated = time.perf_counter()
            proposals.append(schedule.proposal())
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"taken": taken, "proposals": proposals}, f)
    dist.destroy_process_group()


def test_ranks_agree_on_the_snapshot_steps_and_the_costliest_rank_sets_them(tmp_path):
    """Two gloo processes whose snapshots cost differently: both take them at the same
    steps (a recovery needs a step every rank holds), as far apart as the rank that
    needs the most asks."""
    out = str(tmp_path / "schedule")
    spawn(_schedule_worker, args=(out,), nprocs=2)
    r0, r1 = (json.load(open(f"{out}.{r}")) for r in (0, 1))
    assert r0["taken"] == r1["taken"]
    gaps = [b - a for a, b in zip(r0["taken"], r0["taken"][1:])]
    assert max(gaps) > 1, gaps  # the budget stretched the interval
    # each interval after the first is the larger proposal of the snapshot before
    wanted = [max(a, b) for a, b in zip(r0["proposals"], r1["proposals"])]
    assert gaps[1:] == wanted[:len(gaps) - 1], (gaps, r0, r1)
    assert max(r1["proposals"]) > max(r0["proposals"][:2])  # it measured its own cost


def test_a_header_changed_in_memory_fails_the_checksum():
    """The header (step, data position, schedule, RNG) is inside the checksum: a flipped
    bit in it would restore the wrong state as surely as one in the tensors."""
    snaps = Snapshots(Schedule(1), 0, buddy=None, ward=None, events=None)
    model, optimizer = _model_and_optimizer(seed=0)
    snaps.take(1, state_tensors(model, optimizer, []), {"data": {"position": 64}})
    snap = snaps.own.at(1)
    snap.verify()
    snap.header["data"]["position"] = 65
    with pytest.raises(SnapshotError, match="checksum"):
        snap.verify()
