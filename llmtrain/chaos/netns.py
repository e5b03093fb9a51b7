"""Nodes with a network of their own: one Linux network namespace per node, on a private
bridge, so that a node can be cut off (a partition) or given a bad link while its
processes live on.

The bridge lives in a hub namespace of its own, with the rendezvous store beside it: the
machine's own namespace and its real interfaces are never touched, and nothing here can
send a packet off the machine. Node ``name`` gets ``<subnet>.<i>`` on its ``eth0`` (a veth
whose other end is on the bridge), its own hostname, and an ``/etc/hosts`` naming every
node, so that torchrun and gloo find each node's address the way they do on a cluster.

``cut`` takes a node's link down (its packets go nowhere, its connections stay open, as
when a switch port or cable fails); ``heal`` brings it back. ``degrade`` shapes the node's
outgoing traffic to a rate with a short queue (``tc tbf``): what does not fit is dropped
and TCP resends it, a lossy and slow link. (``netem``, the usual tool, needs a kernel
module machines like this one lack; ``tbf`` is built in everywhere.)

Needs root and ``ip`` (iproute2); :func:`available` says whether this machine allows it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path


_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000
HUB_MAC = "02:00:00:00:00:fe"  # the bridge's own, fixed (locally administered)


@dataclass
class NetnsConfig:
    subnet: str = "10.77.0"  # a /24 of private addresses: node i is .i, the hub .254
    tag: str = ""            # namespace names' prefix (default: new for each Network)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, util-linux)"
    probe = f"lt-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"ip netns add failed: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class Network:
    """The hub and the nodes' namespaces; ``close`` removes them all."""

    def __init__(self, workdir: Path, cfg: NetnsConfig | None = None):
        self.cfg = cfg or NetnsConfig()
        self.tag = self.cfg.tag or f"lt{uuid.uuid4().hex[:5]}"
        self.dir = workdir / "netns"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hub = f"{self.tag}-hub"
        self.hub_address = f"{self.cfg.subnet}.254"
        self.nodes: dict[str, int] = {}
        _ip("netns", "add", self.hub)
        try:
            self._bridge()
        except BaseException:  # no namespace left behind
            self.close()
            raise

    def _bridge(self) -> None:
        _ip("-n", self.hub, "link", "set", "lo", "up")
        # A bridge takes the lowest address of its ports unless given one: each node
        # joining with a lower one moved the hub's address, and the other nodes, whose ARP
        # caches kept the old one, lost the store for up to a minute (a rank's heartbeats
        # stopped: a chaos run evicted a healthy rank before its first fault).
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "address", HUB_MAC)
        _ip("-n", self.hub, "addr", "add", f"{self.hub_address}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")

    def add(self, name: str) -> str:
        """Node ``name``'s namespace (made once, kept across its restarts); its address."""
        if name not in self.nodes:
            i = len(self.nodes) + 1
            ns = self._ns(name)
            _ip("netns", "add", ns)
            self.nodes[name] = i  # made: ``close`` removes it, whatever follows
            _ip("-n", ns, "link", "set", "lo", "up")
            # both ends are made inside namespaces: the machine's own never sees them
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}",
                "netns", self.hub)
            _ip("-n", ns, "addr", "add", f"{self.cfg.subnet}.{i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", self.hub, "link", "set", f"v{i}", "up")
        self._write_hosts()
        return self.address(name)

    def address(self, name: str) -> str:
        return f"{self.cfg.subnet}.{self.nodes[name]}"

    def _ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def _write_hosts(self) -> None:
        common = "".join(f"{self.address(n)} {n}\n" for n in self.nodes)
        (self.dir / "hosts").write_text(f"127.0.0.1 localhost\n{self.hub_address} "
                                        f"{self.hub}\n{common}")

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run as node ``name``: in its namespace, with its hostname, and the
        nodes' ``/etc/hosts`` (bound in a mount namespace of its own)."""
        return ["ip", "netns", "exec", self._ns(name), "unshare", "--uts", "--mount",
                "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"',
                str(self.dir / "hosts"), name, *argv]

    def in_hub(self, argv: list[str]) -> list[str]:
        """``argv`` run beside the bridge, where every node reaches it."""
        return ["ip", "netns", "exec", self.hub, *argv]

    def from_hub(self, connect):
        """``connect()``, called on a thread that has entered the hub's namespace: a
        socket it opens (a store client of the harness) stays there, usable from any
        thread, while this process stays in its own namespace."""
        out: dict = {}

        def run() -> None:
            try:
                fd = os.open(f"/run/netns/{self.hub}", os.O_RDONLY)
                try:
                    if _libc.setns(fd, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns into the hub namespace")
                finally:
                    os.close(fd)
                out["value"] = connect()
            except BaseException as e:  # raised again in the caller
                out["error"] = e
        thread = threading.Thread(target=run, name="hub-connect")
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def cut(self, name: str) -> None:
        """Node ``name``'s link goes down: a partition, its processes untouched."""
        _ip("-n", self.hub, "link", "set", f"v{self.nodes[name]}", "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.hub, "link", "set", f"v{self.nodes[name]}", "up")
        self.restore(name)

    def degrade(self, name: str, rate: str = "2mbit") -> None:
        """Node ``name`` sends at most ``rate``, queueing little: a lossy, slow link."""
        subprocess.run(["ip", "netns", "exec", self._ns(name), "tc", "qdisc", "replace",
                        "dev", "eth0", "root", "tbf", "rate", rate, "burst", "8kb",
                        "latency", "1ms"], check=True, capture_output=True)

    def pace(self, name: str, rate: str = "400mbit") -> None:
        """Node ``name`` sends at most ``rate``, with a queue deep enough not to drop: a
        healthy link of that speed. (Unpaced, a veth pair runs at memory speed, and on a
        busy 2-core machine dropped 0-2.3% of a 4 MB transfer's segments.)"""
        subprocess.run(["ip", "netns", "exec", self._ns(name), "tc", "qdisc", "replace",
                        "dev", "eth0", "root", "tbf", "rate", rate, "burst", "64kb",
                        "latency", "100ms"], check=True, capture_output=True)

    def restore(self, name: str) -> None:
        """Node ``name``'s link as it was made: no shaping."""
        subprocess.run(["ip", "netns", "exec", self._ns(name), "tc", "qdisc", "del", "dev",
                        "eth0", "root"], capture_output=True)

    def close(self) -> None:
        """Removes every namespace this network made (the nodes' and the hub's)."""
        for name in self.nodes:
            subprocess.run(["ip", "netns", "del", self._ns(name)], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.hub], capture_output=True)
