"""Goodput: where a run's wall time went, across every restart, from the event log.

Rank 0 of each attempt (one process start of the job) records what it spent time on as
``span`` events in the event log: start-up phases, checkpoint loads and stalls, and the
productive steps in between. Reading the log back, every second of the run's wall time,
from the launcher's start to the last event, is put in exactly one category:

==================  =================================================================
productive          optimizer steps whose result survived (not redone after a failure)
startup             process start to the first step: imports, rendezvous, process
                    groups, model construction (the first step's own time is productive)
checkpoint_load     reading and verifying the checkpoint a restart resumes from
checkpoint_stall    training blocked by a save (staging, or waiting for the last write)
lost_steps          steps done, then lost and redone: after a restart, a warm recovery
                    (back to the snapshot step) or an integrity rollback
hang                last progress to the watchdog's verdict, when a hang was diagnosed
restart             the attempt's tail after its last recorded progress, then the gap
                    until the next attempt's processes start; within an attempt, the
                    last progress before a warm recovery until it restored the state
other               time inside an attempt that no span claims (shutdown, logging)
==================  =================================================================

The categories and productive time add up to the wall time by construction; ETTR (effective
training time ratio) is productive / wall. A run's ETTR is :func:`account` of its whole log:
the report and the chaos verdict state that; rank 0's ``goodput`` events and gauge are the
same account up to their moment (a finished run's last is taken before the ranks' shutdown
and the launchers' exit). The same log gives the inputs of the Young/Daly
checkpoint-interval model: the cost of one save, the cost of a restart and the observed
time between failures.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from llmtrain.events import EventLog
from llmtrain.process_origin import agent_pid, handed_over_at

CATEGORIES = ("startup", "checkpoint_load", "checkpoint_stall", "lost_steps", "hang",
              "restart", "other")
# Where pieces overlap (a save inside a productive interval), the stronger claim wins; the
# attempts' outline (hang, restart, other) ranks below every span.
_PRIORITY = {"checkpoint_stall": 6, "checkpoint_load": 5, "startup": 4, "lost_steps": 3,
             "productive": 2, "hang": 1, "restart": 1, "other": 0}


def process_start_time(pid: int | None = None) -> float:
    """The unix time a process started, from /proc (the time this code runs if unknown);
    this process's own: when it was handed its attempt, if it is a prepared worker
    (:mod:`llmtrain.process_origin`), whose imports came before the fault.

    /proc gives it in clock ticks since boot. The boot time is taken as now less the
    boot-time clock, not from /proc/stat's ``btime``: that is whole seconds, which put
    starts up to a second early (a ledger longer than the run it measured)."""
    if pid is None and (handed_over := handed_over_at()) is not None:
        return handed_over
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError):
        return time.time()


def launch_time() -> float:
    """When this attempt's job started: the torchrun agent's start if torchrun launched us
    (so the agent's own start-up counts), else this process's start."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return process_start_time(agent_pid())
    return process_start_time()


class GoodputLedger:
    """Records rank 0's spans. Other ranks hold a ledger too, which records nothing, so
    callers need no rank checks."""

    def __init__(self, events: EventLog, enabled: bool):
        self.events = events
        self.enabled = enabled
        self.productive_from: tuple[int, float] | None = None
        self._timeline: list[tuple[str, float]] = []  # start-up phases, for the console

    def phases(self) -> dict[str, float]:
        """The start-up's phases so far and their seconds, in order."""
        return dict(self._timeline)

    def attempt(self, **fields) -> None:
        if self.enabled:
            self.events.emit("attempt_start", launch=launch_time(),
                             process_start=process_start_time(), **fields)

    def launched(self, *, world_size: int, host: str, entered: float) -> None:
        """A new attempt, its launch (the agent's start, rendezvous and spawn; a
        restart's is "restart") and its imports (until ``entered``, the trainer's start)."""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.attempt(world_size=world_size, host=host, restart_count=restart)
        if not restart:
            self.record("startup", "launch", launch_time(), process_start_time())
        self.record("startup", "imports", process_start_time(), entered)

    def record(self, category: str, name: str, start: float, end: float, **fields) -> None:
        if category in ("startup", "checkpoint_load"):
            self._timeline.append((name, end - start))
        if self.enabled:
            self.events.emit("span", category=category, name=name, start=round(start, 6),
                             end=round(end, 6), **fields)

    @contextmanager
    def span(self, category: str, name: str):
        start = time.time()
        try:
            yield
        finally:
            self.record(category, name, start, time.time())

    def restart_at(self, step: int) -> None:
        """After a warm recovery back to ``step``: the steps since the last report are
        not counted productive; productive time starts again now."""
        self.productive_from = (step + 1, time.time())

    def steps_done(self, last_step: int) -> None:
        """Closes the productive span that ends at ``last_step`` and opens the next."""
        now = time.time()
        if self.productive_from is not None:
            first, start = self.productive_from
            if last_step >= first:
                self.record("productive", "steps", start, now, steps=[first, last_step])
        self.productive_from = (last_step + 1, now)


@dataclass
class Breakdown:
    wall_s: float
    productive_s: float
    badput_s: dict[str, float] = field(default_factory=dict)
    attempts: int = 0
    failures: int = 0
    save_cost_s: float | None = None     # mean training stall per checkpoint
    restart_cost_s: float | None = None  # what a failure costs besides the lost steps

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"wall_s": self.wall_s, "productive_s": self.productive_s, "ettr": self.ettr,
                "badput": self.badput_s, "attempts": self.attempts, "failures": self.failures,
                "save_cost_s": self.save_cost_s, "restart_cost_s": self.restart_cost_s}


