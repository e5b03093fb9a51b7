"""A node's template process: it imports torch and llmtrain once, starts no thread, and
forks the node's Python processes on its launcher's request (torchrun's agent, the
prepared workers, the warm spares), so that none of them pays the imports (1.5-3 s of CPU
each on a 2-core machine; a node of 8 ranks imported 8 times at each start).

``llmtrain launch`` starts it first (:class:`Template`); its imports overlap the preflight
and the health gate. Each request (:meth:`Template.spawn`) carries what ``python ARGV``
would be started with: the command (``-m MODULE ARGS`` or ``SCRIPT ARGS``), the
environment, the working folder, the descriptors it inherits (by number, as
``subprocess.Popen``'s ``pass_fds``; a stdin pipe as 0) and whether it runs in a session
of its own. It comes as one JSON message on a Unix socket pair only the two processes hold
(nothing is unpickled). The template forks; the child takes those, draws new random
seeds, takes its command line as its title (what ``ps`` and ``pgrep -f`` show; its
``/proc/PID/environ`` stays the template's, which is the launcher's), and runs the command
in this interpreter as ``python`` would run it. The signals a scheduler sends every
process stay blocked in the template, and in a child until it is ready: one sent to a
child that early waits for it. The template answers each request with its child's pid
(a late answer, to a request that gave up, has its child killed), reaps its children and
reports each one's exit code, which :class:`Forked` gives as ``subprocess.Popen`` does.

What a child shares with the template is what its imports made, and nothing of another
child: the template never runs a step, opens a process group, connects to a store, seeds
a generator that training reads or touches CUDA (``torch.cuda.is_available()`` asks NVML
here: a CUDA driver initialized before a fork is unusable in the child; a template whose
imports did that anyway, where NVML could not answer, refuses to serve), so a child on a GPU
node makes its own context after the fork. That path has not run on a GPU yet.

Where the template cannot serve (a command that is not Python's, a template that died or
did not get ready in time), :meth:`Template.spawn` starts a fresh process, as before.

    python -m llmtrain.launch.template SOCKET_FD COMPILED FP8 TITLE_ROOM
        (started by the launcher)
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MESSAGE_MAX = 1 << 20  # a request: its environment is most of it
MAX_FDS = 16
# the template's last argument: room in its command line's memory for each child's own
# (what ps and pgrep -f show), which cannot grow
TITLE_ROOM = " " * 2048
# signals a scheduler or a terminal sends every process of a job: the template blocks them
# (it ends with its launcher); its children keep the dispositions a fresh python started by
# the launcher would have (an ignored SIGHUP under nohup stays ignored), and unblock them
# once they are ready: one sent meanwhile waits, pending, instead of being lost
BLOCKED = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP}


@dataclass
class TemplateConfig:
    # the job compiles (parallelism.compile): import torch.compile's stack too
    compiled: bool = False
    fp8: bool = False  # the job trains in FP8: import torchao's float8 too (1.0 s of CPU)
    # a request waits this long for the template's imports, then starts a fresh process
    ready_timeout_s: float = 120.0
    # and this long for a fork's answer
    fork_timeout_s: float = 10.0


class Forked:
    """A process the template forked, as its launcher sees it: the part of
    ``subprocess.Popen``'s interface the launcher uses (``pid``, ``stdin``, ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self.stdin = None
        self._ended = threading.Event()

    def end(self, code: int) -> None:
        """Its exit code, as its template reaped it."""
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # as Popen: never a process that ended (and its pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Process = Forked | subprocess.Popen
Spawn = Callable[..., Process]  # subprocess.Popen, or a template's spawn


