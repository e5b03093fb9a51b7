"""In-memory snapshots of the training state, each replicated to a buddy on the next node.

A cold restart reads the durable checkpoint back from shared storage and redoes every step
since it. With each rank's state copied into host memory every few steps, and a replica of
it held by a rank on another node, the survivors of a failure restore from their own
snapshot and the lost rank's replacement from its buddy's replica: at most the interval
between snapshots is redone, and nothing is read from storage.

The interval is ``warm.snapshot_every`` steps, stretched where snapshots would take more
than ``warm.snapshot_budget`` of the training time (:class:`Schedule`): every step on a
node with cores to spare, every few where the replication competes with training for them.

A snapshot is one flat byte buffer (this rank's model and optimizer shards, any
optimizer's, in the order of the registry's one list of them,
:func:`llmtrain.state_registry.state_tensors`) plus a small JSON header (the step, every
other item of the run's state registry, the buffer's layout and a checksum of the bytes
and the rest of the header, :mod:`llmtrain.checkpoint.checksum`).
Nothing is pickled: a replica from a peer is data, never code. Buffers are reused: two
slots of our own, two of our ward's (the rank whose buddy we are). The copy runs on the
training thread (a memcpy; from a GPU, into pinned memory on a side stream); the checksum
and the exchange with the buddy run on a thread of their own, over a gloo group used for
nothing else. A snapshot due while the previous one is still being sent is skipped, so
the training thread never waits for the network.

Each generation of the job has its own replication thread. A peer that dies in the middle
of a transfer can leave gloo waiting until the group's timeout (it has no abort), so a
recovery does not wait for the thread: it is left behind with the abandoned group, and
nothing it finishes later is kept.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from llmtrain import fault_points
from llmtrain.checkpoint import checksum
from llmtrain.events import EventLog

_ALIGN = 64


class SnapshotError(RuntimeError):
    """A snapshot that cannot be used: missing, or failing its checksum."""


def _layout(tensors: list[torch.Tensor]) -> list[list]:
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


def _offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    return _aligned([t.numel() * t.element_size() for t in tensors])


def _aligned(sizes: list[int]) -> tuple[list[int], int]:
    """Where each of tensors of ``sizes`` bytes starts in a buffer, and its end."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // _ALIGN) * _ALIGN
    return offsets, end


def _sum(buffer: torch.Tensor, header: dict) -> str:
    """The snapshot's checksum: its bytes and its header (the step, the data position,
    the schedule, the RNG: a flipped bit there restores the wrong state as surely as one
    in the tensors), all but the sum itself."""
    hasher = checksum.new()
    hasher.update(memoryview(buffer.numpy()))
    hasher.update(json.dumps({k: v for k, v in header.items() if k != "sum"},
                             sort_keys=True).encode())
    return checksum.label(hasher.hexdigest())


@dataclass
class Snapshot:
    """One rank's state at ``step``: ``header`` (JSON-able) and ``buffer`` (bytes)."""
    step: int
    header: dict
    buffer: torch.Tensor

    def verify(self) -> None:
        if _sum(self.buffer[:self.header["nbytes"]], self.header) != self.header["sum"]:
            raise SnapshotError(f"rank {self.header['rank']}'s snapshot of step {self.step} "
                                f"fails its checksum: the memory holding it was corrupted")

    def parts(self) -> list[torch.Tensor]:
        """Each tensor's bytes in the buffer, as the header's layout places them."""
        sizes = [math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
                 for dtype, shape in self.header["layout"]]
        offsets, _ = _aligned(sizes)
        return [self.buffer[off:off + n] for off, n in zip(offsets, sizes)]

    def restore_into(self, tensors: list[torch.Tensor]) -> dict:
        """Copies the buffer into ``tensors`` (same layout); returns the header."""
        if _layout(tensors) != self.header["layout"]:
            raise SnapshotError(f"rank {self.header['rank']}'s snapshot of step {self.step} "
                                f"does not match this model's layout (a different config?)")
        offsets, _ = _offsets(tensors)
        with torch.no_grad():
            for t, off in zip(tensors, offsets):
                if t.numel():
                    n = t.numel() * t.element_size()
                    t.view(-1).view(torch.uint8).copy_(self.buffer[off:off + n])
        return self.header


