"""The warm path's transitions that nothing broke, a grow and a preemption's shrink, on
real gloo groups and a real store: a grow voted while a checkpoint's write is still in
flight waits for a later vote instead of ending the job, a generation is left once, and
the failure watch of a generation left behind never acts on the next one. And the watch of
a generation that failed, on gloo: a rank stuck in a collective that nothing ends leaves
for a spare."""

import ctypes
import gc
import json
import os
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException

from llmtrain.config import JobConfig
from llmtrain.distributed.failure import FailureWatch
from llmtrain.distributed.flight_recorder import native_threads, pending_on
from llmtrain.distributed.process_group import WorldInfo, side_group
from llmtrain.events import EventLog
from llmtrain.exit_codes import ExitCode
from llmtrain.metrics.goodput import GoodputLedger
from llmtrain.recovery.coordinator import WarmRecovery
from llmtrain.recovery.fence import Fence
from llmtrain.recovery.interface import Resized
from llmtrain.recovery.roll_call import mark_gone
from llmtrain.recovery.warm import WarmPath, job_namespace
from llmtrain.state_registry import SchedulerState, StateRegistry
from ranks import spawn


class Saves:
    """A checkpoint manager as a transition sees it: one write, in flight until
    ``ended``."""

    def __init__(self, writing: bool):
        self.write: Future = Future()
        if not writing:
            self.ended()

    def writing(self) -> bool:
        return not self.write.done()

    def ended(self) -> None:
        if not self.write.done():
            self.write.set_result(None)


class Job:
    """The trainer's side (coordinator.Job): a small model's state, its checkpoints, and
    a leave that waits for the write in flight until the deadline, as Trainer.leave_group
    does (TimeoutError after it), counted."""

    def __init__(self, writing: bool = False, fails_to_leave: BaseException | None = None):
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        self.registry = StateRegistry()
        self.registry.bind(model, optimizer, SchedulerState(
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)))
        self.checkpoints = Saves(writing)
        self.fails_to_leave, self.left = fails_to_leave, 0

    def leave_group(self, deadline: float, stuck_s: float) -> None:
        self.left += 1
        if self.fails_to_leave is not None:
            raise self.fails_to_leave
        self.checkpoints.write.result(max(0.0, deadline - time.monotonic()))


def client(port: int) -> dist.Store:
    """A connection to the rendezvous store, in the job's namespace, as the warm path's."""
    return job_namespace(dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True,
                                       timeout=timedelta(seconds=30)), "test")


def served() -> tuple[dist.TCPStore, dist.Store]:
    """The rendezvous store, and the job's namespace in it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                           wait_for_workers=False)
    return server, job_namespace(server, "test")


def recovery(run_dir: str, store: dist.Store, rank: int, world: int,
             job: Job) -> tuple[WarmRecovery, dist.ProcessGroup]:
    """Rank ``rank``'s recovery in generation 0 of a job of one-rank nodes, started as
    the trainer starts it (its groups formed), and the generation's control group."""
    cfg = JobConfig()
    cfg.parallelism.device = "cpu"
    cfg.warm.settle_s, cfg.warm.budget_s = 0.2, 1.0
    path = WarmPath(cfg.warm, store, "round", rank, world, 1, shapes=lambda n: (n, 1))
    events = EventLog(run_dir, rank)
    rec = WarmRecovery(cfg, path, job, world=WorldInfo(rank, world, 0, "host"),
                       events=events, ledger=GoodputLedger(events, enabled=False),
                       fence=Fence(None, events, 1.0))
    rec.group_formed()
    control = side_group(30, "control")
    rec.start(0, control)
    return rec, control


def watch(rec: WarmRecovery, port: int, acted: list) -> None:
    """The generation's failure watch (the one start() arms), acting into
    ``acted``; waiting in the store once this returns."""
    rec.watch = FailureWatch(lambda: client(port), rec.path.failed_key(),
                             on_failure=lambda _: acted.append(rec.world.rank))
    time.sleep(0.2)


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for f in (run_dir / "events").glob("*.jsonl")
            for e in map(json.loads, f.read_text().splitlines()) if e["event"] == name]