def _attempts(events: list[dict]) -> list[list[dict]]:
    """The log cut at each attempt start; events before the first are dropped."""
    attempts: list[list[dict]] = []
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["event"] == "attempt_start":
            attempts.append([e])
        elif attempts:
            attempts[-1].append(e)
    return attempts


def _resumed_step(attempt: list[dict]) -> int:
    return next((e["step"] for e in attempt if e["event"] == "checkpoint_loaded"), 0)


def account(events: list[dict], now: float | None = None) -> Breakdown:
    """Splits the run's wall time into productive time and the badput categories.

    ``now`` ends the last attempt for a run still going (default: its last event).
    """
    attempts = _attempts(events)
    if not attempts:
        return Breakdown(wall_s=0.0, productive_s=0.0, badput_s=dict.fromkeys(CATEGORIES, 0.0))
    # (start, end, category) pieces; elementary intervals take the strongest claim.
    pieces: list[tuple[float, float, str]] = []
    for i, attempt in enumerate(attempts):
        begin = attempt[0]["launch"] if i == 0 else attempt[0]["process_start"]
        end = attempt[-1]["ts"] if i + 1 < len(attempts) else max(attempt[-1]["ts"], now or 0)
        pieces.append((begin, end, "other"))
        if i == 0:  # the launcher's and the interpreter's start-up
            pieces.append((begin, attempt[0]["process_start"], "startup"))
        spans = [e for e in attempt if e["event"] == "span"]
        redo_from = _resumed_step(attempts[i + 1]) + 1 if i + 1 < len(attempts) else math.inf
        back = restores(attempt)
        for s in spans:
            if s["category"] != "productive":
                pieces.append((s["start"], s["end"], s["category"]))
                continue
            first, last = s["steps"]
            # Steps after a later resume point (the next attempt's, or a restore's in this
            # one) were redone: prorate the span.
            back_to = min((step for t, step in back if t >= s["end"]), default=math.inf)
            kept = max(0, min(last, redo_from - 1, back_to) - first + 1) / (last - first + 1)
            cut = s["start"] + kept * (s["end"] - s["start"])
            pieces.append((s["start"], cut, "productive"))
            pieces.append((cut, s["end"], "lost_steps"))
        if i + 1 < len(attempts):
            # From the last recorded progress to the next start: the failure's cost.
            progress = max((s["end"] for s in spans), default=begin)
            verdict = _verdict(attempt, progress)
            if verdict is not None:
                pieces.append((progress, verdict, "hang"))
            pieces.append((verdict or progress, attempts[i + 1][0]["process_start"], "restart"))
        pieces += _warm_recoveries(attempt, spans)
    totals = _sweep(pieces)
    productive = totals.pop("productive", 0.0)
    stalls = [e for e in events if e["event"] == "span" and e["category"] == "checkpoint_stall"]
    saves = [e for e in events if e["event"] == "checkpoint_staged"]
    failures = len(attempts) - 1 + sum(e["event"] == "warm_recovery" for e in events)
    return Breakdown(
        wall_s=sum(totals.values()) + productive, productive_s=productive,
        badput_s={c: totals.get(c, 0.0) for c in CATEGORIES}, attempts=len(attempts),
        failures=failures,
        save_cost_s=(sum(s["end"] - s["start"] for s in stalls) / len(saves)) if saves else None,
        restart_cost_s=((totals.get("restart", 0.0) + totals.get("hang", 0.0)) / failures
                        + (totals.get("startup", 0.0) + totals.get("checkpoint_load", 0.0))
                        / len(attempts)) if failures else None)


