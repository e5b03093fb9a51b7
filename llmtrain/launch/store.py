"""The rendezvous store as a process of its own (``llmtrain rdzv-store``), and the leases
that tell a store serving one job when that job is over.

A scheduler that runs the store as one more task of the job (the torchx component) needs
the store to end by itself, or the job never completes. The store cannot count its
clients (TCPStore does not say), and the run's own end is not enough: a job whose every
node failed its gate or its config never ends a run. So each ``llmtrain launch`` holds a
lease in the store: a counter it bumps every ``LEASE_BEAT_S`` while it lives, and a mark
when it exits. Once every lease taken is marked or has not moved for ``stale_s`` (its
node died with it), no launcher needs the store, and ``--exit-when-unused`` ends it.
"""

from __future__ import annotations

import datetime
import logging
import signal
import socket
import threading
import time

import torch.distributed as dist

from llmtrain.config import ConfigError
from llmtrain.recovery.presence import serve_presence

log = logging.getLogger(__name__)

LEASES = "llmtrain/leases"
LEASE_BEAT_S = 2.0


def store_server(host: str, port: int) -> dist.TCPStore:
    """A TCPStore server that listens on ``host`` only (port 0: any free one).

    TCPStore's server binds every interface whatever its host argument (torch 2.13 has no
    bind address); handed a socket already bound (``master_listen_fd``), it listens on
    that one instead, so the address is bound here and the socket passed on.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    return dist.TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                         multi_tenant=True, use_libuv=True, master_listen_fd=sock.detach(),
                         timeout=datetime.timedelta(seconds=300))


def serve_store(host: str, port: int, exit_when_unused: bool = False,
                stale_s: float = 30.0, first_within_s: float = 600.0,
                presence_port: int = 0) -> int:
    """A rendezvous store in its own process, so no training node is a single point of
    failure for the rendezvous (torchrun agents connect with ``is_host=0``), with the
    presence listener beside it on ``presence_port`` (0: any free port; see
    :mod:`llmtrain.recovery.presence`). It serves
    until SIGTERM/SIGINT, or with ``exit_when_unused`` until every launcher that took a
    lease has ended (:class:`Leases`), or none came within ``first_within_s`` (every node
    failed before it could take one): then it exits 1."""
    if exit_when_unused and stale_s < 2 * LEASE_BEAT_S:
        raise ConfigError(f"--lease-timeout-s {stale_s:g} is too short: launchers beat every "
                          f"{LEASE_BEAT_S:g} s, so a live one would count as ended; give at "
                          f"least {2 * LEASE_BEAT_S:g}")
    # Handlers, not sigtimedwait: in this process (TCPStore's threads running), a SIGCONT
    # after a SIGSTOP (a stalled store) made sigtimedwait return a garbled SIGINT.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    store = store_server(host, port)
    print(f"llmtrain rdzv-store: serving {host}:{store.port}", flush=True)
    here = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    client = dist.TCPStore(here, store.port, is_master=False, use_libuv=True)
    presence = serve_presence(host, presence_port, client)
    if presence is not None:
        print(f"llmtrain rdzv-store: presence on {presence.address[0]}:{presence.address[1]}",
              flush=True)
    leases = Leases(client, stale_s) if exit_when_unused else None
    started = time.monotonic()
    while not stop.wait(LEASE_BEAT_S):
        if leases is None:
            continue
        if leases.all_ended():
            print(f"llmtrain rdzv-store: all {leases.taken} launcher(s) ended; exiting",
                  flush=True)
            break
        if not leases.taken and time.monotonic() - started > first_within_s:
            log.error("llmtrain rdzv-store: no llmtrain launch came within %g s; exiting "
                      "(check the nodes' logs)", first_within_s)
            return 1
    if presence is not None:
        presence.close()
    del store
    return 0


class Lease(threading.Thread):
    """One launcher's lease on the store at ``endpoint`` (HOST:PORT): taken, beaten and
    ended on a thread of its own, with short timeouts, so that a store that is slow, not
    up yet or stalled never holds the launcher up (a lease it could not end goes stale
    instead). :meth:`release` waits for it to say the launcher ended: at most one
    request's timeout."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0):
        super().__init__(name="llmtrain-lease", daemon=True)
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.store: dist.Store | None = None
        self.key: str | None = None
        self.stop = threading.Event()
        self.start()

    def run(self) -> None:
        host, _, port = self.endpoint.rpartition(":")
        while True:
            ending = self.stop.is_set()
            try:
                if self.key is None:
                    self.store = dist.TCPStore(host, int(port), is_master=False, use_libuv=True,
                                               timeout=datetime.timedelta(seconds=self.timeout_s))
                    self.key = f"{LEASES}/{self.store.add(f'{LEASES}/taken', 1)}"
                self.store.add(f"{self.key}/{'ended' if ending else 'beats'}", 1)
            except (RuntimeError, ValueError):  # DistError is a RuntimeError
                pass  # not up yet, or stalled: the next beat tries again
            if ending:
                return
            self.stop.wait(LEASE_BEAT_S)

    def release(self) -> None:
        """Ends the lease. Waits out the request under way (each is bounded by
        ``timeout_s``): a launcher that exits while this thread is inside the store's
        C++ client can abort ("terminate called without an active exception")."""
        self.stop.set()
        self.join(timeout=2 * self.timeout_s + 1.0)  # a connect, then the last add


class Leases:
    """The leases taken on a store, as the store's own process reads them (two requests a
    lease at each look): whether every one has ended, by its mark or by ``stale_s``
    without a beat (measured on this process's clock, so hosts' clocks do not matter)."""

    def __init__(self, store: dist.Store, stale_s: float):
        self.store, self.stale_s = store, stale_s
        self.taken = 0
        self.moved: dict[int, tuple[int, float]] = {}  # lease -> (beats, when they changed)

    def all_ended(self) -> bool:
        self.taken = int(self.store.add(f"{LEASES}/taken", 0))
        now = time.monotonic()
        live = 0
        for i in range(1, self.taken + 1):
            if self.store.add(f"{LEASES}/{i}/ended", 0):
                continue
            beats = int(self.store.add(f"{LEASES}/{i}/beats", 0))
            last, since = self.moved.get(i, (-1, now))
            if beats != last:
                self.moved[i] = (beats, now)
            elif now - since >= self.stale_s:
                continue
            live += 1
        return self.taken > 0 and live == 0
