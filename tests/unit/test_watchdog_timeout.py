import time

import torch.distributed as dist

from llmtrain.config import ReliabilityConfig
from llmtrain.reliability.watchdog import Watchdog


def test_timeout_is_fixed_or_follows_the_slowest_step(tmp_path):
    fixed = Watchdog(ReliabilityConfig(hang_timeout_s=5), dist.HashStore(), str(tmp_path),
                     events=None, rank=0, world_size=1)
    auto = Watchdog(ReliabilityConfig(hang_timeout_s=5, hang_timeout_step_factor=100),
                    dist.HashStore(), str(tmp_path), events=None, rank=0, world_size=1)
    for w in (fixed, auto):
        w.beat(1, "step")
        w.beat(2, "forward")
        time.sleep(0.08)
        w.beat(2, "step")
    assert fixed.timeout == 5
    assert 8 <= auto.timeout < 30  # 100 x the ~0.08 s step, above the 5 s floor
    assert fixed._detect() is None  # progress is fresh
    fixed.progress -= 10
    assert "made no progress for 10 s (last: step 2" in fixed._detect()


def test_long_phases_have_their_own_limit_until_the_next_step(tmp_path):
    """Start-up to the first step, and a declared long phase (resume, a blocking save),
    may go without progress for phase_timeout_s; a training phase may not."""
    w = Watchdog(ReliabilityConfig(hang_timeout_s=5, phase_timeout_s=60), dist.HashStore(),
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
    assert "made no progress for 30 s (last: forward 2" in w._detect()
    w.beat(2, "checkpoint", long=True)  # a final save
    w.progress -= 30
    assert w._detect() is None and w.progress_timeout == 60