def _restored_at(warm_recovery: dict) -> float:
    """When a warm recovery had the state back (its event comes after the first step)."""
    return warm_recovery.get("marks", {}).get("restored", warm_recovery["ts"])


def restores(events: list[dict]) -> list[tuple[float, int]]:
    """Where a run went back without a restart: (when, the step its state went back to),
    for each warm recovery and each integrity rollback to a checkpoint."""
    return [(_restored_at(e), e["step"]) if e["event"] == "warm_recovery"
            else (e["ts"], e["to_step"]) for e in events
            if e["event"] == "warm_recovery"
            or (e["event"] == "rollback" and e.get("to_step") is not None)]


def _verdict(attempt: list[dict], after: float, before: float = math.inf) -> float | None:
    """When the watchdog gave its verdict (a hang, a collective error) between the last
    progress and the recovery."""
    return next((e["ts"] for e in attempt if e["event"] in ("hang", "collective_error")
                 and after < e["ts"] < before), None)


def _warm_recoveries(attempt: list[dict], spans: list[dict]) -> list[tuple[float, float, str]]:
    """A warm recovery's cost inside its attempt: from the last progress before it to the
    watchdog's verdict (a hang), then to the state restored."""
    pieces = []
    for e in attempt:
        if e["event"] != "warm_recovery":
            continue
        restored = _restored_at(e)
        progress = max((s["end"] for s in spans if s["category"] == "productive"
                        and s["end"] <= restored), default=None)
        if progress is None:
            continue
        verdict = _verdict(attempt, progress, restored)
        if verdict is not None:
            pieces.append((progress, verdict, "hang"))
        pieces.append((verdict or progress, restored, "restart"))
    return pieces


def _sweep(pieces: list[tuple[float, float, str]]) -> dict[str, float]:
    """Seconds per category over the union of ``pieces``, overlaps to the strongest."""
    edges = sorted((t, delta, c) for a, b, c in pieces if b > a
                   for t, delta in ((a, 1), (b, -1)))
    active = dict.fromkeys(_PRIORITY, 0)
    totals: dict[str, float] = {}
    for (t, delta, c), (t_next, _, _) in zip(edges, edges[1:] + [edges[-1]]):
        active[c] += delta
        if t_next > t:
            best = max((k for k, n in active.items() if n > 0), key=_PRIORITY.get, default=None)
            if best is not None:
                totals[best] = totals.get(best, 0.0) + (t_next - t)
    return totals


@dataclass
class IntervalAdvice:
    optimal_interval_s: float
    expected_ettr: float
    save_cost_s: float
    restart_cost_s: float
    mtbf_s: float


def young_daly(save_cost_s: float, mtbf_s: float, restart_cost_s: float) -> IntervalAdvice:
    """The checkpoint interval that minimizes expected lost time, and the ETTR it gives.

    Daly's higher-order estimate of the optimum (Young's sqrt(2·C·M) plus corrections,
    valid for C < 2M), and a first-order expected waste: C/τ for saving, (τ/2 + R)/M for
    re-doing half an interval and restarting after each failure.
    """
    c, m = max(save_cost_s, 1e-6), mtbf_s
    if c < 2 * m:
        tau = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    else:
        tau = m
    return IntervalAdvice(optimal_interval_s=tau,
                          expected_ettr=expected_ettr(c, tau, m, restart_cost_s),
                          save_cost_s=save_cost_s, restart_cost_s=restart_cost_s, mtbf_s=m)


