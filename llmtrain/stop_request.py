"""A request to end a run early and cleanly, ``<run_dir>/stop_request.json``.

``llmtrain stop RUN_DIR`` writes it (from any host that sees the run directory). Rank 0
looks for it once a second on a thread of its own (a look at an object store can take
tens of milliseconds: never on the training thread); the ranks agree on a step in the
checkpoint manager's vote, save there, and the run ends as finished: its ``run_end`` is
marked ``stopped``, every rank exits CLEAN, so neither torchrun nor a Slurm requeue starts
it again, and waiting spares are released. The request is removed once the run has ended
on it, so a later launch of the same run resumes from that save and goes on.
"""

from __future__ import annotations

import getpass
import json
import socket
import threading
import time

import fsspec

from llmtrain.fsio import join, write_atomic

STOP_REQUEST = "stop_request.json"
POLL_S = 1.0


def request_stop(run_dir: str, reason: str) -> dict:
    """Asks the run at ``run_dir`` to save and end at its next step; returns the request."""
    request = {"reason": reason, "requested_at": time.time(),
               "from_host": socket.gethostname(), "by_user": getpass.getuser()}
    write_atomic(join(run_dir, STOP_REQUEST), json.dumps(request).encode())
    return request


def read_request(run_dir: str) -> dict | None:
    """The pending request, or None. One that cannot be parsed (a hand-written file) still
    asks the run to stop."""
    try:
        with fsspec.open(join(run_dir, STOP_REQUEST), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        return dict(json.loads(data))
    except (ValueError, TypeError):
        return {"reason": f"{STOP_REQUEST} present (not JSON)"}


def clear_request(run_dir: str) -> None:
    fs, path = fsspec.core.url_to_fs(join(run_dir, STOP_REQUEST))
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


class StopRequestWatch:
    """Rank 0's look-out for a stop request: ``request`` is the pending one, once seen."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.request: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="llmtrain-stop-request",
                                        daemon=True)

    def start(self) -> StopRequestWatch:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while self.request is None and not self._stop.wait(POLL_S):
            try:
                self.request = read_request(self.run_dir)
            except OSError:  # storage briefly unreachable: look again
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
