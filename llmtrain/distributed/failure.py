"""The failure layer: how a rank learns that its process group is broken, and how it
leaves it, on both backends. The warm path (:mod:`llmtrain.recovery`) stands on it.

A warm recovery needs three things that default settings deny it:

1. **A failed collective raises in the training thread.** It must not end the process.
2. **A rank blocked in a collective is woken.** Its peers may be healthy but blocked
   too, so it sees no error of its own until the collective's timeout.
3. **A local error is told from a peer's loss** (:func:`broke_a_collective`). A rank
   whose own step failed (out of memory, an EIO on its data, a CUDA fault) leaves and
   is replaced. It must not report as a survivor that is waiting for the others, or
   its healthy peers, still blocked in the collective and silent, would be counted lost.

**NCCL.** This was read from torch 2.13's ``ProcessGroupNCCL`` and its docs; it has never
run on a GPU. ``tests/gpu`` holds a one-GPU check of the abort, not yet run; two or more
ranks are checked by nothing but the gloo tests of the same code. The worker settings it
needs, and why, are in :mod:`llmtrain.distributed.nccl_env`; :func:`nccl_problems` names
what defeats it on this job.

Every rank keeps a :class:`FailureWatch`: a thread waiting in the store, on the server's
side, for its generation's ``failed`` key. The first survivor to report sets that key, and
so does an agent that saw its worker die. The watch then says at once that this rank lives
and will report (:func:`llmtrain.recovery.roll_call.stir`): a rank in the middle of a long
step's computation meets the failure only at its next collective, maybe seconds later, and
the agreement waits for it rather than counting it lost after ``warm.settle_s``.

Waking blocked ranks (item 2) works differently on each backend:

- **NCCL**: the watch also aborts this rank's communicators, so a rank blocked behind
  healthy peers fails at once, not at ``reliability.collective_timeout_s``.
- **gloo** has no abort in torch 2.13. When a peer dies, its closed connections fail the
  operations pending on them. A rank blocked on a healthy peer, which is itself blocked,
  fails once that peer leaves the group. So the warm path leaves the broken group right
  after it reports, before the plan. The failure then crosses the group in as many hops
  as the longest chain of waits, milliseconds each. A rank whose training thread is still
  inside a collective some time after the watch woke leaves the job: gloo may never end
  that wait (:mod:`llmtrain.recovery.coordinator`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, MutableMapping
from datetime import timedelta

import torch
import torch.distributed as dist

from llmtrain.distributed.nccl_env import env_problems
from llmtrain.distributed.signed_store import SignedStore

log = logging.getLogger(__name__)

# NCCL releases nvidia-resiliency-ext's in-process restart refuses (first, last,
# inclusive); followed here, the reason not verified on a GPU.
_BAD_NCCL = ((2, 28, 3), (2, 28, 8))

# Whether the NCCL warm path has run across GPUs. One rank on one H100 and one H200 has
# (the abort of a stuck collective, a new group, the snapshot restored: tests/gpu); two or
# more ranks, a dead peer and the agreement across ranks have not, so warm.enable on NCCL
# says so.
NCCL_WARM_PROVEN = False

# How collectives fail on gloo: its errors are plain RuntimeErrors that name gloo's
# transport source files ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by
# peer", "... unbound_buffer.cc:78] Timed out waiting ...").
_COLLECTIVE_MARKS = ("/gloo/", "Connection closed by peer", "Connection reset by peer")


def nccl_version() -> tuple[int, int, int] | None:
    try:
        return tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):  # a build without NCCL
        return None


def nccl_problems(env: MutableMapping[str, str] = os.environ,
                  version: tuple[int, int, int] | None = None) -> list[str]:
    """What stops warm recovery on this NCCL job, each with what to change. An empty
    list means the settings are right, not that the path is proven (``NCCL_WARM_PROVEN``)."""
    problems = env_problems(env)
    if not callable(getattr(dist.distributed_c10d, "_abort_process_group", None)):
        problems.append(f"torch {torch.__version__} has no _abort_process_group: blocked "
                        f"collectives cannot be aborted; use torch 2.13")
    version = version or nccl_version()
    if version is not None and _BAD_NCCL[0] <= version <= _BAD_NCCL[1]:
        problems.append(f"NCCL {'.'.join(map(str, version))} is one nvidia-resiliency-ext's "
                        f"in-process restart refuses; use a release outside 2.28.3-2.28.8")
    return problems


def broke_a_collective(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed (a peer lost, a group aborted, a
    timeout), not this rank's own work failing (item 3 of the module's docstring)."""
    if isinstance(error, dist.DistError):  # NCCL's errors, the store's, the network's
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _COLLECTIVE_MARKS)


