"""Cutting a stuck peer's connections from this side (llmtrain/recovery/sockets.py) and
evicting a rank whose agent does not answer, with real sockets and a real store."""

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time


from llmtrain.config import WarmConfig
from llmtrain.recovery import sockets
from llmtrain.launch.standby import answer_evictions
from llmtrain.recovery.eviction import EvictionWatch, evict, publish_endpoints
from llmtrain.recovery.roll_call import owner, rank_of
from llmtrain.recovery.warm import WarmPath
from conftest import signed_store


def _pair(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return client, accepted


def test_a_receive_stuck_on_a_silent_peer_ends_when_its_connection_is_cut():
    """The stand-in for a partitioned peer never sends; a thread waits on it as gloo's
    collective would. Cutting by the peer's published endpoints ends that wait at once
    and leaves a connection to a healthy peer open."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        stuck_peer, ours = _pair(server)
        healthy_peer, other = _pair(server)
        got = []
        waiter = threading.Thread(target=lambda: got.append(ours.recv(1)))
        waiter.start()
        time.sleep(0.2)
        assert waiter.is_alive()
        silent = {f"127.0.0.1:{stuck_peer.getsockname()[1]}"}
        assert silent <= set(sockets.endpoints())  # what the peer would have published
        assert sockets.cut(silent) == 1
        waiter.join(timeout=5)
        assert not waiter.is_alive() and got == [b""]
        healthy_peer.sendall(b"x")
        assert other.recv(1) == b"x"
        for s in (stuck_peer, ours, healthy_peer, other):
            s.close()


def test_each_connection_says_whether_its_peers_close_or_reset_arrived_and_what_waits():
    """What a stuck rank's event carries of its connections: one whose peer closed
    cleanly (close_wait, its unread bytes counted), one the peer reset (closed, no peer
    left), and one alive with data this side wrote and the peer has not read."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        closed_by_peer, closer = _pair(server)
        reset_by_peer, resetter = _pair(server)
        alive, reader = _pair(server)
        closer.sendall(b"abc")
        closer.close()  # a FIN after the data
        reset_by_peer.sendall(b"x")
        time.sleep(0.1)
        resetter.close()  # unread data on its side: the kernel resets the connection
        alive.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        alive.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            for _ in range(10_000):  # until the peer's window and this side's buffer fill
                alive.send(b"y" * 4096)
        time.sleep(0.2)
        found = {c["local"]: c for c in sockets.connections()}

        def seen(s: socket.socket) -> dict:
            return found[f"127.0.0.1:{s.getsockname()[1]}"]
        assert seen(closed_by_peer) | {"local": None} == {
            "local": None, "peer": f"127.0.0.1:{server.getsockname()[1]}",
            "state": "close_wait", "unread": 3, "unsent": 0}
        assert (seen(reset_by_peer)["state"], seen(reset_by_peer)["peer"]) == ("closed", None)
        assert seen(alive)["state"] == "established" and seen(alive)["unsent"] > 0
        assert seen(reader)["unread"] > 0
        assert len(sockets.connections(limit=2)) == 2
        for s in (closed_by_peer, reset_by_peer, alive, reader):
            s.close()


def test_an_agent_that_does_not_answer_has_its_rank_marked_gone_and_cut_off():
    store = signed_store()
    cfg = WarmConfig(enable=True)
    WarmPath(cfg, store, "round", 1, 2, 1)  # rank 1 says where it would report
    publish_endpoints(store, 1)
    assert json.loads(store.get("endpoints/1")) == sockets.endpoints()
    start = time.monotonic()
    assert evict(store, [1], wait_s=0.3) == {1: sockets.endpoints()}  # no agent answered
    assert 0.3 <= time.monotonic() - start < 2
    # should its agent come back, it kills the rank's process
    assert int(store.get(f"evict/{owner()}")) == 1
    assert store.add("round/g0/gone", 0) == 1  # its generation's survivors need not wait

    # an agent that answers: nobody is cut off
    def agent():
        while int(store.get(f"evict/{owner()}")) < 2:
            time.sleep(0.01)
        store.add("evicted/1", 1)
    threading.Thread(target=agent).start()
    assert evict(store, [1], wait_s=5) == {}


def test_a_spare_that_took_the_rank_meanwhile_is_neither_cut_nor_marked_gone():
    """The stuck rank dies by another hand while its agent is silent, and a spare takes its
    rank before the wait ends: the old holder is gone, so nobody is cut off (in a soak, the
    spare's own connections were cut and its generation counted it gone)."""
    store = signed_store()
    cfg = WarmConfig(enable=True)
    WarmPath(cfg, store, "round", 1, 2, 1)
    store.set("endpoints/1", json.dumps(["10.0.0.2:4000"]))

    def spare_takes_rank_1():
        while not store.check([f"evict/{owner()}"]):
            time.sleep(0.01)
        WarmPath(cfg, store, "round", 1, 2, 1, gen=1)
        store.set("endpoints/1", json.dumps(["10.0.0.3:5000"]))
    threading.Thread(target=spare_takes_rank_1).start()
    start = time.monotonic()
    assert evict(store, [1], wait_s=10) == {}
    assert time.monotonic() - start < 10  # answered by the spare's arrival, not timed out
    assert store.add("round/g1/gone", 0) == 0


def test_a_spare_holding_a_rank_is_killed_by_its_launcher_when_evicted():
    """A spare that took a rank runs under its standby launcher, not an agent: the launcher
    answers the watchdog's eviction as an agent does, killing the spare's session."""
    store = signed_store()
    spare = subprocess.Popen(["sleep", "60"], start_new_session=True)
    holder = owner(spare.pid, "node3")
    store.set(f"evict/{holder}", "1")  # an earlier eviction of this process id: not this spare's
    store.add("evictions", 1)
    # the spare holds rank 3, where its peers report now
    store.set("where/3", "round/g1/")
    store.set("round/g1/owner/3", holder)
    store.set("round/g1/size", "4")
    store.set(f"rank_of/{holder}", "3")
    watch = EvictionWatch(store, [holder])
    answered = threading.Event()

    def launcher() -> None:  # its launcher's loop
        while spare.poll() is None and not answered.is_set():
            if answer_evictions(spare, watch):
                answered.set()
            time.sleep(0.05)
    watching = threading.Thread(target=launcher)
    watching.start()
    time.sleep(0.3)
    assert spare.poll() is None  # the old key killed nothing
    assert evict(store, [3], wait_s=5) == {}  # answered: nobody is cut off
    watching.join(timeout=5)
    assert answered.is_set() and spare.wait(timeout=5) == -signal.SIGKILL


def test_an_eviction_asks_the_process_that_holds_the_rank_after_a_shrink_renumbered_it():
    """A shrink made the process that started as rank 1 rank 0: asking to evict rank 0
    must reach it, and not the supervisor that started a worker as rank 0 (in a soak, both
    nodes' supervisors killed their workers, and nobody was left to recover)."""
    store = signed_store()
    cfg = WarmConfig(enable=True)
    survivor = WarmPath(cfg, store, "round", 0, 1, 1, gen=1)  # was rank 1 in generation 0
    before = owner(4242, "node-of-old-rank-0")
    watch = EvictionWatch(store, [owner(), before])
    assert evict(store, [0], wait_s=0.2) == {}.fromkeys([0], [])  # nobody answered here
    assert watch.asked() == [owner()]
    assert rank_of(store, owner()) == survivor.rank == 0 and rank_of(store, before) is None
