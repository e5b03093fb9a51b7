"""CheckpointManager: when to save, saving without stalling training, retention, resume.

A save hardly blocks the training thread: the state is staged into host memory (buffers
reused from save to save, pinned on GPU) on a thread of its own while the next step's
forward and backward run, and only that step's update waits for it (``wait_staged``).
The write, the commit and the retention run in the background (DCP's thread or process
executor) on a gloo group of their own, so checkpoint collectives never interleave with
training ones. One save is in flight at most. A failed save, whatever the error, leaves
every committed checkpoint as it was: the failure becomes an event and the next interval
tries again.

Decisions every rank must take together (whether a step was committed already, which
checkpoint to resume from) go through a small all-reduce or gather on the run control's
gloo group, which only the training thread uses; when to save by time is one of the run
control's votes (:mod:`llmtrain.control`).

Nothing fails silently: a failed write or commit is a ``checkpoint_failed`` event, a
failed retention pass a ``checkpoint_retention_failed`` one, both with the error.

A recovery that leaves the job's groups waits for the write in flight (``leave``), which
may commit yet; one that waits in an I/O-group collective its lost peer never ends is
let go of instead (``disown``): the recovery goes on without it, and it writes nothing
more.
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback
from concurrent import futures
from concurrent.futures import Future
from typing import Callable

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from llmtrain import fault_points
from llmtrain.checkpoint import direct_io, index, storage
from llmtrain.checkpoint.interface import Checkpointing, NoCheckpoints
from llmtrain.checkpoint.shard_read import DamagedCheckpoint
from llmtrain.checkpoint.staging import ReusedBufferStager
from llmtrain.checkpoint.state import TrainState
from llmtrain.config import CheckpointConfig, ConfigError, Settings
from llmtrain.distributed.flight_recorder import pending_on
from llmtrain.distributed.group_names import OFF_THREAD
from llmtrain.events import EventLog
from llmtrain.fsio import is_local

# DCP raises CheckpointException, a BaseException: ``except Exception`` would miss it.
log = logging.getLogger(__name__)

SAVE_ERRORS = (Exception, CheckpointException)
IO_GROUP = f"{OFF_THREAD}checkpoint_io"  # the description of the writes' gloo group


class CheckpointUnreadable(RuntimeError):
    """A checkpoint could not be read for a reason that says nothing about its contents:
    the attempt fails (retryable) and the checkpoint stays committed."""


class ReadFailed(CheckpointUnreadable):
    """A read failed on some rank, every rank still there and told: they can go on
    together (read again, or pass the checkpoint over)."""


def describe(error: BaseException) -> str:
    """One line per failed rank, with the frame that raised ("rank 1: OSError: [Errno 28]
    No space left on device (at checkpoint/storage.py:198 in write_data)"), instead of
    DCP's tracebacks of every rank."""
    if isinstance(error, CheckpointException):
        text = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}{_at(frames)}"
                         for rank, (exc, frames) in sorted(error.failures.items()))
    else:
        text = f"{type(error).__name__}: {error}{_at(traceback.extract_tb(error.__traceback__))}"
    return text[:2000]


def _at(frames: traceback.StackSummary) -> str:
    """Where the innermost frame of a traceback is (file's folder and name, line, function)."""
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {'/'.join(f.filename.split('/')[-2:])}:{f.lineno} in {f.name})"


def warn(text: str) -> None:
    """A checkpoint problem that training outlives, said on stderr as well as in events:
    a run whose saves all fail must not look healthy."""
    log.warning("llmtrain: warning: %s", text)


class IndexingPlanner(DefaultSavePlanner):
    """DCP's save planner, which also keeps, on the coordinator, the items of each rank's
    own plan (before DCP gives each replicated item to one writer) and the per-rank index
    they make (``index_layout``), so that each rank of a restart reads only its own items
    (INDEX2.bin). With plan caching a rank whose plan has not changed sends none: its items
    are the last ones kept under the same cache key, and when no rank's changed, the
    layout is reused as it is (it costs O(world x items) to make). They are kept by key
    for as long as DCP keeps its plans under it (:func:`forget_plans`): kept for the
    newest key only, a second manager's save in between (the checkpoint benchmark's sync
    baseline) left the next cached save with no items to index, and every rank of a
    restart then parsed every rank's items."""

    _kept: dict[str, tuple[list, index.IndexLayout]] = {}  # by cache key

    def create_global_plan(self, all_plans):
        key = self._cached_plans_key
        needs, layout = self._kept.get(key, (None, None))
        if needs is None or any(plan.usable for plan in all_plans):
            needs = [[(w.index.fqn, None if w.index.offset is None else tuple(w.index.offset))
                      for w in plan.items] if plan.usable else needs[rank]
                     for rank, plan in enumerate(all_plans)]
            layout = index.index_layout(needs)
            IndexingPlanner._kept[key] = (needs, layout)
        self.index_layout = layout
        return super().create_global_plan(all_plans)


