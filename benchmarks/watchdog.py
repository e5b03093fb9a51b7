"""What the hang watchdog costs, and how fast it turns a hang into a report.

- ``step_time_on_over_off``: training step time with the watchdog thread running vs
  stopped, alternating segments of the same trainer in one process. Goal <= 1.01.
- a real 2-rank torchrun job per fault, at the default hang timeout (300 s, the ceiling of
  the learned one): rank 1 calls another collective than rank 0 (a desync, goal: reported
  <= 2 s after it), is SIGSTOPped (goal <= 10 s), or hangs in Python before a collective
  (goal <= 10 s); the seconds from the last progress to the detection and to the written
  report, and their ratio to the fixed timeout a watchdog without learning would wait.

    python benchmarks/watchdog.py [--segments 6] [--steps 20] [--hang-timeout S]

Prints a table, then one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from llmtrain.config import ReliabilityConfig, load_config, parse_overrides
from llmtrain.events import read_events
from llmtrain.trainer import Trainer


def step_time_segments(segments: int, steps: int) -> dict[str, list[float]]:
    cfg = load_config("debug_cpu", parse_overrides(
        ["--training.run_dir", "runs/bench_watchdog", "--training.steps", str(10**6),
         "--checkpoint.enable", "false", "--metrics.progress", "plain"]))
    trainer = Trainer(cfg)
    times: dict[str, list[float]] = {"on": [], "off": []}

    def segment(n: int) -> float:
        trainer.session.settings.steps = trainer.step + n
        start = time.perf_counter()
        trainer.run()
        return (time.perf_counter() - start) / n

    segment(5)  # warm-up
    for i in range(segments):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            if mode == "off":
                trainer.session.watchdog.close()
            times[mode].append(segment(steps))
            if mode == "off":
                trainer.session.watchdog.start()
    trainer.close()
    return times


FAULTS = {  # rank 1 of 2 at step 20, once the hang timeout has been learned
    "desync": "desync@step:rank=1,step=20",     # another collective than its peer's
    "sigstop": "sigstop@step:rank=1,step=20",   # stopped whole, watchdog thread and all
    "hang": "hang@step:rank=1,step=20",         # stuck in Python before a collective
}


def time_to_report(spec: str, hang_timeout: float | None) -> dict:
    """A real 2-rank torchrun job with the fault; seconds from the culprit's last progress
    to the watchdog's detection and to its written report."""
    run = tempfile.mkdtemp(prefix="llmtrain-bench-watchdog-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "llmtrain", "train", "--training.run_dir", run, "--training.steps", "1000",
           "--checkpoint.enable", "false", "--metrics.prometheus", "false",
           "--reliability.faults", spec]
    if hang_timeout:
        cmd += ["--reliability.hang_timeout_s", str(hang_timeout)]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline, found = time.time() + 600, []
    while not found and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
        try:
            found = read_events(run, "hang") + read_events(run, "collective_error")
        except FileNotFoundError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)  # a stopped rank would hold torchrun 30 s more
    proc.wait()
    shutil.rmtree(run)
    if not found:
        return {"detected_s": None, "reported_s": None, "verdict": "not detected"}
    [e] = found[:1]
    return {"detected_s": e["detected_after_s"], "reported_s": e["reported_after_s"],
            "verdict": e["verdict"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="steps per segment")
    parser.add_argument("--hang-timeout", type=float, default=None,
                        help="reliability.hang_timeout_s (default: the config's, 300)")
    args = parser.parse_args()

    times = step_time_segments(args.segments, args.steps)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    ceiling = args.hang_timeout or ReliabilityConfig().hang_timeout_s
    results = {name: time_to_report(spec, args.hang_timeout) for name, spec in FAULTS.items()}
    print(f"\n{'step, watchdog off / on (median ms)':<40}{off * 1e3:>10.1f}{on * 1e3:>10.1f}")
    print(f"hang timeout (ceiling of the learned one): {ceiling:.0f} s")
    print(f"{'fault':<10}{'detected s':>12}{'reported s':>12}{'vs timeout':>12}  verdict")
    for name, r in results.items():
        shown = [f"{r[k]:>12.2f}" if r[k] is not None else f"{'-':>12}"
                 for k in ("detected_s", "reported_s")]
        ratio = f"{r['reported_s'] / ceiling:>12.4f}" if r["reported_s"] else f"{'-':>12}"
        print(f"{name:<10}{''.join(shown)}{ratio}  {r['verdict'][:90]}")
    figures = {"step_time_on_over_off": round(on / off, 4),
               "step_ms_off": round(off * 1e3, 2), "step_ms_on": round(on * 1e3, 2),
               "hang_timeout_s": ceiling,
               **{f"{name}_{k}": r[k] and round(r[k], 2) for name, r in results.items()
                  for k in ("detected_s", "reported_s")}}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
