"""A silent rank's process, looked at from its host: stopped, stuck, or running but starved.
Real processes (a busy loop, a sleeper, one SIGSTOPped), read through /proc."""

import os
import signal
import subprocess
import sys
import time

import pytest

from llmtrain.reliability.heartbeats import ControlPlane, World, awaited, not_arrived
from llmtrain.reliability.liveness import HOST, Liveness, process_clock
from conftest import signed_store

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")

BUSY = "import time\nwhile True: pass"
ASLEEP = "import time\ntime.sleep(600)"


@pytest.fixture
def spawn():
    procs = []

    def start(code: str) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", code]))
        time.sleep(0.3)  # (its interpreter started: some CPU time of its own)
        return procs[-1]
    yield start
    for p in procs:
        p.kill()
        p.wait()


def beat_of(pid: int, wall: float, host: str = HOST) -> dict:
    """The heartbeat ``pid`` would have sent at ``wall``: what it carries for liveness."""
    clock = process_clock(pid)
    return {"step": 3, "phase": "backward", "wall": wall, "host": host, "pid": pid,
            "start": clock.start, "cpu": clock.cpu_s, "at": None}


def test_a_busy_process_runs_and_a_stopped_one_does_not(spawn):
    busy = spawn(BUSY)
    live = Liveness(window_s=1.5)
    b = beat_of(busy.pid, time.time() - 2.0)
    time.sleep(0.2)
    assert live.running(1, b, time.time())  # its CPU grew since its beat
    os.kill(busy.pid, signal.SIGSTOP)
    time.sleep(0.1)
    assert process_clock(busy.pid).state == "T"
    assert not live.running(1, b, time.time())  # stopped: at once, whatever its CPU did
    os.kill(busy.pid, signal.SIGCONT)


def test_a_process_that_uses_no_cpu_stops_counting_as_running_after_the_window(spawn):
    """A sleeper stands for a process stuck in the kernel with nothing of it running: its
    silence is its own, once no CPU time grew for the window."""
    sleeper = spawn(ASLEEP)
    live = Liveness(window_s=0.5)
    b = beat_of(sleeper.pid, time.time() - 2.0)  # silent 2 s, no CPU since: not running
    assert not live.running(1, b, time.time())
    fresh = beat_of(sleeper.pid, time.time() - 0.2)  # within the window of its beat
    assert live.running(2, fresh, time.time())
    time.sleep(0.6)
    assert not live.running(2, fresh, time.time())  # the window passed with no CPU


def test_a_rank_elsewhere_or_a_reused_pid_cannot_be_vouched_for(spawn):
    busy = spawn(BUSY)
    live = Liveness(window_s=1.5)
    wall = time.time() - 2.0
    assert not live.running(1, beat_of(busy.pid, wall, host="another-host"), time.time())
    assert not live.running(1, {**beat_of(busy.pid, wall), "start": 1}, time.time())
    assert not live.running(1, {k: v for k, v in beat_of(busy.pid, wall).items()
                                if k != "start"}, time.time())  # a beat without it


def test_rank_0_names_a_silent_stopped_rank_and_only_notes_a_starved_one(spawn):
    """Rank 1 (a node of one with rank 0: one summary) waits inside #7; rank 0's beat is
    2 s old. Its process runs: starved, not named; stopped: named at once."""
    busy = spawn(BUSY)
    store = signed_store()
    ps = [ControlPlane(store, r, 2, 2, 1.0) for r in range(2)]
    inside = {"default_pg": [7, "gloo:all_reduce sizes=[[16]]", True, 2.5, 0.1]}

    def judged():
        last = beat_of(busy.pid, time.time() - 2.0)
        time.sleep(0.1)  # (it runs on after its beat)
        ps[0].publish(last)
        ps[1].publish({**beat_of(os.getpid(), time.time()), "at": inside})
        ps[0].summarize()
        return ps[0].world()

    world = judged()
    assert world.running == {0}
    assert awaited(world, ps[0].stale_s, 10.0) is None
    reason, ranks = awaited(world, ps[0].stale_s, 10.0, starved=True)
    assert ranks == [0] and reason.endswith("running, but starved"), reason
    os.kill(busy.pid, signal.SIGSTOP)
    time.sleep(0.1)
    world = judged()
    assert world.running == set()
    reason, ranks = awaited(world, ps[0].stale_s, 10.0)
    assert ranks == [0] and reason.endswith("stopped or frozen"), reason
    os.kill(busy.pid, signal.SIGCONT)


def test_where_a_starved_rank_said_it_was_does_not_make_it_behind():
    """Rank 2 said it waited in #6, then went silent; ranks 0 and 1 wait in #7 well past
    its usual time. Stopped, rank 2 is behind and named; seen running, it is starved: its
    position is old news, and nobody is named (unless another rank is behind with it)."""
    def world(running: set[int], also_behind: list[int] = ()) -> World:
        w = World(silent={2: (3.0, 5, "forward")}, running=running)
        w.at["default_pg", 7, "gloo:all_reduce", True].add(2, [0, 1], 4.0, 0.1)
        w.at["default_pg", 6, "gloo:all_gather", False].add(1 + len(also_behind),
                                                            [2, *also_behind], 0.0, 0.1)
        return w
    assert not_arrived(world(set()), 10.0, 3.0)[1] == [2]
    assert not_arrived(world({2}), 10.0, 3.0) is None
    assert not_arrived(world({2}, also_behind=[3]), 10.0, 3.0)[1] == [3]
