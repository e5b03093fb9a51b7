"""torchrun's child when a node keeps prepared workers: hands the attempt to this local
rank's prepared worker and stands in for it until it ends.

    python -I -S handoff.py FOLDER ENTRY...

Standard library only, run without site-packages (about 20 ms to start, where a worker's
imports take seconds). It connects to ``FOLDER/<LOCAL_RANK>.sock``
(:mod:`llmtrain.launch.prepared`), sends the attempt (its command, environment and working
folder as JSON, its stdin, stdout and stderr as descriptors); the worker records its pid
in ``FOLDER/<the hand-off's pid>.worker``, for the agent's kills, before it answers and
runs the attempt. Then the hand-off passes on every signal
torchrun sends it (a stop's SIGTERM, a preemption's USR1) and ends as the worker ended:
with its exit code, or by the signal that killed it (as the worker's launcher reports it
in ``FOLDER/<worker pid>.exit``; SIGKILL when that does not come). Where no prepared
worker listens, or the one that does refuses, it becomes the worker itself: it execs
``python ENTRY...``, exactly what torchrun would have started.
"""

import json
import os
import signal
import socket
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
EXIT_REPORT_WAIT_S = 1.0  # for the launcher's word on how a worker that vanished ended


def main(argv: list) -> None:
    folder, entry = argv[0], argv[1:]
    worker = hand_over(folder, entry)
    if worker is None:  # no prepared worker: start one as torchrun would have
        os.execv(sys.executable, [sys.executable, "-u", *entry])
    conn, pid = worker
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    end(folder, pid, _exit_code(conn))


def hand_over(folder: str, entry: list):
    """(connection, worker pid), or None where no prepared worker took the attempt."""
    path = os.path.join(folder, f"{os.environ.get('LOCAL_RANK', '0')}.sock")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        attempt = {"argv": entry, "cwd": os.getcwd(),
                   "env": {**os.environ, "LLMTRAIN_HOLDER_PID": str(os.getpid()),
                           "LLMTRAIN_AGENT_PID": str(os.getppid())}}
        socket.send_fds(conn, [json.dumps(attempt).encode() + b"\n"], _stdio())
        reply = json.loads(_line(conn) or b"{}")
    except (OSError, ValueError):
        conn.close()
        return None
    if "pid" not in reply:  # refused (its device failed its check), or died
        conn.close()
        return None
    return conn, int(reply["pid"])


def _stdio() -> list:
    """This process's stdin, stdout and stderr; /dev/null for one it was started without."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


def _line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    return data


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _exit_code(conn: socket.socket):
    """The worker's exit code as it said it, or None where it vanished without a word."""
    while True:
        try:
            line = _line(conn)
            break
        except InterruptedError:
            continue
    try:
        return int(json.loads(line)["exit"]) if line else None
    except (ValueError, KeyError, TypeError):
        return None


def end(folder: str, pid: int, code) -> None:
    """Exits as the worker did; a worker killed by a signal is mirrored by that signal."""
    report = os.path.join(folder, f"{pid}.exit")
    deadline = time.monotonic() + EXIT_REPORT_WAIT_S
    while code is None and time.monotonic() < deadline:
        try:
            with open(report) as f:
                code = int(f.read())
        except (OSError, ValueError):
            time.sleep(0.02)
    code = -signal.SIGKILL if code is None else code
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