class Template:
    """A launcher's template process (started at once) and its requests."""

    def __init__(self, cfg: TemplateConfig, env: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmtrain.launch.template", str(theirs.fileno()),
             str(int(cfg.compiled)), str(int(cfg.fp8)), TITLE_ROOM],
            env={**(os.environ if env is None else env),
                 # torch.cuda.is_available() asks NVML, never the CUDA driver
                 "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
                 # a child's title is written over the command line's own memory, never
                 # its environment's: /proc/PID/environ stays the launcher's, and the
                 # markers tools find a job's processes by stay there
                 "SPT_NOENV": "1"},
            pass_fds=(theirs.fileno(),))
        theirs.close()
        self._sock = ours
        self._ready = threading.Event()
        self._gone = False
        self._lock = threading.Lock()  # one request at a time
        self._answered = threading.Event()
        self._answer_lock = threading.Lock()
        self._asked = 0  # the requests' ids
        self._waiting = 0  # the id of the request waiting for its answer (0: none)
        self._answer: tuple[dict, Forked | None] = ({}, None)
        self._forked: dict[int, Forked] = {}
        threading.Thread(target=self._read, daemon=True, name="template").start()

    def spawn(self, args: list[str], env: dict[str, str], *, stdin: int | None = None,
              text: bool = False, pass_fds: tuple[int, ...] = (),
              start_new_session: bool = False) -> Process:
        """``subprocess.Popen(args, env=env, stdin=stdin, text=text, pass_fds=pass_fds,
        start_new_session=start_new_session)``, forked from the template where it can
        (``args`` is ``[sys.executable, '-m', MODULE, ...]`` or ``[sys.executable,
        SCRIPT, ...]``, and the template is up)."""
        forked = self._fork(args, env, stdin, text, pass_fds, start_new_session) \
            if self._serves(args) else None
        return forked or subprocess.Popen(args, env=env, stdin=stdin, text=text,
                                          pass_fds=pass_fds,
                                          start_new_session=start_new_session)

    def _serves(self, args: list[str]) -> bool:
        if not (len(args) > 1 and args[0] == sys.executable
                and (args[1] == "-m" or not args[1].startswith("-"))):
            return False
        if not self._ready.wait(self.cfg.ready_timeout_s) and not self._gone:
            log.warning("llmtrain launch: the template process was not ready after %.0f s; "
                        "its processes start afresh", self.cfg.ready_timeout_s)
            self.close()
        return not self._gone

    def _fork(self, args, env, stdin, text, pass_fds, new_session) -> Forked | None:
        fds, targets = list(pass_fds), list(pass_fds)
        write = None
        if stdin == subprocess.PIPE:
            read, write = os.pipe()
            fds.append(read)
            targets.append(0)
        with self._lock:
            self._asked += 1
            request = {"id": self._asked, "argv": args[1:], "env": env, "cwd": os.getcwd(),
                       "fds": targets, "session": new_session}
            with self._answer_lock:
                self._answered.clear()
                self._answer = ({}, None)  # none yet: a template that dies gives none
                self._waiting = request["id"]
            with contextlib.suppress(OSError):
                socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
                self._answered.wait(self.cfg.fork_timeout_s)
            with self._answer_lock:  # an answer later than this is killed (_read)
                self._waiting = 0
                answer, forked = self._answer
        if write is not None:
            os.close(read)
        if forked is None:
            log.warning("llmtrain launch: the template process did not fork %s (%s); it "
                        "starts afresh", args[1:3], answer.get("error", "no answer"))
            if write is not None:
                os.close(write)
            return None
        if write is not None:
            forked.stdin = open(write, "w" if text else "wb",  # noqa: SIM115 - its owner's
                                buffering=1 if text else 0)
        return forked

    def _read(self) -> None:
        """The template's messages: ready, a fork's pid (or why it failed), an exit."""
        while True:
            try:
                data = self._sock.recv(MESSAGE_MAX)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "ready" in message:
                self._ready.set()
            elif "exit" in message:
                forked = self._forked.pop(message["pid"], None)
                if forked is not None:
                    forked.end(message["exit"])
            else:
                self._answered_with(message)
        closed, self._gone = self._gone, True
        self._ready.set()
        self._answered.set()
        if self._forked:  # it ended before them: their exit codes are lost
            threading.Thread(target=self._orphans, args=(closed,), daemon=True,
                             name="template-orphans").start()

    def _answered_with(self, message: dict) -> None:
        """A fork's answer: the child's pid, or why there is none. A child whose request
        gave up waiting (and started a fresh process instead) is killed, whatever request
        waits now."""
        forked = Forked(message["pid"], message["argv"]) if "pid" in message else None
        with self._answer_lock:
            if forked is not None:
                self._forked[forked.pid] = forked
            if message["id"] == self._waiting:
                self._answer = (message, forked)
                self._answered.set()
                return
        if forked is not None:
            log.warning("llmtrain launch: the template forked %s too late; killed",
                        message["argv"][:2])
            forked.kill()

    def _orphans(self, closed: bool) -> None:
        """The template ended (``closed``, or killed) before some of its children: each is
        seen to its end through its pidfd, and reported killed, its own code being lost."""
        if not closed:
            log.warning("llmtrain launch: the template process died before %d of its "
                        "processes; their exit codes are lost", len(self._forked))
        watched = {}
        for pid, forked in list(self._forked.items()):
            try:
                watched[os.pidfd_open(pid)] = forked
            except OSError:  # gone already
                forked.end(-signal.SIGKILL)
        while watched:  # each as it ends
            for pidfd in select.select(list(watched), [], [])[0]:
                os.close(pidfd)
                watched.pop(pidfd).end(-signal.SIGKILL)

    def close(self) -> None:
        """Ends the template (its children live on to their own ends)."""
        self._gone = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- the template's side --------------------------------------------------------------

def preload(compiled: bool, fp8: bool) -> None:
    """What a worker imports (``compiled``: torch.compile's stack too; ``fp8``: torchao's
    float8) and a first model build's one-time costs (on meta, of the default shape:
    whatever the job's, the next build takes milliseconds). Nothing here touches a
    device."""
    from llmtrain import collector
    with collector.paused(freeze=True):  # as `llmtrain train` imports (llmtrain.collector)
        import torch
        importlib.import_module("llmtrain.launch.worker")  # the trainer and all it imports
        from llmtrain.config.sections import ModelConfig
        from llmtrain.distributed.parallelize import import_fp8
        from llmtrain.model import Transformer
        if fp8:
            import_fp8()
        if compiled:  # imported as the model is built (most of a 1B model's 1.0 s "shard"
            # on an H200) and at the first step: 2.6 s here
            importlib.import_module("torch._inductor.compile_fx")
    with torch.device("meta"):  # a first model build's one-time costs (0.6 s of 0.6 s here)
        Transformer(ModelConfig())