def _copied(step: int, rank: int, tensors: list[torch.Tensor], header: dict,
            buffer: torch.Tensor) -> Snapshot:
    """``tensors`` copied into ``buffer`` as ``rank``'s snapshot of ``step``, its checksum
    not yet taken. From a GPU: into pinned memory on a side stream, the copies queued at
    once and waited for together (the caller synchronized the training stream)."""
    offsets, nbytes = _offsets(tensors)
    cuda = bool(tensors) and tensors[0].is_cuda
    stream = _side_stream(tensors[0].device) if cuda else None
    with torch.no_grad(), torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        for t, off in zip(tensors, offsets):
            if t.numel():
                buffer[off:off + t.numel() * t.element_size()].copy_(
                    t.detach().reshape(-1).view(torch.uint8), non_blocking=cuda)
    if cuda:
        stream.synchronize()
    header = {**header, "step": step, "rank": rank, "layout": _layout(tensors),
              "nbytes": nbytes, "sum": None}
    return Snapshot(step, header, buffer)


def capture(step: int, rank: int, tensors: list[torch.Tensor], header: dict) -> Snapshot:
    """A snapshot of ``step`` outside the schedule and the replication (a grow's), its
    checksum taken."""
    if tensors and tensors[0].is_cuda:
        torch.cuda.current_stream(tensors[0].device).synchronize()
    _, nbytes = _offsets(tensors)
    cuda = bool(tensors) and tensors[0].is_cuda
    snap = _copied(step, rank, tensors, header,
                   torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda))
    snap.header["sum"] = _sum(snap.buffer[:nbytes], snap.header)
    return snap


def shares_cores(device: torch.device, local_world_size: int) -> bool:
    """Whether the replication's CPU time comes out of training's: this rank has less than
    a core of its own beyond what training uses (its thread; on CPU, torch's threads)."""
    cores = len(os.sched_getaffinity(0)) / max(1, local_world_size)
    return cores - (torch.get_num_threads() if device.type == "cpu" else 1) < 1


class Schedule:
    """The steps snapshots are taken at.

    Every ``every`` steps at the least. With a ``budget``, the interval grows until a
    snapshot costs at most ``budget`` of the training time between two (``max_every`` at
    most). A snapshot's cost is what it adds to the steps' time: the time from one
    snapshot to the next against as many clean steps (begun after the last replication
    ended). That counts all it takes from training: the copy, the replication's CPU, the
    kernel's work moving its bytes, caches. As a floor against noise, and alone until a
    clean step is seen, the cost is what was timed: the copy and, where the replication
    shares training's cores, its process CPU time (which misses the kernel's share).

    A recovery restores a step every rank holds, so all ranks snapshot at the same steps:
    the interval each proposes from its own costs is agreed by a MAX all-reduce on a gloo
    group of the training thread's, cast at one snapshot and decided at the next, off the
    step's critical path.
    """

    def __init__(self, every: int, budget: float = 0.0, max_every: int | None = None):
        self.every, self.budget = every, budget
        self.max_every = max(every, max_every or every)
        # the last few measures of a snapshot's cost and of a step's time without one: their
        # medians, so that a checkpoint's save or a slow step now and then does not count
        self.costs, self.steps = _Recent(), _Recent()
        self.seen_clean = False  # a step begun after a replication ended (see above)
        self.restart(0, None)

    def restart(self, step: int, control, soon: bool = False) -> None:
        """The next snapshot ``every`` steps after ``step`` (``soon``: at the next step),
        agreed on ``control`` (a gloo group of every rank's training thread; None: no
        agreement, a fixed interval)."""
        self.control = control if self.budget else None
        self.next, self.interval = step + (1 if soon else self.every), self.every
        self.vote: tuple[dist.Work, torch.Tensor] | None = None
        self.ticks: list[tuple[int, float]] = []  # each step since the last snapshot: its end

    def due(self, step: int) -> bool:
        """Called once after each step."""
        self.ticks.append((step, time.perf_counter()))
        return step >= self.next

    def advance(self, step: int, timed_s: float, replicated: float | None) -> None:
        """After the snapshot of ``step``: the last one's cost, the next agreed interval,
        and this rank's proposal for the one after. ``timed_s``: a snapshot's cost as timed
        (until clean steps are seen); ``replicated``: when the last replication ended (None:
        not yet)."""
        ticks, self.ticks = self.ticks, self.ticks[-1:]  # this step's: the copy comes next
        if [s for s, _ in ticks] == list(range(step - self.interval, step + 1)):  # unbroken
            times = [t for _, t in ticks]
            total = times[-1] - times[0]
            clean = [b - a for a, b in zip(times, times[1:])
                     if replicated is not None and a >= replicated]
            if clean:
                self.seen_clean = True
                self.steps.add(sum(clean) / len(clean))
            elif not self.seen_clean:
                self.steps.add(max(0.0, total - timed_s) / self.interval)
            # what it adds to the steps, at least what was timed (a floor against noise)
            self.costs.add(max(timed_s, total - self.interval * self.steps.median())
                           if self.seen_clean else timed_s)
        if self.vote is not None:
            work, proposal = self.vote
            work.wait()
            self.interval = int(proposal.item())
        if self.control is not None:
            proposal = torch.tensor([self.proposal()], dtype=torch.int64)
            self.vote = (dist.all_reduce(proposal, op=dist.ReduceOp.MAX, group=self.control,
                                         async_op=True), proposal)
        self.next = step + self.interval

    def proposal(self) -> int:
        """The least interval that keeps this rank's snapshots within the budget."""
        if not (self.budget and self.costs.values and self.steps.median()):
            return self.every
        needed = math.ceil(self.costs.median() / (self.budget * self.steps.median()))
        return min(self.max_every, max(self.every, needed))


