"""Prepared workers: for each local rank, a process that has imported torch and llmtrain
(a compiled job's, torch.compile's stack too) and, on a GPU node, made its CUDA context on
its device and pinned the host memory a resume loads through, before its attempt begins,
so that a cold restart skips a worker's spawn and imports (1.6-3 s on a 2-core machine, 7
s on an H100 node for a compiled run). Under ``llmtrain launch`` each is forked from the
node's template process (:mod:`llmtrain.launch.template`), which imported all that once.

By default (``--no-prepared-workers`` turns it off), ``llmtrain launch`` keeps one per local rank
(:class:`PreparedWorkers`) and starts torchrun with :mod:`llmtrain.launch.handoff` as
every worker's command. When torchrun starts an attempt's worker, the hand-off passes the
attempt (command, environment, working folder, stdio) to its local rank's prepared worker
over a Unix socket in a folder only this user can open (the peer's uid is checked too),
as JSON: nothing is unpickled. The prepared worker takes it once, becomes that attempt's
worker (its environment, ``sys.argv``, the command run as ``python`` would run it), and
exits when the attempt's work ends. The launcher starts its successor at once; the
successor listens at once but prepares (imports, when it was not forked from a template
that did; its CUDA context) ``PreparedConfig.import_delay_s`` later (or as soon as a
hand-off comes), so that this does not compete with the new attempt's start.

A prepared worker never shares anything with an attempt before its own: it was started
after the previous one was taken, and until it is handed an attempt it holds no process
group, no RNG state that training reads (every rank seeds its generators at its start), no
store connection and no model. What it keeps from its wait is its imports and, on a GPU,
two pinned host blocks (new memory, which a load fills from the checkpoint before it reads
them) and a CUDA context that it checks with a small kernel before it accepts (a device
that failed since makes it refuse, and the hand-off starts a fresh process instead).

What the hand-off changes for the rest of llmtrain is in :mod:`llmtrain.process_origin`:
the rank's identity to its agent, its agent's pid, and its start-up timeline.

    python -m llmtrain.launch.prepared FOLDER LOCAL_RANK LISTENER_FD TAKEN_FD IMPORT_DELAY_S \
        COMPILED FP8
        (started by the launcher)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from llmtrain.launch.template import Process, Spawn, die_with_parent, preload, run_python
from llmtrain.process_origin import HANDED_OVER_ENV, PREPARED_DIR_ENV, waiting_file

log = logging.getLogger(__name__)

HANDOFF = str(Path(__file__).with_name("handoff.py"))
READY = b"ready\n"  # what a prepared worker tells its launcher once it is prepared


@dataclass
class PreparedConfig:
    local_ranks: int = 1
    # A prepared worker's successor starts as soon as it is taken and listens at once, but
    # waits this long before its imports, which would take CPU from the attempt that just
    # began, unless a hand-off comes first: then it imports at once, no later than a fresh
    # process would. A node's first prepared workers import at once.
    import_delay_s: float = 3.0
    # the job compiles (parallelism.compile): its workers import torch.compile's stack too
    compiled: bool = False
    fp8: bool = False  # the job trains in FP8: its workers import torchao's float8 too
    retry_s: float = 5.0  # after a prepared worker ended before it was taken
    # a hand-off whose process died leaves its worker running only this long
    orphan_look_s: float = 0.2


class PreparedWorkers:
    """A node launcher's prepared workers, one per local rank, each followed by a new one
    once it is taken. ``env`` is the workers' environment (the launcher's worker env)."""

    def __init__(self, cfg: PreparedConfig, folder: str, env: dict[str, str],
                 spawn: Spawn = subprocess.Popen) -> None:
        self.cfg, self.folder, self.spawn = cfg, folder, spawn
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)  # the hand-off's socket: this user's processes only
        self.env = {**env, PREPARED_DIR_ENV: folder}
        self._closed = threading.Event()
        # listening from now on: a hand-off that comes before its worker is up waits
        self._threads = [threading.Thread(target=self._keep, args=(lr, self._listen(lr)),
                                          daemon=True, name=f"prepared-{lr}")
                         for lr in range(cfg.local_ranks)]
        self._procs: dict[int, Process] = {}
        for t in self._threads:
            t.start()

    def _listen(self, local_rank: int) -> socket.socket:
        """The socket a local rank's hand-offs connect to, for its next prepared worker."""
        path = os.path.join(self.folder, f"{local_rank}.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a predecessor's that ended untaken
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        return listener

    def _keep(self, local_rank: int, listener: socket.socket) -> None:
        """One local rank's prepared worker, again and again: started, then once taken
        (or ended untaken) followed by the next."""
        delay = 0.0  # the first imports at once: no attempt of this node runs yet
        while not self._closed.is_set():
            read, write = os.pipe()
            proc = self.spawn(
                [sys.executable, "-m", "llmtrain.launch.prepared", self.folder,
                 str(local_rank), str(listener.fileno()), str(write), str(delay),
                 str(int(self.cfg.compiled)), str(int(self.cfg.fp8))],
                env=self.env, pass_fds=(listener.fileno(), write))
            os.close(write)
            listener.close()  # the worker's now
            self._procs[local_rank] = proc
            started = time.monotonic()
            with os.fdopen(read, "rb") as said:
                taken = said.readline()  # READY once prepared, then its hand-off's pid
                if taken == READY:
                    log.info("llmtrain launch: local rank %d's prepared worker %d is ready "
                             "(%.1f s after its start)", local_rank, proc.pid,
                             time.monotonic() - started)
                    taken = said.readline()  # b"" if it ended untaken
            if taken:
                threading.Thread(target=self._see_out, args=(proc, int(taken)), daemon=True,
                                 name=f"prepared-{local_rank}-taken").start()
            else:  # it ended untaken (or was ended, at close)
                waiting_file(self.folder, proc.pid).unlink(missing_ok=True)
                if not self._closed.is_set():
                    log.warning("prepared worker %d for local rank %d ended untaken (exit "
                                "%s); another starts in %.0f s", proc.pid, local_rank,
                                proc.wait(), self.cfg.retry_s)
                    self._closed.wait(self.cfg.retry_s)
            if not self._closed.is_set():
                listener = self._listen(local_rank)
            delay = self.cfg.import_delay_s

    def _see_out(self, proc: Process, holder: int) -> None:
        """A taken worker, to its end, which is reported to its hand-off process. Should
        that process die first (torchrun's SIGKILL, an eviction) while the worker lives on
        (stopped, or stuck holding the GIL), the worker is killed."""
        while proc.poll() is None:
            if not _alive(holder):
                proc.kill()
                break
            time.sleep(self.cfg.orphan_look_s)
        code = proc.wait()
        with contextlib.suppress(OSError):  # the folder went with its launcher's end
            _write(Path(self.folder) / f"{proc.pid}.exit", str(code))

    def close(self) -> None:
        """Ends the waiting prepared workers (one that was handed an attempt ends with its
        attempt, as torchrun's workers do)."""
        self._closed.set()
        for proc in list(self._procs.values()):
            if proc.poll() is None and not _taken(self.folder, proc.pid):
                proc.kill()
                proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


FOLDER_PREFIX = "llmtrain-prepared-"


def new_folder() -> str:
    """A launcher's folder for its hand-off sockets (``llmtrain-prepared-<its pid>-...`` in
    the temporary folder), after removing this user's folders of launchers that are gone:
    a launcher killed with its node's processes (SIGKILL) cannot remove its own."""
    root = tempfile.gettempdir()
    for entry in os.scandir(root):
        pid = entry.name.removeprefix(FOLDER_PREFIX).split("-", 1)[0]
        if not (entry.name.startswith(FOLDER_PREFIX) and pid.isdigit()):
            continue
        with contextlib.suppress(OSError):  # removed meanwhile, or not this user's
            if (entry.is_dir(follow_symlinks=False) and not _alive(int(pid))
                    and entry.stat(follow_symlinks=False).st_uid == os.getuid()):
                shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (its agent has not reaped it yet) is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _taken(folder: str, pid: int) -> bool:
    return any(p.read_text() == str(pid) for p in Path(folder).glob("*.worker"))


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


# --- the prepared worker's side -------------------------------------------------------

def serve(folder: str, local_rank: int, listener_fd: int, taken_fd: int,
          import_delay_s: float, compiled: bool, fp8: bool) -> None:
    """Imports, waits for its attempt on the socket its launcher made, then runs it;
    never returns."""
    path = os.path.join(folder, f"{local_rank}.sock")
    listener = socket.socket(fileno=listener_fd)  # a hand-off may wait in it already
    die_with_parent()
    select.select([listener], [], [], import_delay_s)  # a hand-off, or the delay's end
    ready = _prepare(local_rank, compiled, fp8)
    waiting = waiting_file(folder, os.getpid())
    if ready:
        # what its context holds on the GPU is this node's, not a stray process's
        # (llmtrain.reliability.health.gpu_checks.stray_processes)
        _write(waiting, str(local_rank))
        os.write(taken_fd, READY)
    while True:
        conn, _ = listener.accept()
        if _peer_uid(conn) == os.getuid():
            break
        conn.close()  # not this user's: never read
    waiting.unlink(missing_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # nobody else connects to a taken worker
    listener.close()
    attempt, fds = _receive(conn)
    if not ready:
        conn.sendall(json.dumps({"refused": "its device failed its check"}).encode() + b"\n")
        os._exit(0)
    holder = int(attempt["env"]["LLMTRAIN_HOLDER_PID"])
    os.write(taken_fd, f"{holder}\n".encode())
    os.close(taken_fd)
    # before the attempt can run: the agent's kill finds this process through the file
    _write(Path(folder) / f"{holder}.worker", str(os.getpid()))
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    die_with_parent(False)
    _become(attempt, fds)
    threading.Thread(target=_die_with_handoff, args=(conn,), daemon=True).start()
    code = run_python(attempt["argv"])
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
    os._exit(code)


def _prepare(local_rank: int, compiled: bool, fp8: bool) -> bool:
    """The imports an attempt would pay (``compiled``: torch.compile's too), a first model
    build's one-time costs (on meta, of the default shape: whatever the job's, the next
    build takes milliseconds), and on a GPU node the device's context and a resume's
    pinned host memory. False
    where the device fails a small kernel (the attempt then starts afresh, and finds the
    fault itself)."""
    preload(compiled, fp8)  # nothing left to import in a worker forked from the template
    import torch

    from llmtrain.checkpoint.in_place import reserve_slots
    if not torch.cuda.is_available():
        return True
    try:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        reserve_slots()  # a resume's pinned host memory (llmtrain.checkpoint.in_place)
        return True
    except RuntimeError as e:  # never run on a failed device: see docs/gpu.md
        log.warning("prepared worker: the device failed its check (%s)", e)
        return False


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise SystemExit("prepared worker: the hand-off ended before its attempt")
        data += chunk
    return json.loads(data), fds


def _become(attempt: dict, fds: list[int]) -> None:
    """Takes the attempt's stdio, environment and folder, as torchrun's child has them."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout.reconfigure(write_through=True)  # as ``python -u``
    sys.stderr.reconfigure(write_through=True)
    os.environ.clear()
    os.environ.update(attempt["env"])
    os.environ[HANDED_OVER_ENV] = repr(time.time())
    os.chdir(attempt["cwd"])
    threads = os.environ.get("OMP_NUM_THREADS")  # torchrun's, read at torch's import
    if threads:
        import torch
        torch.set_num_threads(int(threads))


def _die_with_handoff(conn: socket.socket) -> None:
    """The hand-off process ended (torchrun killed it): so does this worker."""
    while True:
        try:
            if not conn.recv(1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    os.kill(os.getpid(), signal.SIGKILL)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[2]


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]),
          sys.argv[6] == "1", sys.argv[7] == "1")
