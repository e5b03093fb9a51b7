"""Fencing: a rank that was cut off from the job must not write into it once the job has
re-formed without it.

A partition leaves a node's processes alive: the rest of the job replaces them (a warm
spare, or a cold restart on a spare node), and when the link comes back the cut-off ranks
carry on where they stopped, in the middle of a checkpoint write perhaps. Their shard
files would land in the job's storage beside the new members' files (a cold restart that
replays the same step commits them, and the late writer overwrites its files), and their
events would read as the job's.

The job's membership has one name at a time, its token (``<round>/g<generation>``: the
torchrun round, and the warm generation within it), kept in the rendezvous store outside
the workers. Every member writes it before its group forms, so no member trains before
the token names its membership; a new membership only ever follows the last one. Before a
rank creates a file in the checkpoint's storage or commits one, it reads the token: a
token other than its own, or a store it cannot reach within ``reliability.fence_timeout_s``
(it cannot prove it is a member), refuses the write. The refused rank writes one
``fenced`` event, naming what it was refused and why, and no event after it.

Without a store outside the workers (a plain ``torchrun --standalone`` job) nothing
outlives a round to compare against, and nothing is fenced: such a job has no way to go
on without one of its nodes anyway.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from llmtrain.events import EventLog
from llmtrain.recovery.warm import outside_store

KEY = "fence/token"


class Fenced(RuntimeError):
    """This rank is no longer a member of the job: its write was refused."""


class Fence:
    """One rank's fence; ``store``: its own client of the job's namespace in the store
    outside the workers, with ``timeout_s`` as its timeout (None: no such store)."""

    def __init__(self, store: dist.Store | None, events: EventLog, timeout_s: float):
        self.store, self.events, self.timeout_s = store, events, timeout_s
        self.token = ""
        self.expected: str | None = None  # the membership a warm recovery is joining
        self.refused: str | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """A fence travels to a save's writer process (``checkpoint.mode=async_process``)
        with the checkpoint writer, and connects to the store again there."""
        return {"token": self.token, "refused": self.refused, "timeout_s": self.timeout_s,
                "events": (self.events.run_dir, self.events.rank),
                "outside": self.store is not None}

    def __setstate__(self, state: dict) -> None:
        timeout = timedelta(seconds=state["timeout_s"])
        self.__init__(outside_store(timeout) if state["outside"] else None,
                      EventLog(*state["events"]), state["timeout_s"])
        self.token, self.refused = state["token"], state["refused"]

    def join(self, token: str) -> None:
        """This rank is a member of ``token``'s membership; called by every member before
        its group forms."""
        self.token, self.expected = token, None
        if self.store is not None:
            self.store.set(KEY, token)

    def expect(self, token: str) -> None:
        """This rank agreed to join ``token``'s membership (a warm recovery): a peer that
        joins it first does not make this rank a cut-off one meanwhile."""
        self.expected = token

    def check(self, what: str) -> None:
        """Raises Fenced unless the store still names this rank's membership."""
        if self.store is None:
            return
        with self._lock:
            if self.refused is None:
                self.refused = self._verdict()
                if self.refused is not None:
                    self.events.emit("fenced", what=what, reason=self.refused,
                                     mine=self.token, host=socket.gethostname())
                    self.events.silence()
        if self.refused is not None:
            raise Fenced(f"{what} refused: {self.refused}")

    def superseded(self) -> str | None:
        """Why this rank is no longer a member, once the store names another membership;
        None while it names this one, or cannot be reached (no proof either way). The
        watchdog of a warm job asks at every tick: a rank a partition cut off shares its
        round's namespace with the spare that replaced it, and must not speak there when
        its link comes back."""
        if self.store is None:
            return None
        with self._lock:
            try:
                current = self.store.get(KEY).decode()
            except (dist.DistError, RuntimeError):
                return None
            return None if current == self.expected else self._other(current)

    def _verdict(self) -> str | None:
        try:
            current = self.store.get(KEY).decode()
        except (dist.DistError, RuntimeError) as e:
            return (f"the rendezvous store could not be reached within reliability."
                    f"fence_timeout_s={self.timeout_s} ({type(e).__name__}): membership "
                    f"unproven")
        return self._other(current)

    def _other(self, current: str) -> str | None:
        if current != self.token:
            return f"the job re-formed as {current} without this rank (it was {self.token})"
        return None