def _grow_during_a_save(rank: int, port: int, run_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/pg", rank=rank,
                            world_size=2)
    store = client(port)
    job = Job(writing=rank == 1)  # rank 1's write is still going; rank 0's has ended
    rec, control = recovery(run_dir, store, rank, 2, job)
    acted: list[int] = []
    watch(rec, port, acted)
    told = {}
    for vote in ("first", "second"):
        try:
            rec.grow(5 if vote == "first" else 10)
            told[vote] = "trained on"
        except Resized as e:
            told[vote] = f"resized to {e.assignment['world_size']}"
        except TimeoutError:
            told[vote] = "TimeoutError"
        told[f"claimed after the {vote}"] = store.add("spares/claimed", 0)
        job.checkpoints.ended()
        dist.barrier(group=control)  # both ranks are past this vote
    # a worker of generation 0 said gone late (its agent saw it die after the grow)
    mark_gone(store, rank, prefix="round/g0/")
    rec.watch._thread.join(5)
    told |= {"left": job.left, "acted": acted}
    with open(f"{run_dir}/told-{rank}.json", "w") as f:
        json.dump(told, f)
    os._exit(0)


def test_a_grow_during_a_save_waits_for_a_later_vote_and_then_grows(tmp_path):
    """Every rank voted to grow while one rank's checkpoint write was still in flight:
    leaving the group then waited for it, and on slow storage raised TimeoutError past
    warm.budget_s, which the job took for its own failure and every rank exited. The grow
    waits instead, on every rank (no spare claimed, the write goes on, training goes on),
    and the next vote's grow, the write ended, leaves the group once and grows. A late mark
    of the old generation's failure then wakes no watch (its rank left it)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    server, namespace = served()
    namespace.add("spares/registered", 1)
    spawn(_grow_during_a_save, args=(server.port, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        told = json.loads((tmp_path / f"told-{rank}.json").read_text())
        assert told == {"first": "trained on", "claimed after the first": 0,
                        "second": "resized to 3", "claimed after the second": 1,
                        "left": 1, "acted": []}, rank
    (postponed,) = events(tmp_path, "grow_postponed")
    assert postponed["step"] == 5 and "write is in flight" in postponed["reason"]


def _preemption_shrink(rank: int, port: int, run_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/pg", rank=rank,
                            world_size=2)
    store = client(port)
    job = Job()
    rec, control = recovery(run_dir, store, rank, 2, job)
    acted: list[int] = []
    watch(rec, port, acted)
    told = {}
    try:
        rec.let_go(7, signalled=rank == 1, group=control)
        told["let go"] = "stops"
    except Resized as e:
        told["let go"] = f"resized to {e.assignment['world_size']}"
    dist.barrier(group=control)
    if rank == 1:  # the preempted rank exits; its agent says so, late
        mark_gone(store, 1)
    dist.barrier(group=control)
    if rank == 0:
        rec.watch._thread.join(5)
    told |= {"left": job.left, "acted": acted}
    with open(f"{run_dir}/told-{rank}.json", "w") as f:
        json.dump(told, f)
    os._exit(0)


def test_a_preempted_leavers_late_gone_mark_does_not_abort_the_shrunk_jobs_groups(tmp_path):
    """After a preemption's save, rank 1 (preempted) stops and rank 0 goes on alone. The
    agent of the leaver marks it gone in the generation it left, which sets that
    generation's ``failed``: the stayer's watch of it, left armed, aborted the shrunk
    job's new NCCL groups. Leaving a generation disarms its watch."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    server, namespace = served()
    spawn(_preemption_shrink, args=(server.port, str(tmp_path)), nprocs=2)
    stayer, leaver = (json.loads((tmp_path / f"told-{r}.json").read_text()) for r in (0, 1))
    assert namespace.check(["round/g0/failed"])  # the mark came, and woke the watch
    assert stayer == {"let go": "resized to 1", "left": 1, "acted": []}
    assert leaver["let go"] == "stops" and leaver["left"] == 0


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_generation_is_left_once_even_when_leaving_it_failed(tmp_path, one_rank):
    """Leaving the group in a grow raised (as a write that outlasted warm.budget_s did):
    the recovery that the error reaches takes it for this rank's own failure and leaves,
    but must not leave the generation a second time."""
    _, store = served()
    store.add("spares/registered", 1)
    job = Job(fails_to_leave=TimeoutError("the write outlasted warm.budget_s"))
    rec, _ = recovery(str(tmp_path), store, 0, 1, job)
    with pytest.raises(TimeoutError) as raised:
        rec.grow(3)
    assert rec.recover(raised.value, 3) is None  # the process ends with its error
    assert job.left == 1
    assert store.check(["round/g0/seen/0"])  # it said it is gone, as a local failure does