def _preload_agent() -> None:
    """torchrun's agent's own imports (llmtrain.launch.agent's), beside a worker's."""
    from llmtrain import collector
    with collector.paused(freeze=True):
        importlib.import_module("torch.distributed.run")
        importlib.import_module("torch.distributed.elastic.agent.server.local_elastic_agent")


def serve(sock_fd: int, compiled: bool, fp8: bool) -> dict:
    """Imports, then forks on request until the launcher closes its end (then exits).
    Returns only in a forked child: the request it is to run, its process made ready."""
    sock = socket.socket(fileno=sock_fd)
    signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
    die_with_parent()
    preload(compiled, fp8)
    _preload_agent()
    gc.freeze()  # what the children share is never scanned, nor copied by a scan
    if threading.active_count() > 1:  # a fork would leave its lock behind
        raise SystemExit("llmtrain template: its imports started a thread: "
                         f"{[t.name for t in threading.enumerate()]}")
    if _forks_poisoned():  # nothing above may have (see the module's doc)
        raise SystemExit("llmtrain template: its imports initialized the CUDA driver; its "
                         "children could not use the GPU (the processes start afresh)")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    try:
        sock.send(json.dumps({"ready": True}).encode())
    except OSError:  # the launcher ended as the imports ran (a config error): no traceback
        raise SystemExit(0) from None
    while True:
        readable = select.select([sock, wake_r], [], [])[0]
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
            _reap(sock)
        if sock not in readable:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE_MAX, MAX_FDS)
        if not data:  # the launcher closed its end, or ended
            os._exit(0)
        request = json.loads(data)
        try:
            pid = os.fork()
        except OSError as e:
            answer = {"id": request["id"], "error": f"fork: {e}"}
        else:
            if pid == 0:
                sock.close()
                signal.set_wakeup_fd(-1)
                os.close(wake_r)
                os.close(wake_w)
                return _ready_child(request, fds)
            answer = {"id": request["id"], "pid": pid, "argv": request["argv"]}
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps(answer).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}).encode())


def _ready_child(request: dict, fds: list[int]) -> dict:
    """The forked child, made what a fresh ``python`` started with ``request`` would be."""
    import setproctitle
    setproctitle.setproctitle(" ".join([sys.executable, *request["argv"]]))
    setproctitle.setthreadtitle(os.path.basename(sys.executable))  # its name, as before
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["session"]:
        os.setsid()
    # each descriptor at the number its launcher gave it (the template holds no other
    # above 2: subprocess started it with close_fds), by way of numbers above them all
    targets = request["fds"]
    if len(targets) != len(fds):
        raise SystemExit(f"llmtrain template: {len(fds)} of the request's {len(targets)} "
                         "descriptors came")
    floor = max([*targets, 255]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, targets):
        os.dup2(fd, target)
        os.close(fd)
    if 0 in targets and sys.stdin is None:  # the template was started without one
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's, as python's
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    import numpy
    import torch
    # a fresh process draws its own seeds (python's random draws at each fork itself); a
    # device's generators are seeded as it is first used, as in a fresh process
    numpy.random.seed()
    torch.default_generator.seed()
    threads = os.environ.get("OMP_NUM_THREADS")  # read at torch's import in a fresh one
    if threads:
        torch.set_num_threads(int(threads))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)
    return request


def _forks_poisoned() -> bool:
    """Whether a child forked now would find CUDA unusable: torch marks that when the
    driver was initialized before the fork, which ``torch.cuda.is_available()`` does where
    NVML cannot answer (MIG devices named by UUID, a broken NVML), and FP8's torchao asks
    it at import. A child forked to ask, then ended."""
    import torch
    pid = os.fork()
    if pid == 0:
        os._exit(int(torch.cuda._is_in_bad_fork()))
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0


def run_python(argv: list[str]) -> int:
    """``python ARGV...`` in this process (``-m MODULE ARGS`` or ``SCRIPT ARGS``); its exit
    code. ``sys.path[0]`` is what python would make it: the working folder for a module,
    the script's folder for a script."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        log.error("%s", e.code)  # python writes an exit's message to stderr
        return 1
    except KeyboardInterrupt:  # python ends by the signal itself, for its parent to see
        sys.excepthook(*sys.exc_info())
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 1
    except BaseException:  # noqa: BLE001 - what python does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def die_with_parent(yes: bool = True) -> None:
    """This process ends with its parent (Linux's parent-death signal); ``yes=False``
    lifts that."""
    import ctypes
    with contextlib.suppress(OSError, AttributeError):  # PR_SET_PDEATHSIG
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL if yes else 0)
    if yes and os.getppid() == 1:  # it died before the line above
        os._exit(0)


def main(argv: list[str]) -> None:
    request = serve(int(argv[0]), argv[1] == "1", argv[2] == "1")
    sys.exit(run_python(request["argv"]))


if __name__ == "__main__":
    main(sys.argv[1:])
