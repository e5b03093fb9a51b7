"""Rank 0's console: a live progress bar on a terminal, plain lines in logs (Slurm, CI)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from llmtrain.config import MetricsConfig


@dataclass
class StepReport:
    step: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    lr: float
    grad_norm: float | None
    mfu: float | None
    memory_gb: float
    skipped: bool = False  # nothing trained (integrity.skip_steps): no loss, no grad norm


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def param_count(n: int) -> str:
    """A parameter count as people say it: 8.3K, 124.4M, 8.03B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


class ConsoleReporter:
    """Rank 0's lines for the people who watch the run: its start, each logged step, the
    start-up's timeline, a restart's recovery and the end."""

    def __init__(self, cfg: MetricsConfig, total_steps: int, stream: TextIO = sys.stdout):
        self.total = total_steps
        self.stream = stream
        self.bar = cfg.progress == "bar" or (cfg.progress == "auto" and stream.isatty())

    def step(self, r: StepReport) -> None:
        eta = _duration((self.total - r.step) * r.step_time_s)
        mfu = f" | mfu {r.mfu:.1%}" if r.mfu is not None else ""
        loss = "skipped, not trained" if r.skipped else f"loss {r.loss:.4f}"
        # a loop that did not say its tokens per step (RunInfo) has no throughput to show
        rate = f" | {r.tokens_per_s:,.0f} tok/s" if r.tokens_per_s else ""
        if self.bar:
            done = int(30 * r.step / self.total)
            line = (f"\r[{'#' * done}{'.' * (30 - done)}] {r.step}/{self.total} "
                    f"{loss}{rate}{mfu} | ETA {eta}  ")
            self.stream.write(line)
        else:
            gnorm = f" | gnorm {r.grad_norm:.3f}" if r.grad_norm is not None else ""
            self.stream.write(
                f"step {r.step}/{self.total} | {loss} | lr {r.lr:.2e}{gnorm}{rate} | "
                f"{r.step_time_s * 1000:.0f} ms/step{mfu} | "
                f"mem {r.memory_gb:.2f} GB | ETA {eta}\n")
        self.stream.flush()

    def run_started(self, *, model: str, params: int, world_size: int, device: str,
                    backend: str, micro_batches: int, run_dir: str, mesh: str = "") -> None:
        batches = f"{micro_batches} micro-batch(es) per step, " if micro_batches else ""
        mesh = f" (mesh {mesh})" if mesh else ""
        self.line(f"llmtrain: {model} model, {param_count(params)} params, {world_size} "
                  f"rank(s){mesh} on {device} ({backend}), {batches}run dir {run_dir}")

    def started_up(self, phases: dict[str, float], since_launch_s: float) -> None:
        """Where the start-up's time went, once the first step is done."""
        parts = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in phases.items())
        self.line(f"start-up: {parts}; first step done {since_launch_s:.1f}s after launch")

    def recovered(self, total_s: float, parts_s: dict[str, float]) -> None:
        """A cold restart's recovery and its parts."""
        self.line(f"recovered in {total_s:.1f}s from the failure: " +
                  ", ".join(f"{k} {v:.2f}s" for k, v in parts_s.items()))

    def ended(self, s) -> None:
        """The run's end (``s``: the session's Summary)."""
        if not s.trained:
            self.line(f"nothing to do: the run is already at step {s.steps} of {self.total}")
            return
        ended = ("done, stopped on request" if s.stopped else "done" if s.complete
                 else "stopped early")
        # what follows the step count is this process's share: from a resume or a join on
        since = (f" ({s.trained} trained here from step {s.steps - s.trained})"
                 if s.trained != s.steps else "")
        tokens = (f", {s.tokens / 1e6:.2f}M tokens in {s.wall_s:.1f} s "
                  f"({s.tokens_per_s:,.0f} tok/s)" if s.tokens else f" in {s.wall_s:.1f} s")
        self.line(f"{ended}: {s.steps} steps{since}{tokens}; loss {s.first_loss:.3f} -> "
                  f"{s.final_loss:.3f}; peak memory {s.memory_gb:.2f} GB per rank")

    def line(self, text: str) -> None:
        """A message that must not be overwritten by the bar."""
        self.stream.write(("\n" if self.bar else "") + text + "\n")
        self.stream.flush()
