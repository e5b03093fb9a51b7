"""The fence against a real store: a member writes; a rank of a past membership is refused
for good, says so once and writes no event after; one that cannot reach the store is
refused while it cannot, and goes on once the store answers; a late member cannot roll the
membership back."""

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from conftest import RestartableStore, signed_store, sigstop
from llmtrain.distributed.signed_store import SignedStore
from llmtrain.events import EventLog, read_events
from llmtrain.recovery.fence import Fence, Fenced
from llmtrain.recovery.warm import outside_store


def client(server: dist.TCPStore, timeout_s: float = 2.0) -> SignedStore:
    return signed_store(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                      use_libuv=True, timeout=timedelta(seconds=timeout_s)))


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         use_libuv=True)


def test_a_member_writes_and_a_rank_of_a_past_membership_is_refused(server, tmp_path):
    events = EventLog(str(tmp_path), rank=1)
    old = Fence(client(server), events, 2.0)
    old.join("1-a/g0")
    old.check("shard 1")  # still the job's membership: no error
    Fence(client(server), EventLog(str(tmp_path), rank=0), 2.0).join("1-a/g1")
    with pytest.raises(Fenced, match="re-formed as 1-a/g1 without this rank"):
        old.check("checkpoint file step-00000020/__1_0.distcp")
    with pytest.raises(Fenced):  # refused for good, even if the store said otherwise now
        old.check("the commit")
    events.emit("step", step=21)  # a fenced rank's events are not the job's
    fenced = read_events(str(tmp_path), "fenced")
    assert len(fenced) == 1
    assert fenced[0]["what"] == "checkpoint file step-00000020/__1_0.distcp"
    assert fenced[0]["mine"] == "1-a/g0"
    assert read_events(str(tmp_path), "step") == []


def test_a_survivor_is_not_superseded_by_the_membership_it_agreed_to_join(server, tmp_path):
    """A warm recovery's spare may name the new membership before the survivor does: the
    survivor's watchdog must not take that for the job going on without it (a CI run caught
    a survivor fencing itself so). Another membership still supersedes it."""
    survivor = Fence(client(server), EventLog(str(tmp_path), rank=1), 2.0)
    survivor.join("1-a/g0")
    spare = Fence(client(server), EventLog(str(tmp_path), rank=0), 2.0)
    survivor.expect("1-a/g1")
    spare.join("1-a/g1")
    assert survivor.superseded() is None
    survivor.join("1-a/g1")
    spare.join("1-a/g2")  # a recovery without it
    assert "re-formed as 1-a/g2 without this rank" in survivor.superseded()


def test_a_look_that_read_the_store_before_a_join_never_fences_the_joining_rank(
        server, tmp_path, monkeypatch):
    """The watchdog looks (on its thread) while the training thread joins the recovery's
    membership: the look read the store's g0 before the join and compares after it. It
    must compare with the membership it read against, never call g0 a newer one without
    this rank (a chaos run caught a rank fenced so: "re-formed as .../g2 without this rank
    (it was .../g3)", and the job went cold)."""
    survivor = Fence(client(server), EventLog(str(tmp_path), rank=1), 2.0)
    survivor.join("1-a/g0")
    read, go = threading.Event(), threading.Event()
    current = Fence._current

    def read_then_pause(self, store):
        held = current(self, store)
        read.set()
        go.wait(5)
        return held
    monkeypatch.setattr(Fence, "_current", read_then_pause)
    looked = []
    look = threading.Thread(target=lambda: looked.append(survivor.superseded()))
    look.start()
    assert read.wait(5)
    monkeypatch.setattr(Fence, "_current", current)
    joining = threading.Thread(target=survivor.join, args=("1-a/g1",))
    joining.start()
    time.sleep(0.3)  # the join waits for the look, or (unfixed) ends before it
    go.set()
    look.join(5)
    joining.join(5)
    assert looked == [None] and survivor.refused is None
    assert survivor.superseded() is None and survivor.membership() == "1-a/g1"


def test_a_rank_that_cannot_reach_the_store_cannot_prove_it_is_a_member(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           use_libuv=True)
    fence = Fence(client(server, timeout_s=0.5), EventLog(str(tmp_path), rank=0), 0.5)
    fence.join("1-a/g0")
    del server  # the store goes away (the partition test cuts the link instead)
    with pytest.raises(Fenced, match="could not be reached within reliability.fence_timeout_s"):
        fence.check("checkpoint file __0_0.distcp")


