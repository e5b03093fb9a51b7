"""The presence listener: a rank's process whose connection drops without a word is marked
gone, at once; one that says bye is not; a connection that cannot prove the job's secret
counts for nothing; a rank's client finds the listener through the store and connects
again after the store's restart. Real sockets on loopback and a real TCPStore."""

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from llmtrain.distributed.signed_store import SECRET_ENV, job_secret
from llmtrain.recovery.presence import PresenceClient, PresenceListener, serve_presence

SECRET = "ab" * 32


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           use_libuv=True, timeout=timedelta(seconds=10))
    yield server


def client_of(store: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, use_libuv=True,
                         timeout=timedelta(seconds=5))


class Marks:
    def __init__(self):
        self.seen, self.event = [], threading.Event()

    def __call__(self, drops: list[tuple[str, str]]) -> None:
        self.seen += drops
        self.batches = getattr(self, "batches", []) + [drops]
        self.event.set()


def test_a_process_whose_connection_drops_is_marked_and_one_that_says_bye_is_not(store):
    marks = Marks()
    listener = PresenceListener("127.0.0.1", 0, bytes.fromhex(SECRET), marks)
    from llmtrain.recovery import presence
    presence._published(client_of(store)).set("port", str(listener.address[1]))
    leaving = PresenceClient("127.0.0.1", lambda: client_of(store), "job", "node2:1234",
                             bytes.fromhex(SECRET))
    dying = PresenceClient("127.0.0.1", lambda: client_of(store), "job", "node2:1235",
                           bytes.fromhex(SECRET))
    early = PresenceClient("127.0.0.1", lambda: client_of(store), "job", "node2:1233",
                           bytes.fromhex(SECRET))
    early.bye()  # ended before its connection was made: it says bye on it, and is not held
    assert leaving.held.wait(5) and dying.held.wait(5)
    leaving.bye()
    time.sleep(0.3)
    assert marks.seen == []  # said bye: an end on purpose
    dying._bye.set()  # (so that its thread does not connect again) and the socket closes
    began = time.monotonic()  # as a killed process's kernel closes it, without a bye
    dying.sock.shutdown(socket.SHUT_RDWR)
    assert marks.event.wait(5), "a dropped connection was not marked"
    assert marks.seen == [("job", "node2:1235")] and time.monotonic() - began < 1.0


def test_a_connection_without_the_secret_counts_for_nothing(store):
    marks = Marks()
    listener = PresenceListener("127.0.0.1", 0, bytes.fromhex(SECRET), marks)
    for hello in (b'{"rdzv_id": "job", "holder": "node1:1", "mac": "00"}\n', b"not json\n",
                  b'{"rdzv_id": "job"}\n'):
        sock = socket.create_connection(listener.address, timeout=5)
        assert len(sock.recv(64).strip()) == 32  # the nonce
        sock.sendall(hello)
        assert sock.recv(64) == b""  # closed by the listener
        sock.close()
    forged = PresenceClient("127.0.0.1", lambda: client_of(store), "job", "node1:1",
                            b"\x01" * 32)
    time.sleep(0.5)
    forged._bye.set()
    assert marks.seen == []


def test_a_client_holds_again_after_the_store_and_its_listener_restart(monkeypatch):
    """The store's process restarts, empty, and with it the listener: the client finds
    the new listener through the store, and a drop after that is marked by it."""
    monkeypatch.setenv(SECRET_ENV, SECRET)

    def serve():
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               use_libuv=True, timeout=timedelta(seconds=10))
        marks = Marks()
        listener = PresenceListener("127.0.0.1", 0, bytes.fromhex(SECRET), marks)
        from llmtrain.recovery import presence
        presence._published(client_of(server)).set("port", str(listener.address[1]))
        return server, listener, marks

    current = {}
    current["store"], listener, _ = serve()
    client = PresenceClient("127.0.0.1", lambda: client_of(current["store"]), "job", "node1:7",
                            bytes.fromhex(SECRET))
    assert client.held.wait(5)
    current["store"], _, marks = serve()  # the new process, before the old one goes
    listener.server.close()  # the old process's listener and connections go
    for conn in list(listener.peers):
        conn.close()
    deadline = time.monotonic() + 10
    while client.held.is_set():  # it saw the old one go...
        assert time.monotonic() < deadline, "the client never saw the listener go"
        time.sleep(0.05)
    assert client.held.wait(10), "the client never held the new listener"  # ...and came back
    client._bye.set()
    client.sock.shutdown(socket.SHUT_RDWR)
    assert marks.event.wait(5) and marks.seen == [("job", "node1:7")]


