"""What the Prometheus exporter costs the training step, and what its periodic work costs.

- ``step_time_on_over_off``: training step time with the exporter on vs off, alternating
  segments of the same trainer in one process (order swapped each segment), while a
  scraper in a separate process fetches ``/metrics`` every ``--scrape-every`` seconds
  during the "on" segments. Goal <= 1.01. The ratio of medians of the segments' mean
  step times, as benchmarks/watchdog.py reports; ``step_time_on_over_off_best`` is the
  ratio of the fastest segments, which other load on a shared machine (it only adds
  time) disturbs less, while every "on" segment still holds its scrapes.

  "On" is the trainer as built: ``step_done`` every step, the EventLog listener, the
  watchdog's straggler gauges and the health monitor's pass at log steps, the goodput
  gauges, and the HTTP server answering scrapes. "Off" gives the reporter a NoExporter
  and detaches the listener (the health hook goes through the reporter), as
  ``--metrics.prometheus false`` would;
  only the idle server thread stays up. The goodput pass over the event log (every
  ``metrics.goodput_every_s`` at log steps, plus the final one each segment's ``run()``
  ends with) runs in both modes, since the trainer does it with or without the exporter.

  The scraper is a separate process, as Prometheus is: only the exporter's own work (the
  server thread rendering the registry) competes with training for the GIL. A real
  Prometheus scrapes every 15 s (monitoring/prometheus.yml); the 1 s default here is
  the conservative case.
- ``scrape_ms``: one ``/metrics`` fetch from the scraper process with training idle
  (median of ``--fetches``); ``scrape_busy_ms`` is the same during the "on" segments;
  ``render_ms`` is the server's share, ``generate_latest`` of the registry in-process.
- ``goodput_pass_ms``: one goodput pass (read what is new in the event log, account,
  advise, set the gauges), as rank 0 runs every ``metrics.goodput_every_s``, over this
  run's log; ``goodput_pass_ms_long`` is the steady pass once the log holds
  ``--long-log`` events (padded with copies of its step events, as a long run's log
  would be): the trainer follows the log incrementally and keeps only what the
  accounting reads.
- ``cpu_time_on_over_off``: the same segments' CPU time of the training process (all its
  threads, the exporter's server thread included; not the scraper's), per step: steadier
  than wall time when other jobs share the cores, though spinning threads inflate it.
- ``step_time_on_over_off_model``: the same ratio built from the exporter's measured
  costs instead of step times, for when other load swamps a 1% difference: per step
  ``step_done`` plus, every ``metrics.log_every`` steps, ``observe`` of a step event; per
  scrape interval one idle scrape's round trip (an upper bound on the server's share).

    python benchmarks/metrics.py [--segments 6] [--steps 20] [--scrape-every 1]
                                 [--fetches 50] [--long-log 100000]

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

from prometheus_client import generate_latest

from llmtrain.config import load_config, parse_overrides
from llmtrain.events import EventTail, read_events
from llmtrain.metrics import goodput
from llmtrain.metrics.prometheus import NoExporter
from llmtrain.trainer import Trainer
from reaper import reaping

# A separate process, so that its HTTP client never holds the trainer's GIL. Commands on
# stdin, one a line, each answered by one line on stdout: "on" / "off" (scrape every
# INTERVAL seconds, or not), "bench N" (N fetches back to back; their latencies), "quit"
# (the latencies of every periodic scrape, and the failures).
_SCRAPER = r"""
import json, os, select, sys, time, urllib.request
url, interval = sys.argv[1], float(sys.argv[2])
def fetch():
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as r:
        r.read()
    return (time.perf_counter() - start) * 1e3
def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n"); sys.stdout.flush()
active, next_at, periodic, failures, buf = False, 0.0, [], 0, b""
while True:
    timeout = max(0.0, next_at - time.monotonic()) if active else None
    ready, _, _ = select.select([0], [], [], timeout)
    if ready:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd = line.decode().split()
            if cmd[0] == "quit":
                reply({"periodic_ms": periodic, "failures": failures}); sys.exit(0)
            if cmd[0] == "bench":
                reply({"ms": [fetch() for _ in range(int(cmd[1]))]})
            else:
                active, next_at = cmd[0] == "on", time.monotonic()
                reply({"ok": cmd[0]})
        continue
    if active and time.monotonic() >= next_at:
        try:
            periodic.append(fetch())
        except OSError:
            failures += 1
        next_at += interval
