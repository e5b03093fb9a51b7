import json
import math
import re
import uuid
from pathlib import Path

import fsspec
import pytest
from matplotlib.image import imread
from report_page import section

from llmtrain.chaos.timeline import measured_ettr
from llmtrain.events import read_events
from llmtrain.metrics.goodput import account
from llmtrain.report.html import Run, write_report

T0 = 1_714_000_000.0
HANG = ("rank 2 never reached gloo:all_reduce #812 (no progress for 60 s after step 45 "
        "<phase: backward>)")
FIGURES = ("loss", "throughput", "timeline", "goodput", "stragglers")


class Log:
    """A run's event log as the trainer, goodput ledger, checkpoint manager and watchdog
    write it."""

    def __init__(self, world: int = 4):
        self.world, self.t, self.records = world, T0, []

    def emit(self, event: str, rank: int | None = 0, at: float | None = None, **fields) -> None:
        ts = self.t if at is None else at
        self.records.append({"ts": round(ts, 6), "event": event, "rank": rank, **fields})

    def span(self, category: str, name: str, seconds: float, **fields) -> None:
        self.emit("span", category=category, name=name, start=self.t, end=self.t + seconds,
                  **fields)
        self.t += seconds

    def attempt(self, restart: int, host: str, resume: int = 0) -> None:
        process_start = self.t
        self.t += 1.5
        self.emit("attempt_start", launch=process_start - 2.0, process_start=process_start,
                  world_size=self.world, host=host, restart_count=restart)
        self.emit("span", category="startup", name="imports", start=process_start, end=self.t)
        for name, seconds in (("data", 0.5), ("process_group", 1.5), ("model", 3.0),
                              ("components", 0.5)):
            self.span("startup", name, seconds)
        if resume:
            self.span("checkpoint_load", "resume", 2.0)
            self.emit("checkpoint_loaded", step=resume, seconds=2.0, rng_restored=True)
        self.emit("run_start", config={"model": {"name": "debug"}, "training": {"steps": 80}},
                  world_size=self.world, params=12_500_000, device="cuda:0")

    def train(self, first: int, last: int, slow_rank: int | None = None, slow_from: int = 0,
              fail_save: int | None = None) -> None:
        """Steps first..last of about 0.5 s (0.9 s while a straggler holds everyone back),
        logged every 10, a checkpoint every 20."""
        start, begin, elapsed = self.t, first, 0.0
        for step in range(first, last + 1):
            straggling = slow_rank is not None and step >= slow_from
            seconds = 0.9 if straggling else 0.5 + 0.02 * math.sin(step)
            self.t += seconds
            elapsed += seconds
            if step % 10:
                continue
            mean, elapsed = elapsed / 10, 0.0
            slowdowns = {r: 1.8 if straggling and r == slow_rank else 1.0 + 0.002 * (r % 5)
                         for r in range(self.world)}
            self.emit("straggler_scores", step=step, ranks=self.world, collectives=100,
                      top=sorted(slowdowns.items(), key=lambda rs: -rs[1])[:8],
                      p50=1.002, p90=1.008, p99=1.8 if straggling else 1.008)
            self.emit("span", category="productive", name="steps", start=start, end=self.t,
                      steps=[begin, step])
            self.emit("step", step=step, loss=8.0 * 0.97 ** step, tokens_per_s=16384 / mean,
                      step_time_s=mean, lr=3e-4, grad_norm=1.0, mfu=0.41 * 0.5 / mean,
                      memory_gb=30.0)
            if step % 20 == 0:
                self.emit("checkpoint_staged", step=step, blocking_s=0.4)
                self.span("checkpoint_stall", f"save step {step}", 0.4)
                if step == fail_save:
                    self.emit("checkpoint_failed", step=step, at=self.t + 1.0,
                              error="OSError: [Errno 28] No space left on device")
                else:
                    self.emit("checkpoint_committed", step=step, at=self.t + 1.0, blocking_s=0.4,
                              total_s=1.4, bytes=150_000_000)
            start, begin = self.t, step + 1

    def write(self, run_dir: str) -> None:
        """One file per process, as EventLog leaves them on a disk."""
        for rank in {r["rank"] for r in self.records}:
            name = "launcher-node-a-1" if rank is None else f"rank-{rank}"
            with fsspec.open(f"{run_dir}/events/{name}.jsonl", "w", auto_mkdir=True) as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records if r["rank"] == rank)


def two_attempts_with_a_hang() -> Log:
    """Rank 2 (node-b) slows down, a save fails, rank 2 hangs; node-b is excluded and the
    job restarts on the spare node-c from the last good checkpoint."""
    log = Log()
    log.attempt(0, "node-a")
    log.emit("health", rank=1, check="ecc", severity="ok", gpu=1, message="all good",
             host="node-a")
    log.train(1, 45, slow_rank=2, slow_from=30, fail_save=40)
    for ago, slowdown in ((8, 1.6), (6, 1.8), (4, 1.7)):  # once per watchdog window
        log.emit("straggler", at=log.t - ago, straggler_rank=2, host="node-b",
                 slowdown=slowdown, collectives=40, step=40)
    log.emit("health", rank=3, at=log.t - 2, check="ecc", severity="warn", gpu=3,
             host="node-b", message="12 correctable ECC errors > threshold 10")
    log.t += 65
    log.emit("hang", id="hang-20240425-000000-abcdef", reason=HANG, verdict="rank 2 is stuck",
             culprits=[2], report="runs/x/diagnostics/hang-1/report.md", timeout_s=60,
             detected_after_s=60, reported_after_s=65)
    log.t += 8
    log.emit("node_excluded", rank=None, host="node-b", reason="straggler and ECC warnings")
    log.t += 6
    log.attempt(1, "node-a", resume=20)
    log.train(21, 80)
    log.emit("run_end", steps=80, tokens=60 * 16384, wall_s=40.0, tokens_per_s=32768.0,
             first_loss=8.0 * 0.97 ** 30, final_loss=8.0 * 0.97 ** 80, memory_gb=30.0)
    return log


