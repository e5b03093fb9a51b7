"""Presence: a rank whose process dies is known at once, its whole node's too.

Every rank on the warm path holds one TCP connection, for its process's life, to the
presence listener that ``llmtrain rdzv-store`` runs beside the store. When a process dies,
whatever killed it (a kill, a crash, the OOM killer, its whole node's processes taken
down), its kernel closes the connection, and the listener marks it gone in the warm path's
roll call, as a live agent marks its dead worker (:func:`llmtrain.recovery.roll_call.
mark_holder_gone`). The survivors' agreement then has every rank accounted for at once,
rather than waiting out a lost node's silence for ``warm.settle_s`` (nobody was left on
that node to say its ranks are gone). A process that ends on purpose says ``bye`` first
and is not marked; one that stays (a shrink, a grow) keeps its connection. A warm spare
holds its connection from the start of its wait: one that dies waiting leaves the spare
pool at once (:func:`llmtrain.recovery.pool.withdraw`), where a claim that picked it
waited ``warm.budget_s`` for it, then went cold.

Each node's torchrun agent holds one too, named for its rendezvous node: when a node dies
whole, the cold path's rendezvous drops it at once (:class:`GoneNodes`), where torch's
waited out its keep-alive (6 s with llmtrain's settings), and a standby sees the round
short of it as soon; a cold generation's ranks whose group is still forming stop waiting
for its ranks (:class:`RoundWatch`).

What it cannot see: a node whose kernel dies (power, a panic) closes nothing, and its
ranks' silence is waited out as before. Nor does the listener outlive its store: after a
store restart each rank connects to the new one (:class:`PresenceClient` retries).

Nobody without the job's secret can have a process counted gone: the listener sends a
nonce, and a connection counts only once it answers with the HMAC of the nonce, the job's
rendezvous id and the process (``host:pid``) under the job's secret. The listener's port
is published in the store, signed with the same secret; it listens on the store's own
address, so a rank reaches it at the host it reaches the store at.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from llmtrain.distributed.signed_store import SignedStore, job_secret, signed

log = logging.getLogger(__name__)

# where the store's process publishes the listener's port (signed)
ADDRESS_AT = "llmtrain/presence"
RETRY_S = 1.0


def _mac(secret: bytes, nonce: str, rdzv_id: str, holder: str) -> str:
    message = "\0".join(("llmtrain-presence", nonce, rdzv_id, holder)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _keep_alive(sock: socket.socket) -> None:
    """TCP keep-alive probes on an idle connection (after 30 s, every 10 s), so that no
    firewall or NAT between a rank and the listener times it out while both live."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _published(store: dist.Store) -> SignedStore:
    return signed(dist.PrefixStore(ADDRESS_AT, store), ADDRESS_AT)


@dataclass
class _Peer:
    nonce: str
    buffer: bytes = b""
    job: tuple[str, str] | None = None  # (rdzv_id, holder), once it proved the secret
    bye: bool = False


Drop = tuple[str, str]  # a connection that closed without a bye: (rdzv_id, holder)


