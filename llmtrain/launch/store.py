"""The rendezvous store as a process of its own (``llmtrain rdzv-store``)."""

from __future__ import annotations

import datetime
import signal
import socket

import torch.distributed as dist


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


def serve_store(host: str, port: int) -> None:
    """A rendezvous store in its own process, so no training node is a single point of
    failure for the rendezvous (torchrun agents connect with ``is_host=0``)."""
    store = store_server(host, port)
    print(f"llmtrain rdzv-store: serving {host}:{store.port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del store
