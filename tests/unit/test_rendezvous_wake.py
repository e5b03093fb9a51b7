"""The rendezvous wake on torch's own c10d rendezvous and a real TCPStore: a node that joins
the wait list is seen by a running node's next look, not after torch's cache runs out."""

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

from llmtrain.distributed.rendezvous_wake import changes_key, close_all, wake


@pytest.fixture
def store():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master


def handler(port: int):
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}",
                                  run_id="wake-test", min_nodes=1, max_nodes=2,
                                  is_host=False, last_call_timeout=1, join_timeout=30)
    backend, store = create_backend(params)
    return dynamic_rendezvous.create_handler(store, backend, params)


def test_a_node_joining_the_wait_list_is_seen_at_the_running_nodes_next_look(store,
                                                                             monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as llmtrain launch sets
    running, arriving = handler(store.port), handler(store.port)
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