class PresenceListener:
    """The store process's listener: one thread, one selector over every rank's
    connection; ``mark(drops)`` runs, on a thread of its own, for the connections that
    dropped without saying ``bye`` together: those that drop within ``GATHER_S`` of the
    first, as a node's processes do when it dies, so that its waiting spares are taken
    out of the pool before its ranks are counted gone (a survivor deciding at once on
    the ranks' marks claimed a dead spare, and waited ``warm.budget_s`` for it)."""

    GATHER_S = 0.02

    def __init__(self, bind: str, port: int, secret: bytes,
                 mark: Callable[[list[Drop]], None]):
        self.secret, self.mark = secret, mark
        self.server = socket.create_server((bind, port))
        self.server.setblocking(False)
        self.address = self.server.getsockname()[:2]
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ)
        self.peers: dict[socket.socket, _Peer] = {}
        self._drops: list[Drop] = []
        self._marking: list[threading.Thread] = []
        threading.Thread(target=self._serve, name="llmtrain-presence", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._handle(self.selector.select(timeout=1.0))
            if self._drops:  # and those that follow within GATHER_S
                deadline = time.monotonic() + self.GATHER_S
                while (left := deadline - time.monotonic()) > 0:
                    self._handle(self.selector.select(timeout=left))
                self._start_marking(self._drops)
                self._drops = []

    def _handle(self, ready: list) -> None:
        for key, _ in ready:
            try:
                if key.fileobj is self.server:
                    self._accept()
                else:
                    self._read(key.fileobj)
            except Exception:  # noqa: BLE001 - one connection must not end the listener
                log.exception("llmtrain presence: a connection's event failed")

    def _accept(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        nonce = secrets.token_hex(16)
        try:
            conn.sendall(nonce.encode() + b"\n")
        except OSError:
            conn.close()
            return
        conn.setblocking(False)
        _keep_alive(conn)
        self.peers[conn] = _Peer(nonce)
        self.selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        peer = self.peers[conn]
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._dropped(conn, peer)
            return
        peer.buffer += data
        while b"\n" in peer.buffer and conn in self.peers:
            line, peer.buffer = peer.buffer.split(b"\n", 1)
            self._line(conn, peer, line)
        if len(peer.buffer) > 4096:  # no line of ours is this long
            self._drop(conn)

    def _line(self, conn: socket.socket, peer: _Peer, line: bytes) -> None:
        if peer.job is None:
            try:
                hello = json.loads(line)
                rdzv_id, holder, mac = str(hello["rdzv_id"]), str(hello["holder"]), hello["mac"]
            except (ValueError, KeyError, TypeError):
                mac = None
            if not isinstance(mac, str) or not hmac.compare_digest(
                    mac, _mac(self.secret, peer.nonce, rdzv_id, holder)):
                log.warning("llmtrain presence: a connection did not prove the job's secret; "
                            "closed (it counts for nothing)")
                self._drop(conn)
                return
            peer.job = (rdzv_id, holder)
        elif line == b"bye":
            peer.bye = True

    def _drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        del self.peers[conn]
        conn.close()

    def _dropped(self, conn: socket.socket, peer: _Peer) -> None:
        self._drop(conn)
        if peer.job is None or peer.bye:
            return
        rdzv_id, holder = peer.job
        log.info("llmtrain presence: %s of job %s is gone (its connection closed)",
                 holder, rdzv_id)
        self._drops.append((rdzv_id, holder))

    def _start_marking(self, drops: list[Drop]) -> None:
        marking = threading.Thread(target=self._mark, args=(list(drops),),
                                   name="llmtrain-presence-mark", daemon=True)
        marking.start()
        self._marking = [t for t in self._marking if t.is_alive()] + [marking]

    def close(self, timeout_s: float = 5.0) -> None:
        """Lets the marks under way finish (before the store's process ends: a thread left
        inside a store request as it exits aborts it)."""
        deadline = time.monotonic() + timeout_s
        for t in list(self._marking):
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _mark(self, drops: list[Drop]) -> None:
        try:
            self.mark(drops)
        except Exception as e:  # noqa: BLE001 - the warm path's settle wait still holds
            log.warning("llmtrain presence: could not mark %s gone: %s: %s",
                        [holder for _, holder in drops], type(e).__name__, e)


def serve_presence(bind: str, port: int, store: dist.Store) -> PresenceListener | None:
    """The listener beside the store served at ``store`` (a client of it), its address
    published there; None without the job's secret (then a lost node's ranks are waited
    out for ``warm.settle_s``, as before)."""
    secret = job_secret()
    if secret is None:
        log.info("llmtrain presence: off (no %s): a lost node is known after warm.settle_s",
                 "LLMTRAIN_JOB_SECRET")
        return None
    from llmtrain.distributed.rendezvous_wake import announce_change
    from llmtrain.recovery.pool import withdraw
    from llmtrain.recovery.roll_call import mark_holder_gone
    from llmtrain.recovery.warm import job_namespace

    def mark(drops: list[Drop]) -> None:
        processes = [(job_namespace(store, rdzv_id), holder) for rdzv_id, holder in drops
                     if not holder.startswith(RDZV_NODE)]
        for job, holder in processes:  # waiting spares first: out of the pool before a
            withdraw(job, holder)      # survivor, told of the ranks, claims one
        for job, holder in processes:
            mark_holder_gone(job, holder)  # a rank's process
        for rdzv_id, holder in drops:
            if holder.startswith(RDZV_NODE):  # a node's torchrun agent
                node_gone(job_namespace(store, rdzv_id), holder.removeprefix(RDZV_NODE))
                announce_change(store, rdzv_id)  # its rendezvous reads the news at once

    listener = PresenceListener(bind, port, secret, mark)
    _published(store).set("port", str(listener.address[1]))
    return listener


class PresenceClient:
    """A rank's connection to the presence listener, held by a thread of its own for the
    process's life; connects again (every ``RETRY_S``) after the listener's store
    restarted. ``bye`` before an exit on purpose."""

    def __init__(self, host: str, connect: Callable[[], dist.Store], rdzv_id: str,
                 holder: str, secret: bytes):
        """``host``: the store's, as this rank reaches it; ``connect``: a new client of
        the store, where the listener's port is published."""
        self.host, self.connect = host, connect
        self.rdzv_id, self.holder, self.secret = rdzv_id, holder, secret
        self.sock: socket.socket | None = None
        self.held = threading.Event()  # set while a connection counts
        self._bye = threading.Event()
        self._lock = threading.Lock()  # bye against a connection being made
        threading.Thread(target=self._hold, name="llmtrain-presence", daemon=True).start()

    def _hold(self) -> None:
        said_down = False
        while not self._bye.is_set():
            try:
                sock = self._open()
                with self._lock:
                    if self._bye.is_set():  # the process ended while this connected
                        _say_bye(sock)
                        return
                    self.sock = sock
                said_down = False
                self.held.set()
                while sock.recv(64):  # the listener sends nothing after the nonce
                    pass
            except (OSError, RuntimeError, ValueError) as e:  # DistError: a RuntimeError
                if not said_down and not self._bye.is_set():
                    log.info("llmtrain presence: not held (%s: %s); trying again every "
                             "%g s", type(e).__name__, e, RETRY_S)
                    said_down = True
            self.held.clear()
            if not self._bye.is_set():
                time.sleep(RETRY_S)

    def _open(self) -> socket.socket:
        port = _published(self.connect()).genuine("port")
        if port is None:
            raise ValueError("no presence listener published in the store")
        sock = socket.create_connection((self.host, int(port)), timeout=5.0)
        nonce = b""
        while not nonce.endswith(b"\n"):
            chunk = sock.recv(64)
            if not chunk:
                raise ConnectionError("the presence listener closed before its nonce")
            nonce += chunk
        hello = {"rdzv_id": self.rdzv_id, "holder": self.holder,
                 "mac": _mac(self.secret, nonce.decode().strip(), self.rdzv_id, self.holder)}
        sock.sendall(json.dumps(hello).encode() + b"\n")
        sock.settimeout(None)
        _keep_alive(sock)
        return sock

    def bye(self) -> None:
        """This process ends on purpose: it is not to be counted gone."""
        with self._lock:
            self._bye.set()
            sock, self.sock = self.sock, None
        if sock is not None:
            _say_bye(sock)


def _say_bye(sock: socket.socket) -> None:
    try:
        sock.sendall(b"bye\n")
        sock.shutdown(socket.SHUT_RDWR)  # wakes the holding thread's recv
    except OSError:
        pass
    sock.close()


# A holder that is a node's torchrun agent, by its rendezvous node (torch's ``host_pid_n``):
# when its connection closes, the cold rendezvous drops the node at once
# (:mod:`llmtrain.distributed.rendezvous_wake`) instead of after its keep-alive expired.
RDZV_NODE = "rdzv-node/"
GONE_COUNT = "rdzv_gone/count"


# the nodes of the rendezvous round a worker was started for (torch's ``host_pid_n``, comma
# separated), set by llmtrain's torchrun agent (:mod:`llmtrain.launch.agent`)
ROUND_NODES_ENV = "LLMTRAIN_ROUND_NODES"


def round_nodes(env: Mapping[str, str] = os.environ) -> set[str]:
    """The nodes of the rendezvous round this worker was started for; none outside
    llmtrain's agent."""
    return {n for n in env.get(ROUND_NODES_ENV, "").split(",") if n}


class RoundWatch:
    """While a cold generation's process group forms, watches the ``nodes`` of the round
    that started this rank (:func:`round_nodes`). A node that dies after its round closed
    and before its ranks joined the group never sends them, and the others waited out the
    creation's timeout (``reliability.init_timeout_s``, 300 s). Once one of them is
    recorded dead (:func:`node_gone`), ``on_gone(nodes)`` is called, once, on the
    watching thread: its caller cannot be woken from torch's wait, so it ends the process
    for the next round. One rank a node watches (its agent restarts every worker of the
    node when one ends), one store read every ``every_s``. Call :meth:`stop` once the
    group has formed."""

    def __init__(self, nodes: set[str], connect: Callable[[], SignedStore | None],
                 on_gone: Callable[[set[str]], None], every_s: float = 0.5):
        """``connect``: the job's namespace in the rendezvous store (a connection of the
        watch's own, made on its thread), or None without one."""
        self.nodes = nodes
        self._connect, self._on_gone, self._every_s = connect, on_gone, every_s
        self._stopped = threading.Event()
        if nodes:
            threading.Thread(target=self._watch, name="llmtrain-round-watch",
                             daemon=True).start()

    def _watch(self) -> None:
        gone_nodes = None
        while not self._stopped.wait(self._every_s):
            try:
                if gone_nodes is None:
                    job = self._connect()
                    if job is None:
                        return
                    gone_nodes = GoneNodes(job)
                gone = gone_nodes() & self.nodes
            except (RuntimeError, OSError, ValueError):  # the store out: look again
                continue
            if gone and not self._stopped.is_set():
                self._on_gone(gone)
                return

    def stop(self) -> None:
        self._stopped.set()


def node_gone(job: SignedStore, node: str) -> None:
    """Records rendezvous ``node`` as dead, signed, for :class:`GoneNodes`."""
    n = job.add(GONE_COUNT, 1)
    job.set(f"rdzv_gone/{n}", node)


class GoneNodes:
    """The rendezvous nodes recorded dead (:func:`node_gone`), read as they come; a value
    that is not the job's (unsigned, forged) is not counted."""

    def __init__(self, job: SignedStore):
        self.job, self.seen, self.nodes = job, 0, set()

    def __call__(self) -> set[str]:
        count = self.job.add(GONE_COUNT, 0)
        while self.seen < count:
            node = self.job.genuine(f"rdzv_gone/{self.seen + 1}")
            if node is None:  # counted but not yet written (or forged): next read
                break
            self.nodes.add(node.decode())
            self.seen += 1
        return self.nodes


_client: PresenceClient | None = None


def hold_presence(holder: str, timeout: timedelta) -> PresenceClient | None:
    """This process's connection to the presence listener (opened once, kept across
    generations), under ``llmtrain launch`` with an external store and the job's secret;
    None otherwise."""
    global _client
    endpoint, secret = os.environ.get("LLMTRAIN_RDZV_ENDPOINT"), job_secret()
    if _client is None and endpoint and secret is not None:
        from llmtrain.distributed.process_group import rendezvous_store
        _client = PresenceClient(endpoint.rpartition(":")[0],
                                 lambda: rendezvous_store(timeout),
                                 os.environ.get("LLMTRAIN_RDZV_ID", "job"), holder, secret)
    return _client


def say_bye() -> None:
    """This process ends on purpose (a clean end of its session)."""
    if _client is not None:
        _client.bye()