def abort_groups() -> bool:
    """Aborts every NCCL communicator of this process (the default group's and every
    subgroup's), so collectives queued or running on them end; False on gloo, which has
    no abort. Returns once the GPU work queued ahead of those collectives has ended (seen
    on an H200: a 5 s kernel ahead of a collective held the call 5 s)."""
    if not (dist.is_initialized() and dist.get_backend() == "nccl"):
        return False
    dist.distributed_c10d._abort_process_group()  # None: every group, the default included
    return True


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def abandon() -> None:
    """Leaves process groups a lost peer broke. On NCCL the communicators are aborted
    first: destroying them would wait for collectives the dead peer never finishes. On
    gloo, a dead peer's closed connections have already failed our pending operations,
    so destroying is enough."""
    abort_groups()
    shutdown()


def _abort(_store: SignedStore) -> None:
    abort_groups()


class FailureWatch:
    """Wakes this rank when a peer of its generation reports a failure: one thread, on
    its own store connection, waiting on the server's side for one key (no polling) whose
    value is signed with the job's secret (a forged one wakes nothing), that
    runs ``on_failure`` with that connection (default: :func:`abort_groups`) while the
    watch is armed; then ``then``, if given, with the connection and :attr:`disarmed`,
    outside the watch's lock (a disarm meanwhile does not wait for it).

    The thread ends when the key appears, or once disarmed. A store that restarts or
    goes away does not end it: it connects again every ``RETRY_S`` (said once), and waits
    on. The thread is a daemon, so it needs no stopping. :meth:`disarm` (whenever this
    rank leaves the generation itself: a recovery, a grow, a preemption's shrink) keeps a
    watch that wakes late from acting on the next generation's groups."""

    RETRY_S = 1.0
    # One wait in the store; give ``connect``'s connection at least this timeout: a wait
    # cut by a shorter one logs two c10d warnings each time (every 30 s, for every rank)
    WAIT = timedelta(hours=1)

    def __init__(self, connect: Callable[[], SignedStore | None], key: str,
                 on_failure: Callable[[SignedStore], object] = _abort,
                 then: Callable[[SignedStore, threading.Event], object] | None = None):
        self.key, self.on_failure, self.then = key, on_failure, then
        self._lock = threading.Lock()
        self._armed = True
        self.woke = threading.Event()
        self.disarmed = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(connect,), daemon=True,
                                        name="llmtrain-failure-watch")
        self._thread.start()

    def _watch(self, connect: Callable[[], SignedStore | None]) -> None:
        said = False
        while True:
            try:
                store = connect()
                if store is None:  # no store outside the workers: nothing to watch
                    return
                while store.wait_genuine(self.key, self.WAIT) is None:
                    pass  # a wait's timeout, or a forged value (reported): wait again
                break
            except (RuntimeError, OSError) as e:  # the store restarted, or went away
                with self._lock:
                    if not self._armed:
                        return
                if not said:
                    said = True
                    log.warning("the failure watch on %s lost the rendezvous store (%s); it "
                                "connects again every %g s", self.key, e, self.RETRY_S)
                time.sleep(self.RETRY_S)
        with self._lock:
            if self._armed:
                self.on_failure(store)
                self.woke.set()
        if self.woke.is_set() and self.then is not None:
            self.then(store, self.disarmed)

    def disarm(self) -> None:
        """From now on the watch does nothing; waits for an abort in progress."""
        with self._lock:
            self._armed = False
            self.disarmed.set()
