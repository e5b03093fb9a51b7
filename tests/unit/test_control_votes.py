"""The ranks' agreement on saves by time, signals, failed GPUs and stop requests: two gloo
processes, one small all-reduce about every ``control.vote_interval_s``, not every step,
with no checkpoint manager at all."""

import json
import signal
import time

import torch.distributed as dist
from ranks import spawn

from llmtrain.config import ControlConfig
from llmtrain.control import RunControl
from llmtrain.distributed.process_group import side_group
from llmtrain.events import EventLog
from llmtrain.reliability.health.monitor import NoHealthMonitor

STEPS, SIGNAL_AT = 80, 30


def _worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}.store", 2), rank=rank,
                            world_size=2)
    control = RunControl(ControlConfig(save_on_signal=False, vote_interval_s=0.1),
                         side_group(30.0, "control"), run_dir=f"{out}.run", rank=rank, host="localhost",
                         events=EventLog(f"{out}.run", rank), health=NoHealthMonitor())
    cast, stopped = [], None
    for step in range(1, STEPS + 1):
        time.sleep(0.01 * (1 + rank))  # rank 1's steps take twice as long as rank 0's
        if rank == 1 and step == SIGNAL_AT:
            control._on_signal(signal.SIGTERM, None)  # as the signal would
        verdict = control.vote(step, time_due=False)
        if control.cast and control.cast[0] == step:
            cast.append(step)
        if verdict.stop:
            stopped = step
            break
    control.close(timeout_s=5.0)
    assert control.exit_code == 75  # RETRYABLE: stopped by a signal
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"cast": cast, "stopped": stopped}, f)
    dist.destroy_process_group()


def test_ranks_vote_about_every_interval_and_act_on_a_signal_at_the_same_step(tmp_path):
    """Votes are cast at the same steps on both ranks, several steps apart (the pace of
    the faster rank, the larger proposal, sets how many: 0.1 s of 10 ms steps); rank 1's
    signal stops both ranks at the same step, within two intervals."""
    out = str(tmp_path / "votes")
    spawn(_worker, args=(out,), nprocs=2)
    r0, r1 = (json.load(open(f"{out}.{r}")) for r in (0, 1))
    assert r0 == r1, (r0, r1)
    gaps = [b - a for a, b in zip(r0["cast"], r0["cast"][1:])]
    assert max(gaps) >= 4, gaps  # every step before: 1s only
    assert len(r0["cast"]) < SIGNAL_AT / 2, r0
    assert SIGNAL_AT < r0["stopped"] <= SIGNAL_AT + 2 * max(gaps) + 1, (r0, gaps)


def _pace_worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}.store", 1), rank=0,
                            world_size=1)
    control = RunControl(ControlConfig(save_on_signal=False, vote_interval_s=0.05),
                         side_group(30.0, "control"), run_dir=f"{out}.run", rank=0, host="localhost",
                         events=EventLog(f"{out}.run", 0), health=NoHealthMonitor())
    cast, step = [], 0
    for phase, steps, sleep in (("train", 20, 0.005), ("skip", 2000, 0.0),
                                ("train", 60, 0.005)):
        for _ in range(steps):
            step += 1
            time.sleep(sleep)
            control.vote(step, time_due=False, idle=phase == "skip")
            if control.cast and control.cast[0] == step:
                cast.append(step)
    control.close(timeout_s=5.0)
    with open(out, "w") as f:
        json.dump(cast, f)
    dist.destroy_process_group()


def test_a_run_of_skipped_steps_does_not_stretch_the_vote_interval(tmp_path):
    """2000 skipped steps of microseconds between steps of at least 5 ms: the interval
    stays what 0.05 s of 5 ms steps allows (10 steps at most, fewer if the steps are
    slower), where it grew to thousands of steps, each as slow as the training ones once
    they resumed: a SIGTERM heard minutes late."""
    out = str(tmp_path / "cast")
    spawn(_pace_worker, args=(out,), nprocs=1)
    cast = json.load(open(out))
    gaps = [b - a for a, b in zip(cast, cast[1:])]
    assert max(gaps) <= 10, gaps
    assert cast[-1] > 2000 + 60 - 10, cast[-5:]  # votes went on through the training again