class _Recent:
    """The last few values of a measure, and their median."""

    def __init__(self, keep: int = 5):
        self.values: collections.deque[float] = collections.deque(maxlen=keep)

    def add(self, value: float) -> None:
        self.values.append(value)

    def median(self) -> float:
        return statistics.median(self.values) if self.values else 0.0


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream snapshots copy on, one per device, apart from training's."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@dataclass
class _Slots:
    """Two reusable snapshot slots; the older one is overwritten."""
    held: list[Snapshot] = field(default_factory=list)

    def reuse(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """A buffer of at least ``nbytes``: the older slot's when it fits. ``pinned``
        (page-locked) for copies from a GPU, which then run at the link's speed."""
        if len(self.held) == 2:
            old = self.held.pop(0)
            if old.buffer.numel() >= nbytes and old.buffer.is_pinned() == pinned:
                return old.buffer
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def add(self, snap: Snapshot) -> None:
        self.held.append(snap)

    def steps(self) -> list[int]:
        return [s.step for s in self.held]

    def at(self, step: int) -> Snapshot | None:
        return next((s for s in self.held if s.step == step), None)


class Snapshots:
    """This rank's snapshots and its ward's replicas.

    ``buddy``/``ward``: the rank that holds our replica, and the rank whose replica we
    hold (None when the job has one node: a buddy on our own node dies with us).
    """

    def __init__(self, schedule: Schedule, rank: int, *, buddy: int | None, ward: int | None,
                 events: EventLog, shares_cores: bool = True):
        self.schedule, self.rank, self.buddy, self.ward = schedule, rank, buddy, ward
        self.events = events
        self.shares_cores = shares_cores  # the replication's CPU time counts as a cost
        self.replication_cpu_s = 0.0  # the last exchange's, beside the training thread's
        self.replicated: float | None = None  # when the last one ended (perf_counter)
        self.own, self.replicas = _Slots(), _Slots()
        self.skipped = 0
        self._work: Snapshot | None = None
        self._gen = 0  # the replication thread's generation; a stale thread keeps nothing
        self._wake = threading.Condition()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    # -- lifecycle (one replication group per generation of the job) ------------------

    def start(self, group, control, step: int, soon: bool = False) -> None:
        """Starts replicating over ``group`` (a gloo group of every rank), the first
        snapshot due ``every`` steps after ``step`` (``soon``: at the next step); the
        interval is agreed on ``control`` (see :class:`Schedule`). Called on the training
        thread."""
        self.schedule.restart(step, control, soon)
        self._idle = threading.Event()
        self._idle.set()
        if self.buddy is not None:
            training = time.pthread_getcpuclockid(threading.get_ident())
            self._thread = threading.Thread(
                target=self._replicate, args=(self._gen, group, self._idle, training),
                name="llmtrain-snapshots", daemon=True)
            self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stops replicating (the group is about to go). A thread still in an exchange
        after ``timeout`` is left behind, and nothing it finishes is kept."""
        with self._wake:
            self._gen += 1
            self._work = None
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- on the training thread -------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    def take(self, step: int, tensors: list[torch.Tensor], header: dict) -> bool:
        """Copies ``tensors`` into a free slot as the snapshot of ``step``; False (skipped)
        while the previous one is still being sent to the buddy."""
        if tensors and tensors[0].is_cuda:  # the copy's time, not the queued steps'
            torch.cuda.current_stream(tensors[0].device).synchronize()
        replicated = self.replicated if self._idle.is_set() else None
        started = time.perf_counter()
        taken = self._copy(step, tensors, header)
        cost = time.perf_counter() - started
        self.schedule.advance(step, cost + self.replication_cpu_s * self.shares_cores,
                              replicated)
        return taken

    def _copy(self, step: int, tensors: list[torch.Tensor], header: dict) -> bool:
        if not self._idle.is_set():
            self.skipped += 1
            return False
        _, nbytes = _offsets(tensors)
        cuda = bool(tensors) and tensors[0].is_cuda
        snap = _copied(step, self.rank, tensors, header, self.own.reuse(nbytes, pinned=cuda))
        self.own.add(snap)
        if self.buddy is None:
            snap.header["sum"] = _sum(snap.buffer[:nbytes], snap.header)
            self.replicated = time.perf_counter()  # nothing goes on beside training
            return True
        with self._wake:
            self._idle.clear()
            self._work = snap
            self._wake.notify_all()
        return True

    def forget_own(self) -> None:
        """The state went back (a rollback): this rank's snapshots of the steps it left
        are never restored."""
        self.own.held.clear()

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self._idle.wait(timeout)

    # -- the replication thread -------------------------------------------------------

    def _replicate(self, gen: int, group, idle: threading.Event, training: int) -> None:
        """``training``: the training thread's CPU clock; the process's CPU time beyond it
        during an exchange (this thread's, gloo's, other threads' if busy) is its cost."""
        while True:
            with self._wake:
                while self._work is None and self._gen == gen:
                    self._wake.wait()
                if self._gen != gen:
                    return
                snap, self._work = self._work, None
            cpu, train = time.process_time(), time.clock_gettime(training)
            try:
                replica = self._exchange(snap, group, gen)
            except Exception as e:  # noqa: BLE001 - usually a peer failed: the training
                self._failed(snap, gen, e)  # thread's collectives fail too, and recovery
                idle.set()                  # takes it from there (a new generation)
                return
            if replica is not None:
                self._keep(replica, gen)
            self.replication_cpu_s = max(0.0, time.process_time() - cpu
                                         - (time.clock_gettime(training) - train))
            self.replicated = time.perf_counter()
            idle.set()

    def _failed(self, snap: Snapshot, gen: int, error: Exception) -> None:
        """Says why replication ended (an event, ``snapshot_replication_failed``): this
        generation replicates nothing more, so a recovery before the next one goes cold,
        and without the event nothing would tell why. ``stale``: the thread had already
        been left behind by a recovery (its group abandoned, a peer lost), where failing is
        expected; the event is the trace that the thread did end, and the metrics do not
        count it."""
        with self._wake:
            stale = self._gen != gen
        try:
            self.events.emit("snapshot_replication_failed", rank=self.rank, buddy=self.buddy,
                             ward=self.ward, step=snap.step, stale=stale,
                             error=f"{type(error).__name__}: {error}"[:500])
        except Exception:  # noqa: BLE001 - an event log that fails cannot say so either;
            pass           # the thread still ends cleanly (idle set)

    def _keep(self, replica: Snapshot, gen: int) -> None:
        """Keeps the ward's replica if its checksum matches and the thread is still current."""
        try:
            replica.verify()
        except SnapshotError as e:
            self.events.emit("snapshot_corrupt", rank=self.rank, ward=self.ward,
                             step=replica.step, error=str(e), when="received")
            return
        with self._wake:
            if self._gen == gen:
                self.replicas.add(replica)

    def _exchange(self, snap: Snapshot, group, gen: int) -> Snapshot | None:
        """Sends our snapshot to the buddy and receives the ward's: sizes first, then the
        JSON header and the bytes; returns the ward's (None once the thread is stale)."""
        fault_points.point("replicate", snap.step)
        nbytes = snap.header["nbytes"]
        snap.header["sum"] = _sum(snap.buffer[:nbytes], snap.header)
        head = json.dumps(snap.header).encode()
        sizes_out = torch.tensor([len(head), nbytes], dtype=torch.int64)
        sizes_in = torch.empty(2, dtype=torch.int64)
        _both(dist.isend(sizes_out, self.buddy, group=group),
              dist.irecv(sizes_in, self.ward, group=group))
        head_len, body_len = (int(x) for x in sizes_in)
        head_in = torch.empty(head_len, dtype=torch.uint8)
        with self._wake:
            if self._gen != gen:
                return None
            body_in = self.replicas.reuse(body_len)
        _both(dist.isend(torch.frombuffer(bytearray(head), dtype=torch.uint8), self.buddy,
                         group=group),
              dist.irecv(head_in, self.ward, group=group))
        _both(dist.isend(snap.buffer[:nbytes], self.buddy, group=group),
              dist.irecv(body_in[:body_len], self.ward, group=group))
        header = json.loads(bytes(head_in.numpy()))
        return Snapshot(header["step"], header, body_in)

    # -- recovery ---------------------------------------------------------------------

    def holdings(self) -> dict:
        """What this rank can restore from: its own steps, and its ward's (verified)."""
        return {"own": [s.step for s in self.own.held if s.header["sum"] is not None],
                "ward": self.ward, "replicas": self.replicas.steps()}

    def send_replica(self, step: int, to: int, group) -> None:
        """Sends the ward's replica of ``step`` to ``to`` (the ward's replacement),
        verifying it first: a corrupted replica is never handed on."""
        replica = self.replicas.at(step)
        if replica is None:
            raise SnapshotError(f"rank {self.rank} holds no replica of rank {self.ward} "
                                f"at step {step}")
        fault_points.point("replica", step, replica.buffer)
        head = json.dumps(replica.header).encode()
        try:
            replica.verify()
        except SnapshotError as e:
            self.events.emit("snapshot_corrupt", rank=self.rank, ward=self.ward, step=step,
                             error=str(e), when="before restore")
            head = b""  # an empty header tells the receiver to give up
        dist.send(torch.tensor([len(head), replica.header["nbytes"]]), to, group=group)
        if head:
            dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8), to, group=group)
            dist.send(replica.buffer[:replica.header["nbytes"]], to, group=group)

    @staticmethod
    def receive(source: int, group, timeout_s: float) -> Snapshot:
        """The counterpart of :meth:`send_replica` on the replacement rank; SnapshotError
        when ``source`` has not sent it all within ``timeout_s`` (its buddy failed, or
        hangs: the spare gives up within its recovery budget, not the group's timeout)."""
        deadline = time.monotonic() + timeout_s

        def recv(tensor: torch.Tensor) -> None:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise RuntimeError("no time left")
                dist.irecv(tensor, source, group=group).wait(timedelta(seconds=left))
            except RuntimeError as e:
                raise SnapshotError(f"the replica from rank {source} did not come within "
                                    f"{timeout_s:.1f}s ({e})") from None
        sizes = torch.empty(2, dtype=torch.int64)
        recv(sizes)
        head_len, nbytes = (int(x) for x in sizes)
        if not head_len:
            raise SnapshotError(f"the replica rank {source} holds failed its checksum (see "
                                f"its snapshot_corrupt event)")
        head = torch.empty(head_len, dtype=torch.uint8)
        recv(head)
        header = json.loads(bytes(head.numpy()))
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        recv(buffer)
        snap = Snapshot(header["step"], header, buffer)
        snap.verify()
        return snap

    def bytes_held(self) -> int:
        return sum(s.buffer.numel() for s in self.own.held + self.replicas.held)


def _both(*works) -> None:
    for w in works:
        w.wait()