def _stuck_in_a_collective(rank: int, port: int, run_dir: str) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "200"  # before any group, as the trainer sets it
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/pg", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    # the store outside the workers, as llmtrain launch names it: start() arms the
    # generation's own failure watch on it
    os.environ |= {"LLMTRAIN_RDZV_ENDPOINT": f"127.0.0.1:{port}", "LLMTRAIN_RDZV_ID": "test"}
    rec, control = recovery(run_dir, client(port), rank, 2, Job())
    dist.barrier(group=control)
    if rank == 0:
        dist.all_reduce(torch.ones(4))  # rank 1 never joins it
        os._exit(0)  # not reached: the watch ends this process
    time.sleep(0.5)  # rank 0 waits in the collective
    (Path(run_dir) / "left.json").write_text(json.dumps(time.time()))
    rec.path.leave()  # it says it is gone, and holds its connections open
    time.sleep(20)
    os._exit(0)


def test_a_rank_stuck_in_a_collective_nothing_ends_leaves_for_a_spare(tmp_path):
    """Rank 1 says it is gone while rank 0 waits in a collective with it, and holds its
    connections open: a wait nothing ends, as gloo leaves a send that was partly written
    when its connection closed (seen in chaos runs: the TP peer of a rank whose GPU
    failed waited on, its buddy behind it, both were counted lost, and the job went
    cold). Rank 0's failure watch finds, a quarter of warm.budget_s later, its training
    thread still inside that collective, entered before the failure: it says which,
    marks the rank gone and ends the process (RETRYABLE), for a spare to take its place.
    Without it, rank 0 waits until rank 1 exits, 20 s later."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    server, namespace = served()
    with pytest.raises(ProcessExitedException) as ended:
        spawn(_stuck_in_a_collective, args=(server.port, str(tmp_path)), nprocs=2)
    assert (ended.value.error_index, ended.value.exit_code) == (0, ExitCode.RETRYABLE)
    (stuck,) = events(tmp_path, "collective_stuck")
    assert stuck["rank"] == 0 and stuck["collective"]["op"] == "gloo:all_reduce", stuck
    # where it waited, and that the peer's connections stayed open (nothing closed them)
    assert "all_reduce" in stuck["stack"].splitlines()[-2], stuck["stack"]
    assert stuck["connections"] and {c["state"] for c in stuck["connections"]} == {
        "established"}, stuck
    # gloo's loop threads watch their connections (in epoll); the training thread waits
    loops = stuck["threads"]["gloo_tcp_loop"]
    assert any("epoll" in w for w in loops) and not any("futex" in w for w in loops), loops
    left = json.loads((tmp_path / "left.json").read_text())
    assert stuck["ts"] - left < 10, stuck  # 0.5 s here: a quarter of the 1 s budget after
    assert namespace.genuine("round/g0/seen/0").startswith(b"gone-")  # counted out, at once


def _gpu_fails_mid_step(rank: int, port: int, run_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/pg", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    os.environ |= {"LLMTRAIN_RDZV_ENDPOINT": f"127.0.0.1:{port}", "LLMTRAIN_RDZV_ID": "test"}
    rec, control = recovery(run_dir, client(port), rank, 2, Job())
    rec.cfg.budget_s = 60.0  # no stuck rank may leave: what ends a wait is the test's
    rec.stuck_s = 15.0
    dist.barrier(group=control)
    grads, steps = torch.ones(1 << 20), 40  # a step's gradient all-reduces, 4 MB each
    mid_step, said = threading.Event(), threading.Event()
    if rank == 1:  # the health monitor's thread, as it sees this rank's GPU fail
        def monitor() -> None:
            mid_step.wait()
            rec.leave_early()
            said.set()
        threading.Thread(target=monitor, daemon=True).start()
    result = Path(run_dir) / f"rank{rank}.json"
    done, early_at = 0, None
    for done in range(1, steps + 1):
        dist.all_reduce(grads)
        if done == 5 and rank == 1:  # it fails here; rank 0 waits in the next one
            mid_step.set()
            early_at = done if said.wait(10) else None
    if rank == 1:  # the step's end: it leaves, and its process lives on a while
        left = time.time()
        rec.leave()
        result.write_text(json.dumps({"early_at": early_at, "done": done, "left": left}))
        other = Path(run_dir) / "rank0.json"
        deadline = time.monotonic() + 10
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    try:  # the next step's first collective, with a peer that has left
        dist.all_reduce(grads)
        failed = None
    except RuntimeError as e:
        failed = str(e)
    result.write_text(json.dumps({"done": done, "failed": failed, "at": time.time()}))
    os._exit(0)


def test_a_rank_whose_gpu_fails_mid_step_cuts_its_connections_at_the_steps_end(tmp_path):
    """On gloo, a rank whose GPU fails (the health monitor's thread sees it mid-step) says
    it is gone at once but cuts its connections only at the step's end, as it leaves:
    cut mid-step, a connection severed in the middle of a message leaves the peer's
    receive waiting until the group's timeout (seen in a TP chaos run: the failed rank's
    HSDP buddy waited in their gradient all-reduce, left as stuck, and the job went cold).
    Every all-reduce of the step then completes on both ranks, and the peer's next one
    fails at once, not when the leaver's process ends (10 s later here)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    server, _ = served()
    spawn(_gpu_fails_mid_step, args=(server.port, str(tmp_path)), nprocs=2)
    leaver = json.loads((tmp_path / "rank1.json").read_text())
    peer = json.loads((tmp_path / "rank0.json").read_text())
    assert leaver["early_at"] == 5, leaver  # it said it was gone after 5 of 40
    assert leaver["done"] == peer["done"] == 40, (leaver, peer)  # and the step completed
    assert peer["failed"] and peer["at"] - leaver["left"] < 5, (leaver, peer)