def test_the_store_publishes_its_listener_only_with_the_jobs_secret(store, monkeypatch):
    assert serve_presence("127.0.0.1", 0, client_of(store)) is not None
    monkeypatch.delenv(SECRET_ENV)
    assert serve_presence("127.0.0.1", 0, client_of(store)) is None


def test_a_waiting_spare_that_dies_leaves_the_pool_and_no_claim_picks_it(store):
    """A spare holds its presence from the start of its wait. Killed there (its standby
    node lost, its launcher killed), its place leaves the pool at once: the next claim
    takes the live spare after it, where one that picked the dead spare waited
    warm.budget_s for it and went cold (a chaos run's rank kill did)."""
    from llmtrain.recovery.pool import PoolPlace, claim, spares_waiting
    from llmtrain.recovery.warm import job_namespace
    assert serve_presence("127.0.0.1", 0, client_of(store)) is not None
    pool = job_namespace(client_of(store), "job")
    dead = PoolPlace(pool, 5, holder="node3:4242")
    live = PoolPlace(pool, 5, holder="node3:4243")
    spare = PresenceClient("127.0.0.1", lambda: client_of(store), "job", "node3:4242",
                           job_secret())
    assert spare.held.wait(5) and spares_waiting(pool) == 2
    spare._bye.set()  # (no new connection) and the socket closes, as at a kill
    spare.sock.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + 5
    while spares_waiting(pool) == 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spares_waiting(pool) == 1
    assert claim(pool, 1) == [live.number] != [dead.number]


def test_a_lost_nodes_waiting_spare_leaves_the_pool_before_its_rank_is_counted_gone(store):
    """A node dies with a rank of the job and a spare waiting (a standby node one of whose
    spares took a lost rank): both connections drop together. The survivors decide as
    soon as the rank is counted gone, and claimed the dead spare when its withdrawal, on
    a thread of its own, came later: the recovery waited warm.budget_s for it and went
    cold (a TP chaos run's node loss did). Marked together, the spare leaves first."""
    from llmtrain.recovery.pool import PoolPlace, claim
    from llmtrain.recovery.warm import job_namespace
    assert serve_presence("127.0.0.1", 0, client_of(store)) is not None
    job = job_namespace(client_of(store), "job")
    prefix = "round1/g1/"  # the generation rank 0 reports to, held by node4's process
    for key, value in (("where/0", prefix), (f"{prefix}owner/0", "node4:100"),
                       (f"{prefix}size", "4"), ("rank_of/node4:100", "0")):
        job.set(key, value)
    dead = PoolPlace(job, 5, holder="node4:101")
    live = PoolPlace(job, 5, holder="node3:102")
    clients = [PresenceClient("127.0.0.1", lambda: client_of(store), "job", holder,
                              job_secret()) for holder in ("node4:100", "node4:101")]
    assert all(c.held.wait(5) for c in clients)
    for c in clients:  # the node's kernel closes both as its processes die
        c._bye.set()
        c.sock.shutdown(socket.SHUT_RDWR)
    job.raw.wait([f"{prefix}seen/0"], timedelta(seconds=5))  # rank 0 counted gone...
    assert claim(job, 1) == [live.number] != [dead.number]  # ...and a decider claims
