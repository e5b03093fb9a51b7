"""The event log of one run, sorted by time and indexed the ways the report reads it: its
attempts (process starts), where each rank ran, the job's size over time, and the
straggler windows."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from llmtrain.metrics import goodput

Event = dict[str, Any]

NOTICEABLY_SLOWER = 1.1  # a slowdown against the other ranks that the report calls out
EVERY_RANK_UP_TO = 8  # a job this small has a heatmap row per rank, not only the slowest
WARM_CHANGES = ("warm_recovery", "warm_grow")  # a new generation of the running job


@dataclass
class Attempt:
    """One start of the run's processes, until its last event."""
    index: int
    start: float
    end: float
    record: Event  # its attempt_start event: world size, rank 0's host


class Run:
    """The event log sorted by time and indexed the ways the report reads it."""

    def __init__(self, run_dir: str, events: list[Event]):
        self.dir = run_dir
        self.events = sorted(events, key=lambda e: e["ts"])
        self.of: dict[str, list[Event]] = defaultdict(list)
        for e in self.events:
            self.of[e["event"]].append(e)
        # A run whose trainer never started (every node failed the gate) has only the
        # launchers' events: one attempt, from the first of them.
        starts = self.of["attempt_start"] or self.events[:1]
        self.starts = [s["ts"] for s in starts]
        times = [e["ts"] for e in self.events]
        self.attempts = []
        for i, s in enumerate(starts):
            # As the goodput ledger counts it: the first attempt from the launcher's start,
            # a restart from its processes' start.
            begin = s.get("launch" if i == 0 else "process_start") or s["ts"]
            stop = bisect_left(times, self.starts[i + 1]) if i + 1 < len(starts) else len(times)
            self.attempts.append(Attempt(i, begin, times[max(stop - 1, 0)], s))
        self.t0 = min(times[0], self.attempts[0].start)
        self.t_end = times[-1]
        span = self.t_end - self.t0
        self.unit_s, self.unit = (3600, "h") if span > 3 * 3600 else (
            (60, "min") if span > 180 else (1, "s"))
        self.goodput = goodput.account(self.events)

    def attempt_of(self, ts: float) -> int:
        return max(bisect_right(self.starts, ts) - 1, 0)

    def by_attempt(self, events: list[Event]) -> dict[int, list[Event]]:
        groups: dict[int, list[Event]] = defaultdict(list)
        for e in events:
            groups[self.attempt_of(e["ts"])].append(e)
        return groups

    def x(self, ts: float) -> float:
        """A timestamp on the figures' time axis."""
        return (ts - self.t0) / self.unit_s

    @cached_property
    def warm_changes(self) -> list[Event]:
        """The warm recoveries (a spare in a lost rank's place, or a shrink) and grows, in
        order: each began a new generation of the running job, without a restart."""
        return [e for e in self.events if e["event"] in WARM_CHANGES]

    @cached_property
    def placements(self) -> list[tuple[float, int, str]]:
        """(when, rank, host): where each rank ran, from each process's start-up report
        (a warm spare's and a resized job's ranks report theirs too) and rank 0's attempt
        start."""
        seen = [(e["ts"], e["rank"], e["host"]) for e in self.of["startup"]
                if e.get("host") and e.get("rank") is not None]
        seen += [(e["ts"], 0, e["host"]) for e in self.of["attempt_start"] if e.get("host")]
        return sorted(seen)

    def host_before(self, rank: int, ts: float) -> str | None:
        """The host that last ran ``rank`` before ``ts``."""
        hosts = [h for t, r, h in self.placements if r == rank and t < ts]
        return hosts[-1] if hosts else None

    def host_after(self, rank: int, ts: float) -> str | None:
        """The first host to run ``rank`` after ``ts``."""
        return next((h for t, r, h in self.placements if r == rank and t > ts), None)

    @cached_property
    def world_sizes(self) -> list[tuple[float, int]]:
        """(from when, ranks): the job's size at each attempt's start and after each warm
        shrink or grow (from when its state was back)."""
        sizes = [(a.start, a.record["world_size"]) for a in self.attempts
                 if a.record.get("world_size")]
        sizes += [(e.get("marks", {}).get("restored", e["ts"]), e["world_size"])
                  for e in self.warm_changes if e.get("world_size")]
        if not sizes and self.of["run_start"]:
            sizes = [(self.t0, self.of["run_start"][0]["world_size"])]
        return sorted(sizes)

    def world_size_at(self, ts: float) -> int | None:
        """The job's size just before ``ts``."""
        before = [n for t, n in self.world_sizes if t < ts]
        return before[-1] if before else None

    @cached_property
    def straggler_spells(self) -> list[list[Event]]:
        """Straggler events grouped per attempt and rank: the watchdog repeats one every
        window for as long as the rank stays slow."""
        spells: dict[tuple[int, Any], list[Event]] = defaultdict(list)
        for e in self.of["straggler"]:
            spells[self.attempt_of(e["ts"]), e.get("straggler_rank")].append(e)
        return list(spells.values())

    @cached_property
    def ratios(self) -> RankRatios | None:
        """The slowdown in every straggler window of each rank that was ever among the
        slowest (the watchdog's estimate from when ranks reached their collectives, about 1
        for a rank nobody waits for), at the window's median where it was not among them
        (the event names only the slowest); a job of up to ``EVERY_RANK_UP_TO`` ranks has
        a row for each. None without a window, or for a run that never had two ranks. (A
        window may compare fewer ranks than the job has: one node's arrivals missing just
        after a warm recovery.)"""
        records = self.of["straggler_scores"]
        windows = [_window(e) for e in records]
        world = max([n for _, n in self.world_sizes] + [count for count, _, _ in windows],
                    default=0)
        if not records or world < 2:
            return None
        columns = [(self.attempt_of(e["ts"]), e["step"]) for e in records]
        ranks = sorted({r for _, top, _ in windows for r, _ in top}
                       | set(range(world if world <= EVERY_RANK_UP_TO else 0)))
        row = {r: i for i, r in enumerate(ranks)}
        scores = np.empty((len(ranks), len(columns)))
        for j, (_, top, median) in enumerate(windows):
            scores[:, j] = median
            for r, slowdown in top:
                scores[row[r], j] = slowdown
        return RankRatios(columns, ranks, scores)