def _a_write_waiting_on_a_peer(rank: int, run_dir: str) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "200"  # before any group, as the trainer sets it
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/pg", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    io = dist.new_group(backend="gloo", group_desc="off_thread:checkpoint_io")
    if rank == 1:
        time.sleep(1.0)  # late to the write's collective
        dist.all_reduce(torch.ones(2), group=io)
        return
    write = threading.Thread(target=lambda: dist.all_reduce(torch.ones(2), group=io))
    write.start()
    time.sleep(0.5)
    waiting = pending_on("off_thread:checkpoint_io")
    assert waiting is not None and waiting["op"] == "gloo:all_reduce", waiting
    assert time.time_ns() - waiting["entered_ns"] > 0.3e9
    assert pending_on("control") is None
    write.join()
    gc.collect()  # gloo retires an entry once its work object is freed
    assert pending_on("off_thread:checkpoint_io") is None


def test_a_checkpoint_write_that_does_not_end_says_which_collective_it_waits_in(tmp_path):
    """What a leave that waited out warm.budget_s for a checkpoint's write says (seen in a
    chaos run with TP 2: a survivor's write waited in its I/O group's collective, the
    others' had failed, and the job went cold 30 s later with a bare TimeoutError): the
    write's collective, from the flight recorder, while it waits and not after."""
    spawn(_a_write_waiting_on_a_peer, args=(str(tmp_path),), nprocs=2)


