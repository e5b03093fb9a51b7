"""A loopback NFS mount for tests and benchmarks: nfs-ganesha (the user-space NFS server,
VFS backend) exports a fresh directory on 127.0.0.1, and ``llmtrain.chaos.nfsfuse``
mounts it through FUSE, so what is written under ``.mount`` travels over NFSv4 and lands
in ``.root``. Everything it starts, it stops: the mount, the client, the server.

Needs /dev/fuse and fusermount3 (apt fuse3), ganesha.nfsd (apt nfs-ganesha
nfs-ganesha-vfs) and nfs4fs + mfusepy (pip, the ``dev`` extra); :func:`nfs_problem` says
what is missing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from llmtrain.chaos.mount import MOUNT_TIMEOUT, fuse_problem, unmount, wait_mounted
from llmtrain.chaos.processes import stop
from llmtrain.distributed.process_group import free_port

PSEUDO = "/export"
# NFSv4 only, TCP, loopback only: no rpcbind, no NLM/RQUOTA/MOUNT listeners. Graceless:
# no 90 s grace period before the first OPEN. Recovery state under the mount's own
# directory, so concurrent servers never share it.
GANESHA_CONF = """\
NFS_CORE_PARAM {{ Protocols = 4; NFS_Port = {port}; Bind_addr = 127.0.0.1;
                 Enable_NLM = false; Enable_RQUOTA = false; Enable_UDP = false; }}
NFSV4 {{ Graceless = true; RecoveryBackend = fs; RecoveryRoot = "{recovery}"; }}
NFS_KRB5 {{ Active_krb5 = false; }}
EXPORT {{
  Export_Id = 1; Path = "{root}"; Pseudo = {pseudo};
  Access_Type = RW; Squash = No_Root_Squash; Protocols = 4; Transports = TCP; SecType = sys;
  FSAL {{ Name = VFS; }}
}}
LOG {{ Default_Log_Level = EVENT; }}
"""


def nfs_problem() -> str | None:
    """Why this machine cannot run an :class:`NfsMount` (None: it can)."""
    problem = fuse_problem()
    if problem:
        return problem
    if shutil.which("ganesha.nfsd") is None:
        return "ganesha.nfsd not found: apt-get install nfs-ganesha nfs-ganesha-vfs (see .ci/run)"
    try:
        import mfusepy  # noqa: F401  (loads libfuse3)
        import nfs4fs  # noqa: F401
    except (ImportError, OSError) as e:
        return f"the FUSE NFS client cannot load ({e}): pip install -e '.[dev]'"
    return None


class NfsMount:
    """An NFS export of ``.root`` served on loopback, mounted on ``.mount``."""

    def __init__(self, base: Path):
        self.base = base
        self.root = base / "export"     # the server's directory: look behind NFS's back here
        self.mount = base / "mnt"       # the NFS client's mount: do I/O here
        self.server_log = base / "ganesha.log"
        self.client_log = base / "nfsfuse.log"
        self.server: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None
        self.port: int | None = None

    def start(self) -> "NfsMount":
        try:
            self._serve()
            self._mount()
        except BaseException:
            self.stop()
            raise
        return self

    def _serve(self) -> None:
        for d in (self.root, self.mount, self.base / "recovery"):
            d.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        conf = self.base / "ganesha.conf"
        conf.write_text(GANESHA_CONF.format(port=self.port, root=self.root, pseudo=PSEUDO,
                                            recovery=self.base / "recovery"))
        # -F: stay in the foreground, so this is the server's process and stop() ends it
        self.server = subprocess.Popen(
            ["ganesha.nfsd", "-F", "-f", str(conf), "-L", str(self.server_log),
             "-p", str(self.base / "ganesha.pid"), "-N", "NIV_EVENT"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                pass
            if self.server.poll() is not None or time.monotonic() > deadline:
                log = self.server_log.read_text() if self.server_log.exists() else ""
                state = (f"exited with {self.server.returncode}" if self.server.poll()
                         is not None else f"not listening after {MOUNT_TIMEOUT}s")
                raise RuntimeError(f"ganesha.nfsd {state} (port {self.port}):\n{log[-3000:]}")
            time.sleep(0.05)

    def _mount(self) -> None:
        with open(self.client_log, "ab") as log:
            self.client = subprocess.Popen(
                [sys.executable, "-m", "llmtrain.chaos.nfsfuse", f"127.0.0.1:{self.port}",
                 PSEUDO, str(self.mount), "--foreground"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        wait_mounted(self.mount, self.client, self.client_log)

    def stop(self) -> None:
        """Unmounts (lazily if busy), then stops the client and the server."""
        if self.client is not None:
            unmount(self.mount, self.client)
            self.client = None
        stop(self.server)
        self.server = None

    def __enter__(self) -> "NfsMount":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