def _window(e: Event) -> tuple[int, list, float]:
    """A ``straggler_scores`` event's ranks, slowest ranks and median; the events of runs
    before it was bounded carried every rank's slowdown."""
    if "slowdowns" in e:
        return len(e["slowdowns"]), list(enumerate(e["slowdowns"])), float(
            np.median(e["slowdowns"]))
    return e["ranks"], e["top"], e["p50"]


@dataclass
class RankRatios:
    """Ranks' slowdown against the others: one row per rank of ``ranks``, one column per
    straggler window in order (with the step it ended at)."""
    columns: list[tuple[int, int]]  # (attempt, step)
    ranks: list[int]
    ratio: np.ndarray

    @property
    def slowest_row(self) -> int:
        """Slowest on average: one noisy interval does not make a straggler."""
        return int(np.nanargmax(np.nanmean(self.ratio, axis=1)))

    @property
    def straggling(self) -> bool:
        return bool(np.nanmax(self.ratio[self.slowest_row]) >= NOTICEABLY_SLOWER)

    def describe(self) -> str:
        """The slowest rank in words; a straggler lasting only a few intervals still shows
        in its worst one."""
        if not self.straggling:
            return (f"no straggler: every rank within {NOTICEABLY_SLOWER - 1:.0%} of the "
                    f"others in every window")
        row = self.slowest_row
        worst = int(np.nanargmax(self.ratio[row]))
        return (f"rank {self.ranks[row]} is slowest, {np.nanmean(self.ratio[row]):.2f}× slower "
                f"than the others on average, {self.ratio[row, worst]:.2f}× at worst (step "
                f"{self.columns[worst][1]})")