def _a_write_its_peer_never_meets(rank: int, run_dir: str) -> None:
    from llmtrain.checkpoint import storage
    from llmtrain.checkpoint.manager import CheckpointManager
    from llmtrain.checkpoint.state import TrainState
    from llmtrain.config import CheckpointConfig

    go = Path(run_dir) / "go"

    def stalls(what: str) -> None:  # rank 1's storage, until rank 0 let go of its write
        while not go.exists():
            time.sleep(0.05)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "200"  # before any group, as the trainer sets it
    dist.init_process_group("gloo", init_method=f"file://{run_dir}/pg", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    job, url = Job(), f"{run_dir}/ckpt"
    state = TrainState(job.registry, rank, 2)
    manager = CheckpointManager(CheckpointConfig(mode="async_thread"), url, manifest_base={},
                                events=EventLog(run_dir, rank), device=torch.device("cpu"),
                                control_group=dist.group.WORLD,
                                fence=stalls if rank == 1 else lambda what: None)
    manager.save(1, state)
    if rank == 0:  # its write waits in the I/O group's last gather for rank 1's, which
        write = manager.inflight  # holds its connections open and does not come
        began = time.monotonic()
        try:
            manager.leave(20.0, stuck_s=0.5)
        finally:
            go.touch()  # rank 1's write goes on now, and so does the old one, to its commit
        (Path(run_dir) / "left_s").write_text(str(time.monotonic() - began))
        assert not manager.writing() and manager.staged()
        write.result(30)
        assert storage.read_manifest(storage.step_dir(url, 1)) is None  # refused
    manager.wait(30)
    manager.bind_groups(dist.group.WORLD)  # a new generation's I/O group, as a rejoin makes
    manager.save(2, state)  # the next save neither waits for the old write nor reads its
    manager.wait(30)  # buffers, and commits
    assert storage.read_manifest(storage.step_dir(url, 2)) is not None


def test_a_checkpoint_write_stuck_on_a_lost_peer_is_let_go_of_and_writes_nothing(tmp_path):
    """A recovery's leave waits for the write in flight, which may still commit; one that
    still waits in an I/O-group collective after a quarter of warm.budget_s (0.5 s here)
    is let go of (seen in chaos runs: a survivor's write waited in a gather with its dead
    coordinator that gloo never failed, the new generation waited for that survivor, and
    the job went cold 30 s later). Here rank 1's write stalls before its first file, and
    rank 0's waits in the last gather. Once let go of, its end records nothing, and when
    the collective does end (rank 1's write goes on), its commit is refused; the next
    save goes on, and commits. Without it the leave waits 20 s, and raises."""
    spawn(_a_write_its_peer_never_meets, args=(str(tmp_path),), nprocs=2)
    assert float((tmp_path / "left_s").read_text()) < 5.0
    (disowned,) = events(tmp_path, "checkpoint_disowned")
    assert disowned["rank"] == 0 and disowned["step"] == 1, disowned
    assert disowned["collective"]["pg"].endswith("off_thread:checkpoint_io"), disowned
    assert "gather" in disowned["collective"]["op"], disowned
    mine = [e["step"] for e in events(tmp_path, "checkpoint_committed")
            + events(tmp_path, "checkpoint_failed") if e["rank"] == 0]
    assert mine == [2], mine  # the old write's end recorded nothing


def test_each_native_thread_says_what_it_waits_in(one_rank):
    """What a stuck rank's event carries of its native threads: gloo's loop threads (one
    a group) waiting in epoll on their connections, and a thread blocked on a lock
    waiting on a futex, which is how a loop that stopped handling its connections shows."""
    held, named = threading.Lock(), threading.Event()
    held.acquire()

    def blocks() -> None:  # under its own native name (a thread takes its creator's, which
        ctypes.CDLL(None).prctl(15, b"held-on-a-lock", 0, 0, 0)  # xdist renames)
        named.set()
        held.acquire()
    blocked = threading.Thread(target=blocks, daemon=True)
    blocked.start()
    named.wait(5)
    time.sleep(0.2)
    threads = native_threads()
    held.release()
    blocked.join()
    assert any("epoll" in w for w in threads["gloo_tcp_loop"]), threads  # the world's
    assert not any("futex" in w for w in threads["gloo_tcp_loop"]), threads
    assert [w for w in threads["held-on-a-lock"] if "futex" in w], threads  # (PR_SET_NAME)
