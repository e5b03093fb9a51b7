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
