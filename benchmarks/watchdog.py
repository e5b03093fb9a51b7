"""What the hang watchdog costs, and how fast it turns a hang into a report.

- ``step_time_on_over_off``: training step time with the watchdog thread running vs
  stopped, alternating segments of the same trainer in one process. Goal <= 1.01.
- a real 2-rank torchrun job per fault, at the default hang timeout (300 s, the ceiling of
  the learned one): rank 1 calls another collective than rank 0 (a desync, goal: reported
  <= 2 s after it), is SIGSTOPped (goal <= 10 s), or hangs in Python before a collective
  (goal <= 10 s); the seconds from the last progress to the detection and to the written
  report, and their ratio to the fixed timeout a watchdog without learning would wait.

    python benchmarks/watchdog.py [--segments 6] [--steps 20] [--hang-timeout S]
        [--faults desync,sigstop,hang] [--fault-step 20]

``--segments 0`` leaves the step-time figure out; ``--faults`` picks the jobs. Every
process a job started ends with it, and with the benchmark however it ends
(benchmarks/reaper.py). Prints a table, then one JSON line of the figures.
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

from llmtrain.config import ReliabilityConfig, load_config, parse_overrides
from llmtrain.events import read_events
from llmtrain.trainer import Trainer
from reaper import end_tree, reaping


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

    try:
        segment(5)  # warm-up
        for i in range(segments):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                if mode == "off":
                    trainer.session.watchdog.close()
                times[mode].append(segment(steps))
                if mode == "off":
                    trainer.session.watchdog.start()
    finally:
        trainer.close()
    return times


FAULTS = {  # rank 1 of 2, once the hang timeout has been learned (--fault-step)
    "desync": "desync@step:rank=1,step={step}",     # another collective than its peer's
    "sigstop": "sigstop@step:rank=1,step={step}",   # stopped whole, watchdog thread and all
    "hang": "hang@step:rank=1,step={step}",         # stuck in Python before a collective
}


def time_to_report(spec: str, hang_timeout: float | None) -> dict:
    """A real 2-rank torchrun job with the fault; seconds from the culprit's last progress
    to the watchdog's detection and to its written report. The job ends once it has
    reported, or on any error or interrupt: every process of it, the stopped rank too
    (its agent, whose workers live in sessions of their own, would wait 30 s for it)."""
    run = tempfile.mkdtemp(prefix="llmtrain-bench-watchdog-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "llmtrain", "train", "--training.run_dir", run, "--training.steps", "1000",
           "--checkpoint.enable", "false", "--metrics.prometheus", "false",
           "--reliability.faults", spec]
    if hang_timeout:
        cmd += ["--reliability.hang_timeout_s", str(hang_timeout)]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # Ctrl-C reaches the benchmark alone
    try:
        deadline, found = time.time() + 600, []
        while not found and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
            try:
                found = read_events(run, "hang") + read_events(run, "collective_error")
            except FileNotFoundError:
                pass
    finally:
        end_tree(proc)
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
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help="the fault jobs to run, comma-separated")
    parser.add_argument("--fault-step", type=int, default=20,
                        help="the step each fault strikes at")
    args = parser.parse_args()
    faults = args.faults.split(",") if args.faults else []
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"--faults: unknown {sorted(unknown)}; known: {', '.join(FAULTS)}")

    figures: dict = {}
    if args.segments:
        times = step_time_segments(args.segments, args.steps)
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"\n{'step, watchdog off / on (median ms)':<40}{off * 1e3:>10.1f}"
              f"{on * 1e3:>10.1f}")
        figures.update(step_time_on_over_off=round(on / off, 4),
                       step_ms_off=round(off * 1e3, 2), step_ms_on=round(on * 1e3, 2))
    ceiling = args.hang_timeout or ReliabilityConfig().hang_timeout_s
    results = {name: time_to_report(FAULTS[name].format(step=args.fault_step),
                                    args.hang_timeout) for name in faults}
    print(f"hang timeout (ceiling of the learned one): {ceiling:.0f} s")
    print(f"{'fault':<10}{'detected s':>12}{'reported s':>12}{'vs timeout':>12}  verdict")
    for name, r in results.items():
        shown = [f"{r[k]:>12.2f}" if r[k] is not None else f"{'-':>12}"
                 for k in ("detected_s", "reported_s")]
        ratio = f"{r['reported_s'] / ceiling:>12.4f}" if r["reported_s"] else f"{'-':>12}"
        print(f"{name:<10}{''.join(shown)}{ratio}  {r['verdict'][:90]}")
    figures.update({"hang_timeout_s": ceiling,
                    **{f"{name}_{k}": r[k] and round(r[k], 2) for name, r in results.items()
                       for k in ("detected_s", "reported_s")}})
    print(json.dumps(figures))


if __name__ == "__main__":
    with reaping():
        main()
