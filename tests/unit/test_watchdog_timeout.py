import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmtrain.config import ReliabilityConfig
from llmtrain.reliability.watchdog import Watchdog
from conftest import ROOT, events, signed_store, sigstop


def steps(w: Watchdog, n: int, seconds: float) -> None:
    for i in range(n):
        w.beat(i, "forward")
        time.sleep(seconds)
        w.beat(i, "step")


def test_the_timeout_is_learned_from_the_pace_within_floor_and_ceiling(tmp_path):
    """hang_timeout_s until 3 steps are seen (the first, start-up's, does not count), then
    10x the slowest recent step, but never under the floor nor over hang_timeout_s."""
    def watchdog(**cfg) -> Watchdog:
        return Watchdog(ReliabilityConfig(**cfg), signed_store(), str(tmp_path),
                        events=None, rank=0, world_size=1)
    fixed, learned = watchdog(hang_timeout_step_factor=0), watchdog(hang_timeout_floor_s=0.1)
    capped = watchdog(hang_timeout_s=0.2, hang_timeout_floor_s=0.1)
    floored = watchdog(hang_timeout_floor_s=5)
    for w in (fixed, learned, capped, floored):
        steps(w, 3, 0.02)
        assert w.timeout == w.cfg.hang_timeout_s  # not yet learned
        steps(w, 1, 0.02)
    assert fixed.timeout == 300 and floored.timeout == 5 and capped.timeout == 0.2
    assert 0.2 <= learned.timeout < 3  # 10 x a ~0.02 s step, on a loaded machine too
    assert fixed._detect() is None  # progress is fresh
    fixed.progress -= 400
    assert "(last: step 0; hang timeout 300 s)" in fixed._detect()[1]


def test_long_phases_have_their_own_limit_until_the_next_step(tmp_path):
    """Start-up to the first step, and a declared long phase (resume, a blocking save),
    may go without progress for phase_timeout_s; a training phase may not."""
    w = Watchdog(ReliabilityConfig(hang_timeout_s=5, phase_timeout_s=60), signed_store(),
                 str(tmp_path), events=None, rank=0, world_size=1)
    assert w.progress_timeout == 60 and w.timeout == 5  # start-up; silent heartbeats: 5 s
    w.beat(0, "resume", long=True)
    w.progress -= 30
    assert w._detect() is None
    w.beat(1, "forward")  # the first step, possibly compiling, still under the long limit
    assert w.progress_timeout == 60
    w.beat(1, "step")
    assert w.progress_timeout == 5
    w.beat(2, "forward")
    w.progress -= 30
    assert "made no progress for 30 s (last: forward 2" in w._detect()[1]
    w.beat(2, "checkpoint", long=True)  # a final save
    w.progress -= 30
    assert w._detect() is None and w.progress_timeout == 60


def test_a_store_slow_at_every_request_never_hides_a_ranks_own_hang(tmp_path):
    """A store answer slower than a heartbeat interval makes peers' silences count from its
    end; this rank's own lack of progress counts from then only after a pause of its own,
    or a stall longer than half the hang timeout (which may hide one)."""
    w = Watchdog(ReliabilityConfig(hang_timeout_s=5, hang_timeout_step_factor=0),
                 signed_store(), str(tmp_path), events=None, rank=0, world_size=1)
    steps(w, 4, 0.0)
    w.progress -= 10
    for _ in range(3):
        w._judge_from_now(stalled_s=1.2)  # slow, not long: again and again
        assert "made no progress for 10 s" in w._detect()[1]
    w._judge_from_now(stalled_s=3.0)
    assert w._detect() is None
    w.progress -= 10
    w._judged_from -= 10
    assert w._detect()[0] == "hang"
    w._judge_from_now()  # a pause of this process
    assert w._detect() is None


def test_waiting_for_a_peer_in_a_declared_long_phase_is_no_hang(tmp_path):
    store = signed_store()
    w = Watchdog(ReliabilityConfig(hang_timeout_s=5, phase_timeout_s=60), store,
                 str(tmp_path), events=None, rank=1, world_size=2)
    peer = Watchdog(ReliabilityConfig(hang_timeout_s=5, phase_timeout_s=60), store,
                    str(tmp_path), events=None, rank=0, world_size=2)
    w.beat(1, "step")
    peer.beat(1, "step")
    peer.beat(1, "events", long=True)  # rank 0 reads the event log
    peer._tick()
    w.progress -= 10
    assert w._detect() is None
    peer.beat(2, "step")
    peer._tick()
    assert w._detect()[0] == "hang"


def test_a_silent_peer_is_no_hang_while_this_rank_recovers_it_warm(tmp_path):
    """Rank 1 watches rank 0's heartbeat; while rank 1 is in a warm recovery, rank 0's
    silence is what it recovers from (the spare taking its place may be slow to beat)."""
    store = signed_store()
    cfg = ReliabilityConfig(hang_timeout_s=5, phase_timeout_s=60, heartbeat_interval_s=0.1)
    w = Watchdog(cfg, store, str(tmp_path), events=None, rank=1, world_size=2)
    peer = Watchdog(cfg, store, str(tmp_path), events=None, rank=0, world_size=2)
    for watchdog in (w, peer):
        watchdog.beat(1, "step")
    peer._tick()
    published = json.loads(store.get("hb/0"))
    store.set("hb/0", json.dumps({**published, "wall": published["wall"] - 10}))
    w.plane.since_ns -= 20 * 10**9  # rank 1 has watched for longer than that silence
    assert "rank 0 sent no heartbeat for 10 s" in w._detect()[1]
    w.beat(1, "recover", long=True)
    assert w._detect() is None
    w.beat(2, "step")
    assert w._detect()[0] == "hang"