def test_without_a_store_outside_the_workers_nothing_is_fenced(tmp_path):
    fence = Fence(None, EventLog(str(tmp_path), rank=0), 1.0)
    fence.join("1-a/g0")
    fence.check("checkpoint file __0_0.distcp")


def test_a_fence_sent_to_a_writer_process_connects_again_and_still_refuses(
        server, tmp_path, monkeypatch):
    """checkpoint.mode=async_process pickles the checkpoint writer, its fence with it."""
    monkeypatch.setenv("LLMTRAIN_RDZV_ENDPOINT", f"127.0.0.1:{server.port}")
    fence = Fence(outside_store(timedelta(seconds=2)), EventLog(str(tmp_path), rank=1), 2.0)
    fence.join("1-a/g0")
    sent = pickle.loads(pickle.dumps(fence.check)).__self__
    sent.check("checkpoint file __1_0.distcp")
    Fence(outside_store(timedelta(seconds=2)), EventLog(str(tmp_path), rank=0),
          2.0).join("2-b/g0")
    with pytest.raises(Fenced, match="re-formed as 2-b/g0"):
        sent.check("checkpoint file __1_1.distcp")


def test_a_rank_learns_it_was_superseded_only_from_a_store_that_answers(server, tmp_path):
    """The watchdog's question at every tick: an unreachable store proves nothing (a
    glitch must not end a member), another membership in it does."""
    old = Fence(client(server), EventLog(str(tmp_path), rank=1), 2.0)
    old.join("1-a/g0")
    assert old.superseded() is None
    Fence(client(server), EventLog(str(tmp_path), rank=0), 2.0).join("1-a/g1")
    assert "re-formed as 1-a/g1 without this rank" in old.superseded()
    lone = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         use_libuv=True)
    cut_off = Fence(client(lone, timeout_s=0.5), EventLog(str(tmp_path), rank=2), 0.5)
    cut_off.join("2-b/g0")
    Fence(client(lone), EventLog(str(tmp_path), rank=0), 2.0).join("2-b/g1")
    assert cut_off.superseded()
    del lone  # the store goes away (a partition, from this side)
    assert cut_off.superseded() is None


def test_a_late_member_cannot_roll_the_membership_back(server, tmp_path):
    """A warm spare that outlasted its budget joins generation 1 of round 1 after round 2
    formed: the store keeps round 2's token (a compare-and-set from the predecessor, never
    a plain set) and the late one is refused, where its set fenced out every current
    member."""
    current = Fence(client(server), EventLog(str(tmp_path), rank=0), 2.0)
    current.join("1-a/g0")
    current.join("1-a/g1")  # generations move forward within a round
    current.join("2-b/g0")  # and a later round's first one past any of them
    late = Fence(client(server), EventLog(str(tmp_path), rank=1), 2.0)
    with pytest.raises(Fenced, match="re-formed as 2-b/g0 before this rank joined 1-a/g1"):
        late.join("1-a/g1")
    current.check("checkpoint file __0_0.distcp")  # still the job's membership
    assert signed_store(server).get("fence/token") == b"2-b/g0"
    (fenced,) = read_events(str(tmp_path), "fenced")
    assert fenced["rank"] == 1 and fenced["what"] == "joining the job"


STORE = """
import time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
print(store.port, flush=True)
time.sleep(300)
"""


def _within(seconds: float, call):
    """``call()``'s outcome (its value or its exception), or "hung" after ``seconds``."""
    out = ["hung"]

    def run():
        try:
            out[0] = call()
        except Exception as e:  # noqa: BLE001
            out[0] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return out[0]


