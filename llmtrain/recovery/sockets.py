"""This process's TCP connections, by their endpoints: each rank publishes the local ends
of its connections, so that when a rank stops answering and its agent cannot be reached
to kill it (its node is cut off from the network), its peers can shut their own ends of
every connection to it. A collective stuck on that rank then fails at once, as it does
when a killed rank's connections close, and the warm path replaces the rank. gloo in
torch 2.13 has no abort: this is the survivors' way out that keeps them alive.

:func:`connections` says, for a rank that is stuck, what the kernel holds of each of its
connections: whether a peer's close or reset ever arrived, and what data waits each way.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import termios
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


# the kernel's TCP states (include/net/tcp_states.h), as tcp_info's first byte gives them
_STATES = {1: "established", 2: "syn_sent", 3: "syn_recv", 4: "fin_wait1", 5: "fin_wait2",
           6: "time_wait", 7: "closed", 8: "close_wait", 9: "last_ack", 10: "listen",
           11: "closing"}


def connections(limit: int = 64) -> list[dict]:
    """This process's TCP connections (at most ``limit``), as the kernel holds them: each
    one's ends (``peer`` None once it was reset), its state, and the bytes queued each way
    (``unread``: received, not yet read by this process; ``unsent``: written, not yet
    acknowledged). ``close_wait`` with a live reader: the peer closed, and this process
    never looked; ``established`` to a peer known dead: its close never arrived."""
    found = []
    for s in _tcp_sockets():
        state = _STATES.get(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0], "?")
        if state == "listen":
            continue
        try:
            peer = _endpoint(s.getpeername())
        except OSError:  # reset, or never connected
            peer = None
        found.append({"local": _endpoint(s.getsockname()), "peer": peer, "state": state,
                      "unread": _queued(s, termios.FIONREAD),
                      "unsent": _queued(s, termios.TIOCOUTQ)})
        if len(found) == limit:
            break
    return found


def _queued(s: socket.socket, request: int) -> int:
    """SIOCINQ (FIONREAD) or SIOCOUTQ (TIOCOUTQ) of a TCP socket: bytes waiting."""
    return struct.unpack("i", fcntl.ioctl(s.fileno(), request, b"\0" * 4))[0]