def test_a_generations_first_step_is_a_long_phase_so_no_peer_names_it_not_arrived(tmp_path):
    """After a warm recovery a rank's first step plans and runs things for the first time
    and may take seconds: as from start-up, it publishes no collective position (nothing
    of it for the not-arrived rule to name), it counts in the store's long phases (its
    peers' waiting for it is no hang), and its own limit is phase_timeout_s, until that
    step ends. Its heartbeat's silence is still judged against the hang timeout."""
    store = signed_store()
    cfg = ReliabilityConfig(hang_timeout_s=5, phase_timeout_s=60, heartbeat_interval_s=0.1)
    w = Watchdog(cfg, store, str(tmp_path), events=None, rank=1, world_size=2)
    peer = Watchdog(cfg, store, str(tmp_path), events=None, rank=0, world_size=2)
    steps(w, 4, 0.01)
    w.beat(4, "backward")
    w.progress -= 1  # waiting in a collective, long past the usual gaps: quiet
    assert w.quiet and w.progress_timeout == 5
    w.new_generation()
    assert not w.quiet and w.progress_timeout == 60
    w._tick()
    assert json.loads(store.get("hb/1"))["at"] is None
    assert peer._peer_in_long_phase(10.0)
    w.beat(5, "forward")  # the generation's first step: still long
    assert w.progress_timeout == 60
    w.beat(5, "step")
    w._tick()
    assert w.progress_timeout == 5 and not peer._peer_in_long_phase(10.0)


GENERATIONS = """
import json, sys, time
import torch, torch.distributed as dist
from llmtrain.config import ReliabilityConfig
from llmtrain.reliability.watchdog import Watchdog
sys.path.insert(0, "tests")
from conftest import signed_store
w = Watchdog(ReliabilityConfig(), signed_store(), sys.argv[1], events=None, rank=0,
             world_size=1)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(3):
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()  # a warm recovery: the world destroyed, then formed again
w.new_generation()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(2):
    dist.all_reduce(torch.ones(4))
print(json.dumps(w._recorder()["entries"]))
"""


def test_a_generations_dump_holds_none_of_the_generations_before(tmp_path):
    """The flight recorder outlives the groups: a survivor of a warm recovery still holds
    the old generation's entries, under the same group names and ids (torch numbers its
    groups from 0 again), with higher sequence numbers. Dumped with the new ones, they
    made the analysis merge groups of other members (a stopped TP rank's data-parallel
    peer, blocked behind it, was blamed and the job went cold) and made the old
    collective the rank's newest. The watchdog dumps this generation's only."""
    proc = subprocess.run([sys.executable, "-c", GENERATIONS, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TORCH_FR_BUFFER_SIZE": "64"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [e["collective_seq_id"] for e in entries] == [1, 2], entries


def _beating_rank(rank: int, port: int, run_dir: str) -> None:
    """A rank whose training thread ends a step every 0.1 s and whose watchdog judges
    through the store at ``port``; a hang it would declare is written to
    ``declared-<rank>``."""
    import torch.distributed as dist

    from llmtrain.events import EventLog
    store = signed_store(dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True))
    dog = Watchdog(ReliabilityConfig(hang_timeout_s=2.5, heartbeat_interval_s=0.25), store,
                   run_dir, EventLog(run_dir, rank), rank=rank, world_size=2)
    dog._declare = lambda reason, kind="hang": Path(run_dir, f"declared-{rank}").write_text(
        reason)
    dog.start()
    for step in itertools.count():
        dog.beat(step, "step")
        time.sleep(0.1)


def test_a_pause_of_the_whole_machine_longer_than_the_hang_timeout_is_no_hang(tmp_path):
    """Both ranks' processes stop (SIGSTOP, as a VM's snapshot or live migration stops a
    machine) for longer than the hang timeout; rank 1 runs again first, rank 0 a moment
    later. Nobody made progress meanwhile, and nobody may be named for it: each watchdog
    sees that its own process did not run and judges nothing of that time. (A 29 s pause
    of a test machine had both ranks of a healthy job named hung, and it restarted cold.)"""
    import torch.distributed as dist
    from ranks import start

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          use_libuv=True)
    procs = start(_beating_rank, (store.port, str(tmp_path)), nprocs=2)
    try:
        deadline = time.monotonic() + 60
        while not all(store.check([f"hb/{r}"]) for r in range(2)):
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs)
            time.sleep(0.1)
        time.sleep(1.5)  # both beat, each watchdog has judged the other alive
        for p in procs:
            sigstop(p.pid)
        time.sleep(3.5)  # past the hang timeout (2.5 s)
        os.kill(procs[1].pid, signal.SIGCONT)
        time.sleep(0.8)  # rank 1 reads rank 0's beat, 4.3 s old
        os.kill(procs[0].pid, signal.SIGCONT)
        # each says its pause once its watchdog thread runs again (late, on a loaded
        # machine: CI once killed the ranks 2 s on, before rank 0's had said it), and
        # names nobody meanwhile
        deadline = time.monotonic() + 30
        while len({e["rank"] for e in events(tmp_path, "process_paused")}) < 2:
            assert time.monotonic() < deadline, events(tmp_path, "process_paused")
            time.sleep(0.1)
        time.sleep(2)
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert not list(tmp_path.glob("declared-*")), [
        p.read_text() for p in tmp_path.glob("declared-*")]
    paused = events(tmp_path, "process_paused")
    assert sorted(e["rank"] for e in paused) == [0, 1], paused
    assert all(e["seconds"] > 3 for e in paused), paused
