"""The rendezvous wake on torch's own c10d rendezvous and a real TCPStore: a node that joins
the wait list is seen by a running node's next look, not after torch's cache runs out; a
round that lacks only nodes known dead completes without torch's last call."""

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

from llmtrain.distributed.rendezvous_wake import announce_change, changes_key, close_all, wake


@pytest.fixture
def store():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master


def handler(port: int, last_call: int = 1):
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}",
                                  run_id="wake-test", min_nodes=1, max_nodes=2,
                                  is_host=False, last_call_timeout=last_call,
                                  join_timeout=60)
    backend, store = create_backend(params)
    return dynamic_rendezvous.create_handler(store, backend, params)


def test_a_node_joining_the_wait_list_is_seen_at_the_running_nodes_next_look(store,
                                                                             monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as llmtrain launch sets
    # The arriving node's last call is long: woken by the running node's leaving, it may
    # join the next round first, and with a 1 s last call of its own it completed that
    # round alone once the running node's thread, on a loaded machine, took over a second
    # to join (which then waited a minute for a round nobody started)
    running, arriving = handler(store.port), handler(store.port, last_call=30)
    woken = wake(running)
    assert woken is not None and wake(running) is woken  # installed once
    running.next_rendezvous()  # alone: min 1 node, after a 1 s last call
    # torch would answer from its cache for a minute: only an announced change reads
    running._state_holder._cache_duration = 60
    assert running.num_nodes_waiting() == 0
    wake(arriving)
    joining = threading.Thread(target=arriving.next_rendezvous, daemon=True)
    joining.start()  # the round is complete: it waits for the next one
    deadline = time.monotonic() + 20
    while running.num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running.num_nodes_waiting() == 1, "the waiting node was never seen"
    # a heartbeat is no change: the keep-alive writes the state without announcing it
    key = changes_key("wake-test")
    changes = store.add(key, 0)
    running._state_holder.state.last_heartbeats[running._this_node] -= timedelta(seconds=6)
    running._op_executor.run(dynamic_rendezvous._RendezvousKeepAliveOp(),
                             time.monotonic() + 10)
    assert store.add(key, 0) == changes
    # the waiting node joins the next round when the running one leaves for it, woken by
    # that change: within a 1 s last call, where torch's reads a second apart may miss it
    running.next_rendezvous()
    joining.join(timeout=20)
    assert not joining.is_alive()
    assert len(running._state_holder.state.participants) == 2
    close_all()


def test_a_restart_round_completes_at_once_when_the_missing_node_is_known_dead(store,
                                                                               monkeypatch):
    """Without a spare, the survivor of a lost node restarts alone: its round holds the
    minimum (1 of 2) and would wait out torch's last call (30 s here); with the lost node
    known dead it completes at once. A node of the last round that is alive is waited
    for, so the round does not complete without it."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    gone: set[str] = set()
    survivor, lost = handler(store.port, last_call=30), handler(store.port, last_call=30)
    woken = wake(survivor, gone=lambda: gone)
    wake(lost)
    first = threading.Thread(target=lost.next_rendezvous, daemon=True)
    first.start()
    survivor.next_rendezvous()  # two of two: complete at once
    first.join(timeout=20)
    assert len(survivor._state_holder.state.participants) == 2
    lost._stop_heartbeats()  # it dies: no more keep-alives

    restarting = threading.Thread(target=survivor.next_rendezvous, daemon=True)
    restarting.start()  # the other node is alive as far as anyone knows: wait for it
    restarting.join(timeout=3)
    assert restarting.is_alive(), "the round completed without a live node of the last"
    assert woken.closed_early == []

    gone.add(str(lost._this_node))  # its presence connection closed
    announce_change(store, "wake-test")
    began = time.monotonic()
    restarting.join(timeout=20)
    assert not restarting.is_alive(), "the round waited for a node known dead"
    assert time.monotonic() - began < 10  # not the 30 s last call
    state = survivor._state_holder.state
    assert state.complete and list(state.participants) == [survivor._this_node]
    assert woken.closed_early == [(state.round, [str(survivor._this_node)],
                                   [str(lost._this_node)])]
    close_all()