class Disowned(RuntimeError):
    """A file write of a save the manager let go of (:meth:`CheckpointManager.disown`)."""


class _Owned:
    """A save's fence: the job's (``fence``), and once the manager let go of the save,
    a refusal of every file it would still create, commit or remove."""

    def __init__(self, fence: Callable[[str], None], step: int):
        self.fence, self.step = fence, step
        self.disowned: str | None = None  # why the manager let go of it

    def __call__(self, what: str) -> None:
        if self.disowned is not None:
            raise Disowned(f"{what} refused: the write of checkpoint {self.step} was let go "
                           f"of ({self.disowned})")
        self.fence(what)


def forget_plans(key: str) -> None:
    """Drops what DCP's save planners and :class:`IndexingPlanner` keep under ``key``
    (O(world x items) on the coordinator), once no save will use it again."""
    IndexingPlanner._kept.pop(key, None)
    for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan,
                  SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                  SavePlanner._cached_metadata):
        cache.pop(key, None)


# the groups managers in this process were bound to, counted: each binding's plan cache key
_GROUPS_BOUND = itertools.count()


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, url: str, *, manifest_base: dict,
                 events: EventLog, device: torch.device, control_group: dist.ProcessGroup,
                 fence: Callable[[str], None] = storage.no_fence):
        """``control_group``: the training thread's gloo group for agreements."""
        self.cfg, self.url, self.events = cfg, url, events
        self.fence = fence  # asked before each file is written or removed (recovery.fence)
        self.manifest_base = manifest_base
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.generation = -1  # of the groups this manager is bound to (bind_groups)
        self.replans = 0  # saves that failed midway, agreed: each makes the plans afresh
        self.last_failed = False  # this rank's last save failed (see _why_not)
        self.bind_groups(control_group)
        self.stager = None
        if cfg.mode != "sync":
            cuda = device.type == "cuda"
            self.stager = ReusedBufferStager(cuda=cuda, share_memory=cfg.mode == "async_process",
                                             nice=cfg.writer_nice)
            if cuda and self._writes_direct():
                # the pinned staging block itself ran on an H200 (docs/gpu.md)
                events.emit_once("checkpoint_path_unproven",
                                 reason="local files written with O_DIRECT straight from the "
                                        "pinned staging block (checkpoint.direct_io) have not "
                                        "run on a GPU")
        self.inflight: Future | None = None
        self.inflight_step: int | None = None  # the step of the write in flight (or last)
        self.inflight_since_ns = 0  # when it began
        self.owned: _Owned | None = None  # its fence, which disown() closes
        self.staging: Future | None = None  # the copy of the save in flight
        self.staging_wait_s = 0.0  # how long the training thread waited for that copy
        self.last_save_time = time.monotonic()
        # By time; with auto_interval, from the measured costs (see adopt_interval).
        self.interval_seconds = cfg.interval_seconds
        self.passed_over: set[int] = set()  # unreadable steps retention has reported

    def bind_groups(self, control_group: dist.ProcessGroup) -> None:
        """Its own gloo group for DCP's I/O, and the training thread's for agreements:
        bound at start, and again in each new generation of the job's groups after a
        warm recovery. The I/O group keeps gloo's 30-minute timeout, not the job's
        collective timeout: its collectives end a background write, and the fastest
        writer waits there for the slowest (minutes on an object store at scale); a
        failed run's close does not wait for them (``close``'s bound)."""
        if self.generation >= 0:
            forget_plans(self._plans_key())
        self.io_group = dist.new_group(backend="gloo", group_desc=IO_GROUP)
        self.control_group = control_group
        self.generation = next(_GROUPS_BOUND)

    def _plans_key(self) -> str:
        return f"llmtrain-{self.world}-{self.generation}-{self.replans}"

    def planner(self) -> DefaultSavePlanner:
        """DCP's planner, caching its plans while the state's layout stays (every save of
        a run but the first sends no plan to the coordinator, which builds no global plan:
        O(world x items) at scale). The cache lives in each process, keyed here by the
        groups it was bound to, counted in the process (a trainer built anew after a
        shrink or grow counts on): after a warm recovery a new rank (a spare) has none,
        and the survivors must not send it the empty "unchanged" plans that only a
        coordinator holding their old plans can read (its metadata would lack their
        items); a new key on every rank makes every rank plan afresh once."""
        planner = IndexingPlanner(enable_plan_caching=True)
        planner._cached_plans_key = self._plans_key()
        return planner

    # -- when -------------------------------------------------------------------------

    def due(self, step: int, *, by_time: bool = False, final: bool = False) -> bool:
        """A save is due: by steps (the same on every rank), by time (as the ranks voted,
        see :mod:`llmtrain.control`), or ``final`` (the last step, or before a stop)."""
        return self._by_step(step) or by_time or final

    def _by_step(self, step: int) -> bool:
        return bool(self.cfg.interval_steps) and step % self.cfg.interval_steps == 0

    def time_due(self, step: int) -> bool:
        """This rank's clock says a save by time is due (and none by steps is now)."""
        return (bool(self.interval_seconds) and not self._by_step(step)
                and time.monotonic() - self.last_save_time >= self.interval_seconds)

    def adopt_interval(self, seconds: float, advice: dict) -> None:
        """Saves by time every ``seconds`` from now on (the interval the measured save
        cost and failure rate suggest, ``checkpoint.auto_interval``), when it differs
        from the one in force by more than a tenth."""
        old = self.interval_seconds
        if not self.cfg.auto_interval or (old and abs(seconds - old) <= 0.1 * old):
            return
        self.interval_seconds = seconds
        self.events.emit("checkpoint_interval", seconds=seconds, previous=old, **advice)

    # -- save -------------------------------------------------------------------------

    def prepare(self, state: TrainState, step: int) -> None:
        """Has the async stager make its host buffers now, beside training, so that the
        first save does not wait for them."""
        if self.stager is not None:
            self.stager.prepare(state.state_dict(step))

    def save(self, step: int, state: TrainState, *, final: bool = False,
             checked: bool = False) -> None:
        """Stages ``state`` and starts writing it; ``final`` waits for the commit.
        ``checked``: the state passed the integrity checks (retention keeps the newest
        such checkpoint whatever comes after it)."""
        busy = self.writing()
        if busy and (self.cfg.if_busy == "wait" or final):
            waited = time.perf_counter()
            self.wait()
            self.events.emit_once("checkpoint_wait", step=step,
                                  seconds=time.perf_counter() - waited)
            busy = False
        why_not = self._why_not(step, busy)
        if why_not:
            self.events.emit_once("checkpoint_skipped", step=step, reason=why_not)
            return
        self.last_save_time = time.monotonic()
        start, since_ns = time.perf_counter(), time.time_ns()
        owned = _Owned(self.fence, step)
        try:
            planner = self.planner()
            writer = storage.CommitWriter(
                storage.step_dir(self.url, step),
                {**self.manifest_base, "step": step, "world_size": self.world,
                 "integrity_checked": checked},
                thread_count=self.cfg.writer_threads, fence=owned,
                raw=self.cfg.format == "raw",
                # a sync save is the training thread's own wait: nothing to leave room for
                nice=self.cfg.writer_nice if self.cfg.mode != "sync" else 0,
                direct_io=self.cfg.direct_io, planner=planner)
            state_dict = state.state_dict(step)
            if self.cfg.mode == "sync":
                dcp.save(state_dict, storage_writer=writer, planner=planner,
                         process_group=self.io_group)
                future: Future = Future()
                future.set_result(None)
            else:
                kind = (AsyncCheckpointerType.PROCESS if self.cfg.mode == "async_process"
                        else AsyncCheckpointerType.THREAD)
                response = dcp.async_save(state_dict, storage_writer=writer,
                                          planner=planner, process_group=self.io_group,
                                          async_checkpointer_type=kind, async_stager=self.stager)
                self.stager.start()
                self.staging, future = response.staging_completion, response.upload_completion
                self.staging_wait_s = 0.0
        except SAVE_ERRORS as e:
            self._failed(step, e)
            return
        blocked = time.perf_counter() - start
        self.events.emit_once("checkpoint_staged", step=step, blocking_s=blocked)
        # ``inflight`` completes only after the bookkeeping of ``_done``, so that waiting
        # for it means the save is recorded and retention has run. A write let go of
        # (disown) records nothing when it ends: the manager has gone on without it.
        inflight = self.inflight = Future()
        self.inflight_step, self.inflight_since_ns, self.owned = step, since_ns, owned

        def finished(write: Future) -> None:
            try:
                if owned.disowned is None:
                    self._done(write, step, start, blocked)
                else:
                    log.info("the write of checkpoint %d, let go of, ended: %s", step,
                             describe(write.exception()) if write.exception() else "done")
            finally:
                inflight.set_result(None)
        future.add_done_callback(finished)
        if final:
            self.wait()

    def _writes_direct(self) -> bool:
        """Whether this job's checkpoint files go to a local disk around the page cache."""
        fs, root = fsspec.core.url_to_fs(self.url)
        return is_local(fs) and direct_io.wanted(root, self.cfg.direct_io)

    def _why_not(self, step: int, busy: bool) -> str | None:
        """Why ``step`` must not be saved (None: it may), decided by all ranks together
        (one small all-reduce a save), for a save some ranks enter and others skip would
        leave each waiting for the other: a rank's previous write still in flight
        (``if_busy = "skip"``: rank 0's ends last, after its manifest read and retention,
        seconds on an object store), a committed checkpoint of it, or a manifest that
        could not be read. Saving again would clear the step's directory first (the same
        state: training is deterministic), and a write failing midway would lose it; only
        a verified absence (no manifest, or bytes that are no manifest) says there is
        nothing to lose. Rank 0 reads the manifest."""
        found, error = 0, ""
        failed, self.last_failed = self.last_failed, False
        if self.rank == 0:
            try:
                manifest = storage.read_manifest(storage.step_dir(self.url, step))
                found = int(manifest is not None and not manifest.get("unreadable"))
            except OSError as e:  # says nothing of the checkpoint: it may be committed
                found, error = 2, describe(e)
        flags = torch.tensor([int(busy), found, int(failed)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control_group)
        if flags[2]:
            # A save that failed midway (refused by the fence while DCP planned it) leaves
            # DCP's plan cache half filled on some ranks, and the next save, sending no plan
            # where nothing changed, failed with a KeyError, as every later one did: every
            # rank plans afresh, under a new key, once any rank's save failed.
            forget_plans(self._plans_key())
            self.replans += 1
        if flags[0]:
            return "previous still writing" + ("" if busy else " on another rank")
        return {0: None, 1: "committed already (a warm recovery went back to a step before "
                            "it)",
                2: f"its manifest could not be read ({error or 'on rank 0'}): a committed "
                   f"checkpoint may be there, and saving would clear it"}[int(flags[1])]

    def _done(self, future: Future, step: int, start: float, blocked: float) -> None:
        """Runs when the background write ends, in DCP's callback, where an exception
        would reach no one: record it, then apply retention, each failure an event."""
        try:
            future.result()
        except SAVE_ERRORS as e:
            self._failed(step, e)
            return
        if self.rank != 0:
            return
        try:
            manifest = storage.read_manifest(storage.step_dir(self.url, step)) or {}
        except OSError as e:  # committed all the same: the manifest was written last
            manifest = {"unreadable": describe(e)}
        self.events.emit("checkpoint_committed", step=step, blocking_s=blocked,
                         total_s=time.perf_counter() - start, bytes=manifest.get("bytes"),
                         staging_s=self.stager and self.stager.copy_s)
        try:
            fault_points.point("retention", step)
            self.apply_retention()
        except Exception as e:  # noqa: BLE001 - a disk filling up must be seen
            self.events.emit("checkpoint_retention_failed", step=step, error=describe(e))
            warn(f"the retention pass after checkpoint {step} failed, older checkpoints "
                 f"stay: {describe(e)}")

    def _failed(self, step: int, error: BaseException) -> None:
        self.last_failed = True
        self.events.emit("checkpoint_failed", step=step, error=describe(error))
        shared = isinstance(error, CheckpointException)  # every rank has it: rank 0 says it
        if self.rank == 0 or not shared:
            warn(f"checkpoint {step} failed, training goes on and the newest committed "
                 f"checkpoint stands: {'' if shared else f'rank {self.rank}: '}"
                 f"{describe(error)}")

    def writing(self) -> bool:
        """True while a save's background write is in flight: a save due now waits for it
        (``if_busy = "wait"``), for as long as the storage takes."""
        return self.inflight is not None and not self.inflight.done()

    def staged(self) -> bool:
        """True when no save is still copying the state out (the optimizer may step)."""
        return self.staging is None or self.staging.done()

    def wait_staged(self) -> None:
        """Waits until the save in flight has its copy of the state. A failed copy is the
        save's failure, reported with it: the training thread goes on."""
        if self.staging is not None:
            start = time.perf_counter()
            futures.wait([self.staging])
            self.staging_wait_s += time.perf_counter() - start

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the write in flight (TimeoutError after ``timeout``, naming the
        checkpoint and the collective its I/O group waits in, if any)."""
        if self.inflight is None:
            return
        try:
            self.inflight.result(timeout)
        except futures.TimeoutError:
            stuck = self._pending()
            where = (f": it waits in {stuck['op']} #{stuck['seq']} on {IO_GROUP}, entered "
                     f"{(time.time_ns() - stuck['entered_ns']) / 1e9:.1f} s ago" if stuck
                     else "")
            raise TimeoutError(f"the write of checkpoint {self.inflight_step} did not end "
                               f"within {timeout:.1f} s{where}") from None

    def _pending(self) -> dict | None:
        """The I/O-group collective the write in flight waits in, if any (the flight
        recorder's; None with it off)."""
        return pending_on(IO_GROUP, self.inflight_since_ns)

    def leave(self, timeout: float, stuck_s: float) -> None:
        """Waits, as a recovery leaves the job's groups, for the write in flight, which
        may still commit (its collectives done, a rank writing or committing), up to
        ``timeout`` (then TimeoutError, as :meth:`wait`). A write still inside an I/O-group
        collective once ``stuck_s`` have passed is let go of instead (:meth:`disown`): a
        lost peer's end of it that nothing failed holds it until gloo's 30-minute
        timeout, and every survivor's recovery with it (seen in chaos runs: the others'
        writes failed at once, one rank's waited on in a gather with the dead coordinator,
        the new generation waited for that rank, and the job went cold after
        ``warm.budget_s``)."""
        if not self.writing():
            return
        end = time.monotonic() + timeout
        look = time.monotonic() + min(stuck_s, timeout)  # the first look, then every 0.1 s
        while not futures.wait([self.inflight], max(0.0, look - time.monotonic())).done:
            stuck = self._pending()
            if stuck is not None:
                self.disown(f"a recovery left the job's groups while it waited "
                            f"{(time.time_ns() - stuck['entered_ns']) / 1e9:.1f} s in "
                            f"{stuck['op']} #{stuck['seq']} on {IO_GROUP}",
                            {k: stuck[k] for k in ("pg", "seq", "op")})
                return
            if time.monotonic() >= end:
                self.wait(0)  # TimeoutError: which write, and where it is
            look = min(end, time.monotonic() + 0.1)  # it writes or commits: look again

    def disown(self, reason: str, collective: dict | None = None) -> None:
        """Lets go of the write in flight: every file it would still create, commit or
        remove is refused (so it can never mix files into a later save of the same step,
        nor commit one the job went back from), its end records nothing, the next save
        does not wait for it, and the stager makes new buffers for the next save (the
        write may still read its own). Its thread ends when its collective does (gloo's
        timeout, at worst), holding those buffers until then. A ``checkpoint_disowned``
        event says which write, why, and where it waited. A write in a separate process
        (``checkpoint.mode = async_process``) keeps the fence it was sent with: the job's
        next membership refuses it there."""
        if not self.writing():
            return
        self.owned.disowned = reason
        step, self.inflight, self.staging = self.inflight_step, None, None
        if self.stager is not None:
            self.stager.release()
        self.events.emit("checkpoint_disowned", step=step, reason=reason,
                         collective=collective)
        warn(f"checkpoint {step} is let go of, unwritten: {reason}; the newest committed "
             f"checkpoint stands")

    def apply_retention(self) -> None:
        """Removes what :func:`storage.retention_victims` retires; a checkpoint whose
        manifest cannot be read is left in place, said once a process."""
        listing = storage.list_checkpoints(self.url)
        for c in listing:
            if c.error and c.step not in self.passed_over:
                self.passed_over.add(c.step)
                self.events.emit("checkpoint_passed_over", step=c.step, tries=1, by="retention",
                                 reason=f"its manifest could not be read ({c.error}); left "
                                        f"in place")
        for c in storage.retention_victims(listing, self.cfg.keep_last, self.cfg.keep_every):
            # said first: a removal a kill cuts short (manifest gone, files left) is what
            # retention decided, and the next one finishes it as an incomplete checkpoint
            self.events.emit("checkpoint_removed", step=c.step, committed=c.committed)
            storage.remove(c.url, self.fence)

    # -- resume -----------------------------------------------------------------------

    def resume(self, state: TrainState) -> int:
        """Loads the newest committed checkpoint that verifies; returns its step (0: none).

        Every rank checks a share of the files (sizes, and the sums of whatever is not
        checked as it is loaded), and all agree before anything is unpickled. When every
        rank loads in place, each checks the sum of every item it reads, so the data is
        read once; otherwise the shares are checked whole first, then DCP's index
        (``.metadata``, which DCP's planning needs) is read through an unpickler that
        builds DCP's index classes only. Only a verified mismatch (a size, a sum, a missing
        file, an index that is not DCP's) demotes a checkpoint: it is quarantined with its
        reasons and the previous one is tried. A read error on any rank (EIO, a timeout)
        is no verdict: the checkpoint is read again ``checkpoint.read_retries`` times, then
        passed over for the previous one (an event says so) and left committed; a
        checkpoint whose manifest cannot be read is passed over at once. A peer lost
        mid-load raises CheckpointUnreadable: the attempt ends, retryable.
        """
        committed, unreadable = self._agree(self._listing)[0]
        for step, error in unreadable:
            self.events.emit_once("checkpoint_passed_over", step=step, tries=1, by="resume",
                                  reason=f"its manifest could not be read ({error})")
        self.overwritten = False  # a damaged or unreadable checkpoint was partly loaded
        for step in reversed(committed):
            for attempt in range(self.cfg.read_retries + 1):
                try:
                    loaded = self._resume_from(step, state)
                except ReadFailed as e:
                    if attempt < self.cfg.read_retries:
                        time.sleep(2 ** attempt)
                        continue
                    self.events.emit_once("checkpoint_passed_over", step=step,
                                          tries=attempt + 1, by="resume",
                                          reason=str(e)[:1000])
                    loaded = None
                break
            if loaded is not None:
                return loaded
        if self.overwritten:  # starting from step 0 needs the state as it was built
            raise CheckpointUnreadable(
                f"no checkpoint under {self.url} could be loaded, and one was partly read "
                f"into the live state (damaged ones are quarantined, unreadable ones left "
                f"committed): the next attempt starts again")
        return 0

    def _listing(self):
        """Rank 0's: the committed steps, and (step, error) of each checkpoint whose
        manifest could not be read."""
        if self.rank != 0:
            return None
        listing = storage.list_checkpoints(self.url)
        return ([c.step for c in listing if c.committed],
                [(c.step, c.error) for c in listing if c.error])

    def _resume_from(self, step: int, state: TrainState) -> int | None:
        """Verifies and loads the checkpoint of ``step``; returns its step, or None when it
        was damaged (quarantined). Raises ReadFailed on a read error on any rank."""
        url = storage.step_dir(self.url, step)
        checksums = self.cfg.verify_checksums
        part = (self.rank, self.world)

        def verify() -> list[str]:
            try:  # a rank that reads its own section of INDEX2.bin (checked against its
                own = state.has_own_section(url)  # digest) needs no index whole
            except DamagedCheckpoint as e:
                return e.problems
            return storage.verify(url, checksums=checksums, part=part, items=False,
                                  indexes=not own)
        problems = self._problems(verify, step)
        if not problems:
            in_place = all(self._agree(lambda: state.fits_in_place(url, checked=checksums),
                                       step))
            if checksums and not in_place:  # the items, before DCP reads parts of them
                problems = self._problems(lambda: storage.verify(
                    url, checksums=True, part=part, whole=False), step)
            if not in_place and not problems:  # DCP's index, refused unless it is one
                problems = self._problems(lambda: state.index_problems(url), step)
        if problems:
            self._quarantine(step, problems)
            return None
        start = time.perf_counter()

        def load():
            fault_points.point("resume", step)
            try:
                return state.load(url, threads=self.cfg.reader_threads,
                                  check=checksums and in_place)
            except DamagedCheckpoint as e:
                return e.problems
        try:
            loads = self._agree(load, step, "load failed")
        except ReadFailed:
            self.overwritten = True
            raise
        problems = [p for got in loads if isinstance(got, list) for p in got]
        if problems:
            self.overwritten = True
            self._quarantine(step, problems)
            return None
        loaded_step, missing, _ = loads[self.rank]
        self.events.emit_once(
            "checkpoint_loaded", step=loaded_step, seconds=time.perf_counter() - start,
            missing_items=missing, rng_restored="rng" not in missing,
            checked_in_load=checksums and in_place,
            planned_ranks=[r for r, (*_, planned) in enumerate(loads) if planned])
        return loaded_step

    def _problems(self, verify, step: int) -> list[str]:
        """Every rank's findings of ``verify()``, agreed."""
        return [p for rank_problems in self._agree(verify, step) for p in rank_problems]

    def _agree(self, read, step: int | None = None, what: str = "read failed") -> list:
        """Every rank's result of ``read()``; if it raised on any rank, or a rank was lost
        before saying, every rank raises CheckpointUnreadable together, instead of the
        others waiting for the failed one. A ConfigError (the run cannot go on from this
        checkpoint, the same on every rank) is raised as it is."""
        try:
            mine = (read(), None)
        except ConfigError:
            raise
        except SAVE_ERRORS as e:  # a read error is no verdict on the checkpoint
            if isinstance(e, CheckpointException) and e.failures:  # DCP's, run alone
                e = next(iter(e.failures.values()))[0]
            mine = (None, f"rank {self.rank}: {what}: {describe(e)}")
        gathered: list = [None] * self.world
        try:
            dist.all_gather_object(gathered, mine, group=self.control_group)
        except Exception as e:  # noqa: BLE001 - a peer lost: only this rank can say so
            errors = [mine[1] or f"rank {self.rank}: {what}: a peer was lost ({describe(e)})"]
            self.events.emit("checkpoint_unreadable", step=step, errors=errors)
            raise self._unreadable(step, errors) from e
        errors = [error for _, error in gathered if error]
        if errors:
            self.events.emit_once("checkpoint_unreadable", step=step, errors=errors[:20])
            raise self._unreadable(step, errors, ReadFailed)
        return [result for result, _ in gathered]

    def _unreadable(self, step: int | None, errors: list[str],
                    kind: type[CheckpointUnreadable] = CheckpointUnreadable
                    ) -> CheckpointUnreadable:
        what = "the checkpoints" if step is None else f"the checkpoint of step {step}"
        return kind(f"could not read {what} under {self.url} ({'; '.join(errors)[:1000]}); "
                    f"it stays committed")

    def _quarantine(self, step: int, problems: list[str]) -> None:
        """Rank 0 moves the checkpoint aside; if the move fails, it stays where it is
        (the others are already verifying the next one, so this must not raise)."""
        if self.rank != 0:
            return
        try:
            moved = storage.quarantine(storage.step_dir(self.url, step), problems, self.fence)
        except Exception as e:  # noqa: BLE001
            moved = f"not moved ({type(e).__name__}: {e})"
        self.events.emit("checkpoint_rejected", step=step, problems=problems[:20],
                         quarantined=moved)

    def close(self, timeout_s: float | None = None) -> None:
        """Waits for the write in flight, at most ``timeout_s`` (None: until it ends);
        one still going then is left to the process's exit (its checkpoint never
        commits: nothing committed is lost)."""
        try:
            self.wait(timeout_s)
        except (futures.TimeoutError, TimeoutError):
            self.events.emit("checkpoint_abandoned", timeout_s=timeout_s,
                             reason="the write in flight did not end before the close")
            return
        forget_plans(self._plans_key())
        if self.stager is not None:
            self.stager.close()


def checkpoints_for(settings: Settings, *, manifest: dict, events: EventLog,
                    device: torch.device, control_group: dist.ProcessGroup,
                    fence: Callable[[str], None]) -> Checkpointing:
    """The run's checkpoints, each manifest holding ``manifest`` (what the run trains:
    its config, model and mesh)."""
    if not settings.checkpoint.enable:
        return NoCheckpoints()
    return CheckpointManager(settings.checkpoint, settings.checkpoint_url, events=events,
                             device=device, control_group=control_group,
                             manifest_base=manifest, fence=fence)
