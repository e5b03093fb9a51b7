"""This process's TCP connections, by their endpoints: each rank publishes the local ends
of its connections, so that when a rank stops answering and its agent cannot be reached
to kill it (its node is cut off from the network), its peers can shut their own ends of
every connection to it. A collective stuck on that rank then fails at once, as it does
when a killed rank's connections close, and the warm path replaces the rank. gloo in
torch 2.13 has no abort: this is the survivors' way out that keeps them alive.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator


def _tcp_sockets() -> Iterator[socket.socket]:
    """A duplicate of each of this process's TCP sockets (closed after use; shutting one
    down acts on the connection, which the original descriptor shares)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))  # family and type from the socket
        except OSError:  # closed meanwhile
            continue
        with s:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                yield s


def _endpoint(address: tuple) -> str:
    host = address[0].removeprefix("::ffff:")  # an IPv4 peer of a dual-stack socket
    return f"{host}:{address[1]}"


def endpoints() -> list[str]:
    """The local ends (``ip:port``) of this process's connected TCP sockets."""
    ends = set()
    for s in _tcp_sockets():
        try:
            s.getpeername()
            ends.add(_endpoint(s.getsockname()))
        except OSError:  # listening, or not connected
            continue
    return sorted(ends)


def cut(peers: set[str]) -> int:
    """Shuts down every connection of this process whose far end is one of ``peers``;
    returns how many."""
    done = 0
    for s in _tcp_sockets():
        try:
            if _endpoint(s.getpeername()) in peers:
                s.shutdown(socket.SHUT_RDWR)
                done += 1
        except OSError:
            continue
    return done
