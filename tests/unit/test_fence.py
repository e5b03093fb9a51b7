"""The fence against a real store: a member writes, a rank of a past membership or one
that cannot reach the store is refused, says so once, and writes no event after."""

import pickle
from datetime import timedelta

import pytest
import torch.distributed as dist

from llmtrain.events import EventLog, read_events
from llmtrain.recovery.fence import Fence, Fenced
from llmtrain.recovery.warm import outside_store


def client(server: dist.TCPStore, timeout_s: float = 2.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True,
                         timeout=timedelta(seconds=timeout_s))


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         use_libuv=True)


def test_a_member_writes_and_a_rank_of_a_past_membership_is_refused(server, tmp_path):
    events = EventLog(str(tmp_path), rank=1)
    old = Fence(client(server), events, 2.0)
    old.join("round-a/g0")
    old.check("shard 1")  # still the job's membership: no error
    Fence(client(server), EventLog(str(tmp_path), rank=0), 2.0).join("round-a/g1")
    with pytest.raises(Fenced, match="re-formed as round-a/g1 without this rank"):
        old.check("checkpoint file step-00000020/__1_0.distcp")
    with pytest.raises(Fenced):  # refused for good, even if the store said otherwise now
        old.check("the commit")
    events.emit("step", step=21)  # a fenced rank's events are not the job's
    fenced = read_events(str(tmp_path), "fenced")
    assert len(fenced) == 1
    assert fenced[0]["what"] == "checkpoint file step-00000020/__1_0.distcp"
    assert fenced[0]["mine"] == "round-a/g0"
    assert read_events(str(tmp_path), "step") == []


def test_a_survivor_is_not_superseded_by_the_membership_it_agreed_to_join(server, tmp_path):
    """A warm recovery's spare may name the new membership before the survivor does: the
    survivor's watchdog must not take that for the job going on without it (a CI run caught
    a survivor fencing itself so). Another membership still supersedes it."""
    survivor = Fence(client(server), EventLog(str(tmp_path), rank=1), 2.0)
    survivor.join("round-a/g0")
    spare = Fence(client(server), EventLog(str(tmp_path), rank=0), 2.0)
    survivor.expect("round-a/g1")
    spare.join("round-a/g1")
    assert survivor.superseded() is None
    survivor.join("round-a/g1")
    spare.join("round-a/g2")  # a recovery without it
    assert "re-formed as round-a/g2 without this rank" in survivor.superseded()


def test_a_rank_that_cannot_reach_the_store_cannot_prove_it_is_a_member(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           use_libuv=True)
    fence = Fence(client(server, timeout_s=0.5), EventLog(str(tmp_path), rank=0), 0.5)
    fence.join("round-a/g0")
    del server  # the store goes away (the partition test cuts the link instead)
    with pytest.raises(Fenced, match="could not be reached within reliability.fence_timeout_s"):
        fence.check("checkpoint file __0_0.distcp")


def test_without_a_store_outside_the_workers_nothing_is_fenced(tmp_path):
    fence = Fence(None, EventLog(str(tmp_path), rank=0), 1.0)
    fence.join("round-a/g0")
    fence.check("checkpoint file __0_0.distcp")


def test_a_fence_sent_to_a_writer_process_connects_again_and_still_refuses(
        server, tmp_path, monkeypatch):
    """checkpoint.mode=async_process pickles the checkpoint writer, its fence with it."""
    monkeypatch.setenv("LLMTRAIN_RDZV_ENDPOINT", f"127.0.0.1:{server.port}")
    fence = Fence(outside_store(timedelta(seconds=2)), EventLog(str(tmp_path), rank=1), 2.0)
    fence.join("round-a/g0")
    sent = pickle.loads(pickle.dumps(fence.check)).__self__
    sent.check("checkpoint file __1_0.distcp")
    Fence(outside_store(timedelta(seconds=2)), EventLog(str(tmp_path), rank=0),
          2.0).join("round-b/g0")
    with pytest.raises(Fenced, match="re-formed as round-b/g0"):
        sent.check("checkpoint file __1_1.distcp")


def test_a_rank_learns_it_was_superseded_only_from_a_store_that_answers(server, tmp_path):
    """The watchdog's question at every tick: an unreachable store proves nothing (a
    glitch must not end a member), another membership in it does."""
    old = Fence(client(server), EventLog(str(tmp_path), rank=1), 2.0)
    old.join("round-a/g0")
    assert old.superseded() is None
    Fence(client(server), EventLog(str(tmp_path), rank=0), 2.0).join("round-a/g1")
    assert "re-formed as round-a/g1 without this rank" in old.superseded()
    lone = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         use_libuv=True)
    cut_off = Fence(client(lone, timeout_s=0.5), EventLog(str(tmp_path), rank=2), 0.5)
    cut_off.join("round-b/g0")
    Fence(client(lone), EventLog(str(tmp_path), rank=0), 2.0).join("round-b/g1")
    assert cut_off.superseded()
    del lone  # the store goes away (a partition, from this side)
    assert cut_off.superseded() is None