def expected_ettr(save_cost_s: float, interval_s: float, mtbf_s: float,
                  restart_cost_s: float) -> float:
    """The first-order model's ETTR for saving every ``interval_s``: C/τ is spent saving,
    and each failure (every M) costs half an interval of redone work plus the restart."""
    waste = save_cost_s / interval_s + (interval_s / 2 + restart_cost_s) / mtbf_s
    return max(0.0, 1 - waste)


def advise(b: Breakdown, assumed_mtbf_s: float = 0.0) -> IntervalAdvice | None:
    """Young/Daly advice from the run's own measurements; the observed time between
    failures when there were any, else ``assumed_mtbf_s`` (0: no advice yet)."""
    if b.save_cost_s is None:
        return None
    mtbf = b.wall_s / b.failures if b.failures else assumed_mtbf_s
    if mtbf <= 0:
        return None
    return young_daly(b.save_cost_s, mtbf, b.restart_cost_s or 0.0)


def recovery(events: list[dict], first_step_at: float) -> dict | None:
    """The last restart's timeline, as MTTR parts: from the previous attempt's last
    recorded progress to the failure's detection (a rank's collective failing, or a
    watchdog/health verdict), on to the new processes' start (rendezvous and spawn), the
    process group, the checkpoint load, and the first step at ``first_step_at``; and the
    ranks of the previous attempt that died without a word (killed, or crashed hard), with
    the nodes they ran on, and the kind of event that first said something broke.

    None when the previous attempt ended at the run's last step (its ``run_end`` is
    ``complete``): this start extends the run, and no failure came before. After one that
    ended early on an agreed stop (a failed GPU's vote, a signal, a request), it is a
    recovery."""
    attempts = _attempts(events)
    if len(attempts) < 2:
        return None
    previous, current = attempts[-2], attempts[-1]
    ends = [e for e in previous if e["event"] == "run_end"]
    if any(e.get("complete") for e in ends):
        return None
    progress = max((e["end"] for e in previous if e["event"] == "span"
                    and e["category"] != "other"), default=previous[0]["ts"])
    first = min((e for e in previous if e["event"] in _FAILURE_SIGNS and e["ts"] >= progress),
                key=lambda e: e["ts"], default=None)
    detected = first["ts"] if first else None
    spans = {e["name"]: e for e in current if e["event"] == "span"}
    marks = {"last_progress": progress, "failure_detected": detected,
             "process_start": current[0]["process_start"],
             "process_group_up": spans.get("process_group", {}).get("end"),
             "checkpoint_loaded": spans.get("resume", {}).get("end"),
             "first_step": first_step_at}
    known = [(k, v) for k, v in marks.items() if v is not None]
    # A rank that was killed or crashed says nothing; its peers report their failure.
    # Ranks that stopped together (a run_end) lost none.
    spoke = {e["rank"] for e in previous if e["event"] in _FAILURE_SIGNS}
    silent = (sorted(set(range(previous[0].get("world_size", 0))) - spoke)
              if spoke and not ends else [])
    hosts = {e["rank"]: e["host"] for e in previous if e["event"] == "startup" and e.get("host")}
    return {"marks": marks, "total_s": first_step_at - (detected or progress),
            "parts_s": {f"{a}->{b}": t1 - t0 for (a, t0), (b, t1) in zip(known, known[1:])},
            "silent_ranks": silent,
            "silent_hosts": {r: hosts[r] for r in silent if r in hosts},
            "detected_by": first["event"] if first else None}


_FAILURE_SIGNS = ("failure", "hang", "collective_error", "stop_vote", "node_excluded",
                  "preempted")
# Every event ``account`` and ``recovery`` read: a follower of the log may keep only these.
INPUTS = frozenset({"attempt_start", "span", "checkpoint_loaded", "checkpoint_staged",
                    "warm_recovery", "rollback", "run_end", "startup", *_FAILURE_SIGNS})