"""


class Scraper:
    def __init__(self, url: str, every_s: float):
        self.proc = subprocess.Popen([sys.executable, "-c", _SCRAPER, url, str(every_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"scraper exited ({self.proc.wait()}) on {cmd!r}")
        return json.loads(line)

    def close(self) -> dict:
        result = self.ask("quit")
        self.proc.wait(timeout=10)
        return result


def exporter_switch(trainer: Trainer):
    """A function turning the trainer's exporter on or off, as --metrics.prometheus would
    (the health monitor's passes reach the exporter through the reporter, the goodput
    passes through its account)."""
    reporter = trainer.session.reporter
    exporter, off = reporter.exporter, NoExporter()

    def switch(on: bool) -> None:
        reporter.exporter = reporter.goodput.exporter = exporter if on else off
        if on and exporter.observe not in trainer.session.events.listeners:
            trainer.session.events.listeners.append(exporter.observe)
        if not on and exporter.observe in trainer.session.events.listeners:
            trainer.session.events.listeners.remove(exporter.observe)
    return switch


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def rank0_log(run_dir: str) -> str:
    """The event log's file of the benchmark's one process (a local run dir)."""
    return os.path.join(run_dir, "events", "rank-0.jsonl")


def long_log_pass(run_dir: str, events: int, assumed_mtbf_s: float) -> float:
    """Rank 0's periodic goodput pass once the run's log holds ``events`` lines (padded
    with copies of its step events, which the accounting does not keep): the trainer
    follows the log with an EventTail, so a pass reads only what is new, then accounts
    over the kept events."""
    with open(rank0_log(run_dir)) as f:
        lines = f.readlines()
    steps = [line for line in lines if '"event": "step"' in line]
    padded = tempfile.mkdtemp(prefix="llmtrain-bench-metrics-log-")
    try:
        pad = max(0, events - len(lines))
        os.makedirs(os.path.dirname(rank0_log(padded)))
        with open(rank0_log(padded), "w") as f:
            f.writelines(lines + [steps[i % len(steps)] for i in range(pad)])
        tail = EventTail(padded, keep=goodput.INPUTS)
        kept = tail.read()
        return median_ms(lambda: goodput.advise(
            goodput.account(kept + tail.read(), now=time.time()), assumed_mtbf_s), 5)
    finally:
        shutil.rmtree(padded, ignore_errors=True)


def measure(segments: int, steps: int, scrape_every: float, fetches: int,
            long_log: int) -> dict:
    run_dir = tempfile.mkdtemp(prefix="llmtrain-bench-metrics-")
    cfg = load_config("debug_cpu", parse_overrides(
        ["--training.run_dir", run_dir, "--training.steps", str(10**6),
         "--checkpoint.enable", "false", "--metrics.progress", "plain",
         "--metrics.prometheus", "true", "--metrics.address", "127.0.0.1",
         "--metrics.port", "0"]))
    trainer = Trainer(cfg)
    exporter = trainer.session.reporter.exporter
    switch = exporter_switch(trainer)
    scraper = Scraper(f"http://127.0.0.1:{exporter.port}/metrics", scrape_every)
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    try:
        def segment(n: int) -> tuple[float, float]:
            trainer.session.settings.steps = trainer.step + n
            start, start_cpu = time.perf_counter(), time.process_time()
            trainer.run()
            return (time.perf_counter() - start) / n, (time.process_time() - start_cpu) / n

        segment(5)  # warm-up
        for i in range(segments):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                switch(mode == "on")
                scraper.ask(mode)  # answered once the scraper is scraping (or not)
                wall, cpu_s = segment(steps)
                times[mode].append(wall)
                cpu[mode].append(cpu_s)
                scraper.ask("off")
        switch(True)

        # The exporter's periodic costs, with training idle.
        scrape = scraper.ask(f"bench {fetches}")["ms"]
        render_ms = median_ms(lambda: generate_latest(exporter.registry), fetches)

        def goodput_pass() -> None:  # the periodic (non-final) pass: emits no event
            trainer.session.reporter.goodput.account()
        goodput_ms = median_ms(goodput_pass, 20)
        step_event = read_events(run_dir, "step")[-1]
        step_done_us = median_ms(lambda: exporter.step_done(trainer.step, 0.1), 2000) * 1e3
        observe_us = median_ms(lambda: exporter.observe(step_event), 2000) * 1e3
        goodput_long_ms = long_log_pass(run_dir, long_log, cfg.metrics.assumed_mtbf_s)
        scraped = scraper.close()
        events = len(read_events(run_dir))
        log_kb = os.path.getsize(rank0_log(run_dir)) / 1024
        body_kb = len(generate_latest(exporter.registry)) / 1024
    finally:
        if scraper.proc.poll() is None:
            scraper.proc.kill()
            scraper.proc.wait()
        trainer.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"times": times, "cpu": cpu, "scrape_ms": scrape, "render_ms": render_ms,
            "goodput_ms": goodput_ms, "goodput_long_ms": goodput_long_ms,
            "step_done_us": step_done_us, "observe_us": observe_us,
            "log_every": cfg.metrics.log_every,
            "periodic_ms": scraped["periodic_ms"],
            "failures": scraped["failures"], "events": events, "log_kb": log_kb,
            "body_kb": body_kb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="steps per segment")
    parser.add_argument("--scrape-every", type=float, default=1.0,
                        help="seconds between scrapes in 'on' segments (Prometheus: 15)")
    parser.add_argument("--fetches", type=int, default=50,
                        help="back-to-back fetches timed for scrape_ms")
    parser.add_argument("--long-log", type=int, default=100_000,
                        help="events in the padded log for goodput_pass_ms_long")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    r = measure(args.segments, args.steps, args.scrape_every, args.fetches, args.long_log)
    load_after = os.getloadavg()[0]
    on, off = statistics.median(r["times"]["on"]), statistics.median(r["times"]["off"])
    on_best, off_best = min(r["times"]["on"]), min(r["times"]["off"])
    on_cpu, off_cpu = statistics.median(r["cpu"]["on"]), statistics.median(r["cpu"]["off"])
    scrape, busy = statistics.median(r["scrape_ms"]), statistics.median(r["periodic_ms"] or [0])
    per_step_s = (r["step_done_us"] + r["observe_us"] / r["log_every"]) * 1e-6
    model = (1 + per_step_s / off_best) * (1 + scrape * 1e-3 / args.scrape_every)
    print(f"\n{'measurement':<48}{'value':>12}")
    print(f"{'step, exporter off (median ms)':<48}{off * 1e3:>12.1f}")
    print(f"{'step, exporter on + scraped (median ms)':<48}{on * 1e3:>12.1f}")
    print(f"{'step time on / off (medians)':<48}{on / off:>12.4f}")
    print(f"{'step, exporter off (best segment ms)':<48}{off_best * 1e3:>12.1f}")
    print(f"{'step, exporter on + scraped (best segment ms)':<48}{on_best * 1e3:>12.1f}")
    print(f"{'step time on / off (best segments)':<48}{on_best / off_best:>12.4f}")
    print(f"{'process CPU per step, off (median ms)':<48}{off_cpu * 1e3:>12.1f}")
    print(f"{'process CPU per step, on + scraped (median ms)':<48}{on_cpu * 1e3:>12.1f}")
    print(f"{'process CPU on / off (medians)':<48}{on_cpu / off_cpu:>12.4f}")
    print(f"{'step time on / off (modeled from costs)':<48}{model:>12.4f}")
    print(f"{'segments x steps per mode':<48}{f'{args.segments} x {args.steps}':>12}")
    print(f"{'scrape interval in on segments (s)':<48}{args.scrape_every:>12.1f}")
    scrapes = f"{len(r['periodic_ms'])} ({r['failures']})"
    print(f"{'scrapes during on segments (failed)':<48}{scrapes:>12}")
    print(f"{'scrape while training (median ms)':<48}{busy:>12.2f}")
    print(f"{'scrape, training idle (median ms)':<48}{scrape:>12.2f}")
    print(f"{'render /metrics in-process (median ms)':<48}{r['render_ms']:>12.2f}")
    print(f"{'exporter.step_done (median us)':<48}{r['step_done_us']:>12.1f}")
    print(f"{'exporter.observe, step event (median us)':<48}{r['observe_us']:>12.1f}")
    print(f"{'/metrics body (KiB)':<48}{r['body_kb']:>12.1f}")
    print(f"{'goodput pass over the event log (median ms)':<48}{r['goodput_ms']:>12.2f}")
    log = f"{r['events']} / {r['log_kb']:.0f}"
    load = f"{load_before:.2f} / {load_after:.2f}"
    print(f"{'event log (events / KiB)':<48}{log:>12}")
    print(f"{f'goodput pass, {args.long_log}-event log (median ms)':<48}"
          f"{r['goodput_long_ms']:>12.1f}")
    print(f"{'1-min load average (start / end)':<48}{load:>12}")
    per_mode = "  ".join(f"{m}: " + " ".join(f"{t * 1e3:.1f}" for t in r["times"][m])
                         for m in ("off", "on"))
    print(f"per-segment mean step ms  {per_mode}")
    per_mode = "  ".join(f"{m}: " + " ".join(f"{t * 1e3:.1f}" for t in r["cpu"][m])
                         for m in ("off", "on"))
    print(f"per-segment CPU ms/step   {per_mode}")
    figures = {"step_time_on_over_off": round(on / off, 4),
               "step_ms_on": round(on * 1e3, 2), "step_ms_off": round(off * 1e3, 2),
               "step_time_on_over_off_best": round(on_best / off_best, 4),
               "step_ms_on_best": round(on_best * 1e3, 2),
               "step_ms_off_best": round(off_best * 1e3, 2),
               "cpu_time_on_over_off": round(on_cpu / off_cpu, 4),
               "cpu_ms_on": round(on_cpu * 1e3, 2), "cpu_ms_off": round(off_cpu * 1e3, 2),
               "step_time_on_over_off_model": round(model, 4),
               "step_done_us": round(r["step_done_us"], 1),
               "observe_us": round(r["observe_us"], 1),
               "scrape_ms": round(scrape, 3), "scrape_busy_ms": round(busy, 3),
               "render_ms": round(r["render_ms"], 3),
               "goodput_pass_ms": round(r["goodput_ms"], 3), "goodput_events": r["events"],
               "goodput_pass_ms_long": round(r["goodput_long_ms"], 1),
               "goodput_long_events": args.long_log,
               "scrape_every_s": args.scrape_every, "scrapes": len(r["periodic_ms"]),
               "segments": args.segments, "steps": args.steps,
               "loadavg_1m": round(load_before, 2)}
    print(json.dumps(figures))


if __name__ == "__main__":
    with reaping():
        main()
