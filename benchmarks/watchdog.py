"""What the hang watchdog costs, and how fast it turns a hang into a report.

- ``step_time_on_over_off``: training step time with the watchdog thread running vs
  stopped, alternating segments of the same trainer in one process. Goal <= 1.01.
- ``report_over_timeout``: a real 2-rank torchrun job whose rank 1 hangs in Python at step
  6; the time from its last progress to the written report, over the hang timeout.
  Goal <= 1.2. ``detect_over_timeout`` is the same up to the detection alone.

    python benchmarks/watchdog.py [--segments 6] [--steps 20] [--hang-timeout 10]

Prints a table, then one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from llmtrain.config import load_config, parse_overrides
from llmtrain.events import read_events
from llmtrain.trainer import Trainer


def step_time_segments(segments: int, steps: int) -> dict[str, list[float]]:
    cfg = load_config("debug_cpu", parse_overrides(
        ["--training.run_dir", "runs/bench_watchdog", "--training.steps", str(10**6),
         "--checkpoint.enable", "false", "--metrics.progress", "plain"]))
    trainer = Trainer(cfg)
    times: dict[str, list[float]] = {"on": [], "off": []}

    def segment(n: int) -> float:
        trainer.cfg.training.steps = trainer.step + n
        start = time.perf_counter()
        trainer.run()
        return (time.perf_counter() - start) / n

    segment(5)  # warm-up
    for i in range(segments):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            if mode == "off":
                trainer.watchdog.close()
            times[mode].append(segment(steps))
            if mode == "off":
                trainer.watchdog.start()
    trainer.close()
    return times


def time_to_report(hang_timeout: float) -> dict[str, float]:
    run = tempfile.mkdtemp(prefix="llmtrain-bench-watchdog-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "llmtrain", "train", "--training.run_dir", run, "--training.steps", "1000",
           "--checkpoint.enable", "false", "--reliability.hang_timeout_s", str(hang_timeout),
           "--reliability.faults", "hang@step:rank=1,step=6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, capture_output=True, timeout=hang_timeout * 10 + 120)
    [hang] = read_events(run, "hang")
    shutil.rmtree(run)
    return {"detected_s": hang["detected_after_s"], "reported_s": hang["reported_after_s"],
            "verdict": hang["verdict"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="steps per segment")
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    args = parser.parse_args()

    times = step_time_segments(args.segments, args.steps)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    hang = time_to_report(args.hang_timeout)
    print(f"\n{'measurement':<40}{'value':>12}")
    print(f"{'step, watchdog off (median ms)':<40}{off * 1e3:>12.1f}")
    print(f"{'step, watchdog on (median ms)':<40}{on * 1e3:>12.1f}")
    print(f"{'hang timeout (s)':<40}{args.hang_timeout:>12.1f}")
    print(f"{'hang -> detected (s)':<40}{hang['detected_s']:>12.2f}")
    print(f"{'hang -> report written (s)':<40}{hang['reported_s']:>12.2f}")
    print(f"verdict: {hang['verdict']}")
    figures = {"step_time_on_over_off": round(on / off, 4),
               "report_over_timeout": round(hang["reported_s"] / args.hang_timeout, 3),
               "detect_over_timeout": round(hang["detected_s"] / args.hang_timeout, 3),
               "step_ms_off": round(off * 1e3, 2), "step_ms_on": round(on * 1e3, 2),
               "hang_timeout_s": args.hang_timeout}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