def test_a_store_that_stalls_refuses_writes_only_while_it_does(tmp_path):
    """The store's process stops (SIGSTOP: its connections stay up, nothing answers) and
    continues. Meanwhile a write is refused within the fence timeout (a TCPStore request
    alone waited for ever), said once, and the rank's events go on; once the store answers
    again, writes go on (the refusal was latched for the rest of the run before: every
    later save failed, and rank 0's events stopped)."""
    server = subprocess.Popen([sys.executable, "-c", STORE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        connect = lambda: signed_store(dist.TCPStore(  # noqa: E731
            "127.0.0.1", port, is_master=False, use_libuv=True, timeout=timedelta(seconds=0.5)))
        events = EventLog(str(tmp_path), rank=0)
        fence = Fence(connect(), events, 0.5, connect=connect)
        fence.join("1-a/g0")
        sigstop(server.pid)
        for _ in range(2):
            refused = _within(10, lambda: fence.check("checkpoint file __0_0.distcp"))
            assert isinstance(refused, Fenced) and "could not be reached" in str(refused)
        assert fence.superseded() is None  # no proof of anything: the watchdog goes on
        events.emit("step", step=7)
        os.kill(server.pid, signal.SIGCONT)
        assert _within(10, lambda: fence.check("checkpoint file __0_1.distcp")) is None
        (unreachable,) = read_events(str(tmp_path), "fence_unreachable")
        assert unreachable["what"] == "checkpoint file __0_0.distcp"
        assert read_events(str(tmp_path), "step") and not read_events(str(tmp_path), "fenced")
        Fence(connect(), EventLog(str(tmp_path), rank=1), 2.0).join("1-a/g1")
        with pytest.raises(Fenced, match="re-formed as 1-a/g1"):  # a proof still counts
            fence.check("checkpoint file __0_2.distcp")
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()


def _answered(call, seconds: float = 10.0):
    """``call()`` once the store answers again: a look that meets the dead connection is
    refused as unreachable, and the next one connects anew."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except Fenced as e:
            if "could not be reached" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_store_restarted_empty_has_the_membership_restored_and_the_old_still_fenced(
        tmp_path):
    """The store is killed and started again with no keys. Saves go on (the token put
    back, said once): before, every later write was refused for the rest of the run. A
    member cut off before the restart is still refused, whichever looks first; the next
    round is numbered past the restored token (or the cold restart's members would all
    be refused as late)."""
    store = RestartableStore()
    try:
        old = Fence(store.connect(), EventLog(str(tmp_path), rank=1), 1.0, store.connect)
        old.join("5-a/g0")
        member = Fence(store.connect(), EventLog(str(tmp_path), rank=0), 1.0, store.connect)
        member.join("5-a/g1")  # the job re-formed without `old`, which has not looked since
        store.restart()
        _answered(lambda: member.check("checkpoint file __0_0.distcp"))
        assert store.connect().get("fence/token") == b"5-a/g1"
        (restored,) = read_events(str(tmp_path), "fence_restored")
        assert restored["mine"] == "5-a/g1" and restored["rank"] == 0
        with pytest.raises(Fenced, match="re-formed as 5-a/g1"):
            _answered(lambda: old.check("checkpoint file __1_0.distcp"))

        store.restart()  # again, and this time the cut-off member looks first
        later = Fence(store.connect(), EventLog(str(tmp_path), rank=2), 1.0, store.connect)
        later.token = "5-a/g0"  # as `old` was, before it was refused
        _answered(lambda: later.check("checkpoint file __2_0.distcp"))  # the one window
        _answered(lambda: member.check("checkpoint file __0_1.distcp"))  # puts g1 back
        with pytest.raises(Fenced, match="re-formed as 5-a/g1"):
            later.check("checkpoint file __2_1.distcp")

        from llmtrain.recovery.fence import round_of
        job = dist.HashStore()
        assert round_of(job, store.connect()).startswith("6-")  # past round 5, restored
    finally:
        store.close()


def test_the_failure_watch_outlives_a_store_restart():
    """The store restarts under a waiting watch: it connects again and a failure reported
    after the restart still wakes it (it ended without a word, and a rank blocked behind a
    healthy peer waited for its collective's timeout)."""
    from llmtrain.distributed.failure import FailureWatch
    store = RestartableStore()
    try:
        watch = FailureWatch(store.connect, "round/g0/failed")
        time.sleep(0.3)
        store.restart()
        time.sleep(1.5)  # the watch meets the dead connection, and connects again
        assert watch._thread.is_alive() and not watch.woke.is_set()
        store.connect().set("round/g0/failed", "1")
        assert watch.woke.wait(5)
    finally:
        store.close()