def test_report_of_a_run_with_a_hang_restart_and_straggler(tmp_path):
    run_dir = tmp_path / "run"
    two_attempts_with_a_hang().write(str(run_dir))
    index = write_report(str(run_dir))
    assert index == str(run_dir / "report" / "index.html")
    page = Path(index).read_text(encoding="utf-8")

    # self-contained: every figure inline, nothing fetched from anywhere
    assert page.count('src="data:image/png;base64,') == len(FIGURES)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page)
    assert "<script" not in page and "<link" not in page

    incidents = section(page, "incidents")
    assert HANG.replace("<", "&lt;").replace(">", "&gt;") in incidents and HANG not in page
    assert "runs/x/diagnostics/hang-1/report.md" in incidents
    assert incidents.count("<td>straggler</td><td>2</td>") == 1
    assert "rank 2 on node-b is 1.6× slower than the others" in incidents
    assert "reported 3 times until" in incidents and "at worst 1.8× slower" in incidents
    assert "WARN ecc on node-b GPU 3: 12 correctable ECC errors &gt; threshold 10" in incidents
    assert "all good" not in incidents
    assert "host node-b excluded" in incidents
    assert "checkpoint of step 40 failed: OSError: [Errno 28] No space left" in incidents

    assert re.search(r"Status</th><td><span class=ok>finished", page)
    assert "<th>Attempts</th><td>2 (1 restart)</td>" in page
    assert "<th>Checkpoints committed</th><td>4 (1 failed)</td>" in page
    assert "<th>Last committed step</th><td>80</td>" in page
    assert "<th>Stragglers</th><td>rank 2 is slowest," in page
    assert re.search(r"<th>ETTR</th><td>\d+\.\d%", page) and re.search(r"lost steps \d", page)
    assert "<td>step 20</td><td>finished</td>" in section(page, "attempts")
    assert "<td>hang</td>" in section(page, "attempts")

    for name in FIGURES:
        png = run_dir / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 10_000, name
        height, width = imread(png).shape[:2]
        assert width >= 900 and height >= 250, (name, width, height)


def test_the_report_and_the_chaos_verdict_state_one_ettr(tmp_path):
    """Both account the whole log, past the trainer's last goodput event (taken before the
    ranks' shutdown and the launchers' exit): a chaos run's report said 93.4% while its
    verdict, which read that event, said 0.938."""
    log = two_attempts_with_a_hang()
    log.emit("goodput", **account(log.records, now=log.t).as_dict())
    log.span("other", "shutdown", 3.0)
    log.emit("node_exit", rank=None, at=log.t + 2.0, host="node-a", torchrun_exit=0,
             exit_code=0)
    run_dir = str(tmp_path / "run")
    log.write(run_dir)
    events = read_events(run_dir)
    ettr = measured_ettr(events, recover_s=[20.0], checkpoint_every=20)["ettr"]
    (trainers,) = [e["ettr"] for e in events if e["event"] == "goodput"]
    assert ettr == Run(run_dir, events).goodput.ettr < trainers
    page = Path(write_report(run_dir)).read_text(encoding="utf-8")
    assert f"<th>ETTR</th><td>{ettr:.1%} (" in page


def test_any_fsspec_run_dir_and_figures_without_data_are_skipped(tmp_path):
    run_dir = f"memory://runs/{uuid.uuid4().hex}"
    log = Log(world=1)
    log.attempt(0, "node-a")
    log.train(1, 30)
    log.write(run_dir)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stragglers.png").write_bytes(b"from an older report")
    try:
        index = write_report(run_dir, str(tmp_path / "out"))
    finally:
        fsspec.filesystem("memory").rm(run_dir, recursive=True)
    page = Path(index).read_text(encoding="utf-8")
    assert (tmp_path / "out" / "loss.png").exists()
    assert not (tmp_path / "out" / "stragglers.png").exists()
    assert "No figure: needs straggler_scores events (the watchdog, two or more ranks)." in page
    assert "not finished" in page and "None: no hangs" in page


def test_missing_or_empty_event_log_says_what_to_do(tmp_path):
    log = re.escape(f"{tmp_path}/events/")
    with pytest.raises(FileNotFoundError, match=rf"no event log at {log}.*training\.run_dir"):
        write_report(str(tmp_path))
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "rank-0.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=rf"{log} has no events yet"):
        write_report(str(tmp_path))


def test_straggler_windows_of_runs_before_and_after_the_event_was_bounded():
    from llmtrain.report.run import _window
    assert _window({"slowdowns": [1.0, 1.8, 1.0]}) == (3, [(0, 1.0), (1, 1.8), (2, 1.0)], 1.0)
    assert _window({"ranks": 4096, "top": [[7, 1.8]], "p50": 1.0}) == (4096, [[7, 1.8]], 1.0)
