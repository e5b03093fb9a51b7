"""``llmtrain report``: one HTML page, plus PNG figures, that tells a run's story from its
event log.

People take in a picture of a run faster than its logs: whether training was healthy (loss,
throughput), where the wall time went (timeline, goodput), what went wrong (incidents) and
which rank held the others back (straggler heatmap). The page embeds its figures, so it is
one file that can be mailed or attached to an incident ticket; the PNGs are written beside
it for slides and chat.
"""

from __future__ import annotations

import base64
import html
import io
import os
import statistics
import time
import zlib
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import fsspec
import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm, to_rgb
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter

from llmtrain.events import read_events
from llmtrain.fsio import is_local, join
from llmtrain.metrics import goodput

Event = dict[str, Any]

STYLE = {"font.size": 9, "axes.titlesize": 11, "axes.titlelocation": "left",
         "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
         "grid.color": "#e8e8e8", "legend.frameon": False, "axes.axisbelow": True,
         "figure.dpi": 120}
ATTEMPT_COLORS = ["#1f4e79", "#00838f", "#6d4c41", "#5e35b1", "#827717", "#ad1457", "#37474f"]
CATEGORY_COLORS = {"productive": "#43a047", "startup": "#90caf9", "checkpoint_load": "#b39ddb",
                   "checkpoint_stall": "#ffb300", "lost_steps": "#f48fb1", "hang": "#e53935",
                   "restart": "#9e9e9e", "other": "#dddddd"}
OTHER_COLORS = ["#bcaaa4", "#80cbc4", "#e6ee9c", "#ffcc80"]
COMMIT_COLOR = "#2e7d32"
HEALTH_COLORS = {"unknown": "#8c8c8c", "warn": "#f9a825", "fatal": "#c62828"}
NOTICEABLY_SLOWER = 1.1  # a slowdown against the other ranks that the report calls out
INCIDENTS = ("hang", "collective_error", "straggler", "preempted", "checkpoint_failed",
             "checkpoint_rejected", "health", "node_excluded")


def write_report(run_dir: str, out_dir: str | None = None) -> str:
    """Writes ``index.html`` and one PNG per figure into ``out_dir``; returns the HTML's path.

    ``out_dir`` defaults to ``<run_dir>/report`` when the run dir is local, and to
    ``./report-<run name>`` when it is on remote storage (the report is always written
    locally, where a browser can open it).
    """
    run = Run(run_dir, _load(run_dir))
    out = out_dir or _default_out_dir(run_dir)
    os.makedirs(out, exist_ok=True)
    sections = []
    with matplotlib.rc_context(STYLE):
        for name, title, caption, build in FIGURES:
            path = os.path.join(out, f"{name}.png")
            fig = build(run)
            if isinstance(fig, str):  # no data for it: say why, and drop an older report's PNG
                sections.append(f"<h2>{title}</h2>\n<p class=missing>No figure: "
                                f"{html.escape(fig)}.</p>")
                if os.path.exists(path):
                    os.remove(path)
                continue
            buf = io.BytesIO()
            FigureCanvasAgg(fig).print_png(buf)
            with open(path, "wb") as f:
                f.write(buf.getvalue())
            data = base64.b64encode(buf.getvalue()).decode()
            sections.append(f"<h2>{title}</h2>\n<figure><img alt=\"{title}\" "
                            f"src=\"data:image/png;base64,{data}\">\n"
                            f"<figcaption>{caption}</figcaption></figure>")
    index = os.path.join(out, "index.html")
    with open(index, "w", encoding="utf-8") as f:
        f.write(_page(run, sections))
    return index


def _load(run_dir: str) -> list[Event]:
    """The events, or an error that says what to check instead of a parser's traceback."""
    url = join(run_dir, "events/")
    try:
        events = read_events(run_dir)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no event log at {url}: {run_dir} is not a run directory, or its run has not "
            f"started yet. Pass the run's training.run_dir (the directory that holds "
            f"events/ and checkpoints/).") from None
    if not events:
        raise ValueError(f"{url} has no events yet: the run has not logged anything. Run the "
                         f"report again once training has started, or check that {run_dir} "
                         f"is the run you mean.")
    return events


def _default_out_dir(run_dir: str) -> str:
    fs, path = fsspec.core.url_to_fs(run_dir)
    if is_local(fs):
        return os.path.join(path, "report")
    return f"report-{os.path.basename(path.rstrip('/')) or 'run'}"


# -- the log, indexed ------------------------------------------------------------------------


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
        (the event names only the slowest); None with fewer than two ranks."""
        records = self.of["straggler_scores"]
        windows = [_window(e) for e in records]
        if not records or max(count for count, _, _ in windows) < 2:
            return None
        columns = [(self.attempt_of(e["ts"]), e["step"]) for e in records]
        ranks = sorted({r for _, top, _ in windows for r, _ in top})
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


# -- figures: each returns the figure, or why there is none ---------------------------------


def _per_attempt(ax: Axes, run: Run, x: Callable[[Event], float], y: str) -> None:
    """Field ``y`` of the step events, one line per attempt so that a restart's repeated
    steps stay apart, and the committed checkpoints as dotted lines at ``x``."""
    for i, group in sorted(run.by_attempt(run.of["step"]).items()):
        ax.plot([x(e) for e in group], [e[y] for e in group], lw=1.6,
                marker="o" if len(group) < 30 else None, ms=3,
                color=_attempt_color(i), label=f"attempt {i}")
    for j, c in enumerate(run.of["checkpoint_committed"]):
        ax.axvline(x(c), color=COMMIT_COLOR, lw=1.0, ls=":", zorder=1,
                   label="checkpoint committed" if j == 0 else None)
    ax.grid(axis="x", visible=False)  # the dotted lines are the checkpoints


def _loss(run: Run) -> Figure | str:
    if not run.of["step"]:
        return "the log has no step events (rank 0 writes one every metrics.log_every steps)"
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.add_subplot()
    _per_attempt(ax, run, lambda e: e["step"], "loss")
    ax.set(xlabel="step", ylabel="loss", title="Training loss")
    ax.legend(loc="upper right")
    return fig


def _throughput(run: Run) -> Figure | str:
    steps = run.of["step"]
    if not steps:
        return "the log has no step events"
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.add_subplot()
    _per_attempt(ax, run, lambda e: run.x(e["ts"]), "tokens_per_s")
    median = statistics.median(e["tokens_per_s"] for e in steps)
    ax.axhline(median, color="#616161", lw=0.9, ls="--", label=f"median {median:,.0f} tok/s")
    ratios = [e["mfu"] / e["tokens_per_s"] for e in steps if e.get("mfu") and e["tokens_per_s"]]
    if ratios:  # MFU is proportional to tokens/s: the same curve read on a second scale
        k = statistics.median(ratios)
        ax.secondary_yaxis("right", functions=(lambda t: 100 * k * t, lambda m: m / (100 * k))
                           ).set_ylabel("MFU (%)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, run.x(run.t_end))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set(xlabel=f"wall time since the first event ({run.unit})", ylabel="tokens/s",
           title="Throughput")
    ax.legend(loc="lower right")
    return fig


def _timeline(run: Run) -> Figure | str:
    of = run.of
    lanes = ["attempts"]
    lanes += ["phases"] if of["span"] else []
    lanes += ["checkpoints"] if any(of[k] for k in ("checkpoint_committed", "checkpoint_failed",
                                                    "checkpoint_loaded",
                                                    "checkpoint_rejected")) else []
    lanes += ["incidents"] if any(of[k] for k in ("hang", "collective_error", "straggler",
                                                  "preempted")) else []
    health = [e for e in of["health"] if e.get("severity") != "ok"] + of["node_excluded"]
    lanes += ["health"] if health else []
    y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    fig = Figure(figsize=(10, 1.4 + 0.6 * len(lanes)), layout="constrained")
    ax = fig.add_subplot()
    width = run.x(run.t_end) or 1.0

    def bar(lane: str, start: float, end: float, color: str, label: str | None = None,
            height: float = 0.7, **kw: Any) -> None:
        ax.broken_barh([(run.x(start), run.x(end) - run.x(start))],
                       (y[lane] - height / 2, height), color=color, label=label, **kw)

    def mark(lane: str, events: list[Event], marker: str, color: str, label: str,
             text: Callable[[Event], str] | None = None) -> None:
        if not events:
            return
        ax.scatter([run.x(e["ts"]) for e in events], [y[lane]] * len(events), marker=marker,
                   s=60, color=color, edgecolor="white", linewidth=0.6, zorder=3, label=label)
        for j, e in enumerate(events if text else []):
            ax.annotate(text(e), (run.x(e["ts"]), y[lane]), xytext=(0, 9 if j % 2 else -14),
                        textcoords="offset points", ha="center", fontsize=7, color=color)

    for a in run.attempts:
        bar("attempts", a.start, a.end, _attempt_color(a.index))
        if run.x(a.end) - run.x(a.start) > 0.06 * width:
            ax.text((run.x(a.start) + run.x(a.end)) / 2, y["attempts"], f"attempt {a.index}",
                    ha="center", va="center", color="white", fontsize=8, fontweight="bold")
    by_category: dict[str, list[Event]] = defaultdict(list)
    for s in of["span"]:
        by_category[s["category"]].append(s)
    for category, spans in sorted(by_category.items()):
        ax.broken_barh([(run.x(s["start"]), (s["end"] - s["start"]) / run.unit_s) for s in spans],
                       (y["phases"] - 0.35, 0.7), color=_category_color(category),
                       label=category.replace("_", " "))
    if "checkpoints" in y:
        few = len(of["checkpoint_committed"]) <= 12
        mark("checkpoints", of["checkpoint_committed"], "^", COMMIT_COLOR, "checkpoint committed",
             (lambda e: str(e["step"])) if few else None)
        mark("checkpoints", of["checkpoint_loaded"], "D", "#7e57c2", "checkpoint loaded",
             lambda e: f"load {e['step']}")
        mark("checkpoints", of["checkpoint_failed"] + of["checkpoint_rejected"], "X", "#c62828",
             "checkpoint failed/rejected", lambda e: str(e["step"]))
    if "incidents" in y:
        for e in of["hang"] + of["collective_error"]:
            if e.get("reported_after_s"):  # from the last progress until the report
                bar("incidents", e["ts"] - e["reported_after_s"], e["ts"], "#ef9a9a",
                    "stalled until reported", height=0.4)
        mark("incidents", of["hang"] + of["collective_error"], "X", "#c62828",
             "hang / collective error", lambda e: e["event"].replace("collective_", ""))
        firsts = [spell[0] for spell in run.straggler_spells]
        mark("incidents", of["straggler"], "v", "#ef6c00", "straggler",
             lambda e: f"rank {e.get('straggler_rank')}" if any(e is f for f in firsts) else "")
        mark("incidents", of["preempted"], "s", "#6a1b9a", "preempted")
    for severity, color in HEALTH_COLORS.items():
        mark("health", [e for e in of["health"] if e.get("severity") == severity], "o", color,
             f"health {severity}")
    if of["node_excluded"]:
        mark("health", of["node_excluded"], "X", "#212121", "node excluded",
             lambda e: str(e.get("host")))
    ax.set_yticks(list(y.values()), list(y))
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlim(0, width * 1.01)
    ax.grid(axis="y", visible=False)
    ax.spines["left"].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.set(xlabel=f"wall time since the first event ({run.unit})", title="Timeline")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(handles), 5),
                   fontsize=8)
    return fig


def _goodput_figure(run: Run) -> Figure | str:
    g = run.goodput
    if g.wall_s <= 0:
        return "the log has no attempt_start events to measure the wall time from"
    parts = [("productive", g.productive_s), *_badput(g)]
    total = sum(v for _, v in parts)
    fig = Figure(figsize=(9, 2.4), layout="constrained")
    ax = fig.add_subplot()
    left = 0.0
    for name, seconds in parts:
        share = seconds / total
        ax.barh(0, seconds / run.unit_s, left=left / run.unit_s, height=0.6,
                color=_category_color(name), edgecolor="white", linewidth=1,
                label=f"{name.replace('_', ' ')}: {_duration(seconds)} ({share:.1%})")
        if share > 0.07:
            ax.text((left + seconds / 2) / run.unit_s, 0, f"{share:.0%}", ha="center",
                    va="center", color=_ink(_category_color(name)), fontsize=9,
                    fontweight="bold")
        left += seconds
    ax.set_xlim(0, total / run.unit_s)
    ax.set_yticks([])
    ax.grid(axis="y", visible=False)
    ax.spines["left"].set_visible(False)
    ax.set(xlabel=f"wall time ({run.unit})", title=f"Goodput: ETTR {g.ettr:.1%}, "
           f"{_duration(g.productive_s)} productive of {_duration(g.wall_s)}")
    fig.legend(loc="outside lower center", ncols=min(len(parts), 3), fontsize=8)
    return fig


def _stragglers(run: Run) -> Figure | str:
    found = run.ratios
    if found is None:
        return "needs straggler_scores events (the watchdog, two or more ranks)"
    ratio = found.ratio
    world = ratio.shape[0]
    top = max(float(np.nanmax(ratio)), 1.25)
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="#d9d9d9")
    fig = Figure(figsize=(10, min(1.6 + 0.28 * world, 8)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(ratio, aspect="auto", interpolation="nearest", cmap=cmap,
                      norm=LogNorm(vmin=1 / top, vmax=top))
    bar = fig.colorbar(image, ax=ax, pad=0.01, label="slowdown against the other ranks")
    ticks = [t for t in (0.5, 0.8, 1, 1.25, 1.5, 2, 3, 5, 10) if 1 / top <= t <= top]
    bar.ax.yaxis.set_major_locator(FixedLocator(ticks))
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    bar.ax.yaxis.set_minor_locator(FixedLocator([]))
    n = len(found.columns)
    cols = sorted({int(round(c)) for c in np.linspace(0, n - 1, min(n, 12))})
    ax.set_xticks(cols, [str(found.columns[c][1]) for c in cols])
    for j in range(1, n):  # a restart: the steps after it may repeat earlier ones
        if found.columns[j][0] != found.columns[j - 1][0]:
            ax.axvline(j - 0.5, color="black", lw=1.5)
            ax.annotate(f"attempt {found.columns[j][0]}", (j - 0.5, 1), xytext=(3, -4),
                        textcoords="offset points", xycoords=("data", "axes fraction"),
                        va="top", fontsize=8,
                        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none",
                              "alpha": 0.85})
    slow = found.slowest_row
    rows = range(world) if world <= 32 else [t for t in ax.get_yticks() if 0 <= t < world]
    rows = sorted({int(t) for t in rows} | {slow})
    ax.set_yticks(rows, [str(found.ranks[i]) for i in rows])
    if found.straggling:  # one red row among many needs a pointer
        label = ax.get_yticklabels()[rows.index(slow)]
        label.set(color="#c62828", fontweight="bold")
    ax.grid(False)
    ax.set(xlabel="step", ylabel="rank", title=f"Per-rank slowdown: {found.describe()}")
    return fig


FIGURES: list[tuple[str, str, str, Callable[[Run], Figure | str]]] = [
    ("loss", "Loss", "Loss at each logged step, one colour per attempt; after a restart the "
     "curve picks up from the checkpoint the attempt resumed from (dotted lines: committed "
     "checkpoints).", _loss),
    ("throughput", "Throughput", "Tokens per second over wall time, one colour per attempt; "
     "gaps are restarts, dips at the dotted lines are checkpoint stalls.", _throughput),
    ("timeline", "Timeline", "Where the wall time went: each attempt, the phases rank 0 "
     "measured, checkpoints, hangs, stragglers and health events.", _timeline),
    ("goodput", "Goodput", "Productive time against each kind of lost time (badput) over "
     "the whole run, restarts included; ETTR is the productive share.", _goodput_figure),
    ("stragglers", "Stragglers", "Each rank's slowdown against the others in each watchdog "
     "window, from when ranks reached their collectives (1×: nobody waits for it): red is "
     "slower, grey not reported. A red row is a straggler.",
     _stragglers),
]


# -- the page -------------------------------------------------------------------------------


CSS = """
body{font:15px/1.45 -apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:#222;
     max-width:1100px;margin:2em auto;padding:0 1.2em}
h1{font-size:1.6em;margin:0 0 .1em} h2{font-size:1.2em;margin:1.8em 0 .4em;
     border-bottom:1px solid #ddd;padding-bottom:.2em}
.sub{color:#666;margin:0 0 1.2em}
table{border-collapse:collapse;margin:.4em 0 1em;font-size:.93em}
th,td{padding:.3em .8em;border-bottom:1px solid #e6e6e6;text-align:left;vertical-align:top}
thead th{background:#f4f4f4}
table.summary th{font-weight:600;color:#444;width:15em}
tr.bad td{background:#fdecea} tr.warn td{background:#fff5e0}
.ok{color:#1b5e20;font-weight:600} .notok{color:#b71c1c;font-weight:600}
td.wrap{max-width:40em;word-break:break-word}
figure{margin:.4em 0 1em} img{max-width:100%}
figcaption{color:#555;font-size:.9em}
.missing{color:#777;font-style:italic}
"""


def _page(run: Run, sections: list[str]) -> str:
    name = html.escape(os.path.basename(run.dir.rstrip("/")) or run.dir)
    generated = f"generated {_utc(time.time())} from {len(run.events)} events"
    summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>\n"
                      for k, v in _summary(run))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>llmtrain report: {name}</title>
<style>{CSS}</style></head>
<body>
<h1>Run report: {name}</h1>
<p class=sub>{html.escape(run.dir)} &middot; {generated}</p>
<table class=summary>
{summary}</table>
<h2 id=incidents>Incidents</h2>
{_incidents_table(run)}
<h2 id=attempts>Attempts</h2>
{_attempts_table(run)}
{chr(10).join(sections)}
</body></html>
"""


def _summary(run: Run) -> list[tuple[str, str]]:
    """(label, HTML) rows; every value from the log is escaped here."""
    of, esc = run.of, html.escape
    start = of["run_start"][-1] if of["run_start"] else {}
    end = of["run_end"][-1] if of["run_end"] else None
    finished = end is not None and run.attempt_of(end["ts"]) == len(run.attempts) - 1
    stopped = " (stopped on request)" if finished and end.get("stopped") else ""
    status = (f"<span class=ok>finished</span>{stopped}" if finished else
              f"<span class=notok>not finished</span>: last event {esc(run.events[-1]['event'])}"
              f" at {_utc(run.t_end)}, {_duration(time.time() - run.t_end)} ago")
    rows = [("Status", status)]
    config = start.get("config") or {}
    if start:
        model = (config.get("model") or {}).get("name", "model")
        rows.append(("Model", esc(f"{model}, {start.get('params', 0) / 1e6:,.1f}M params, "
                                  f"{start.get('world_size')} ranks on "
                                  f"{str(start.get('device', '?')).split(':')[0]}")))
    steps = of["step"]
    total = (config.get("training") or {}).get("steps")
    last = end["steps"] if finished else (steps[-1]["step"] if steps else None)
    of_total = f" of {total:,}" if total else ""
    rows.append(("Steps", "-" if last is None else f"{last:,}{of_total}"))
    if steps:
        final = end["final_loss"] if finished else steps[-1]["loss"]
        rows.append(("Final loss", f"{final:.4f} (first logged: {steps[0]['loss']:.4f})"))
        mfus = [e["mfu"] for e in steps if e.get("mfu") is not None]
        mfu = f", MFU {statistics.median(mfus):.1%}" if mfus else ""
        rows.append(("Throughput", f"{statistics.median(e['tokens_per_s'] for e in steps):,.0f}"
                                   f" tokens/s{mfu} (median over logged intervals)"))
    rows.append(("Wall time", _duration(run.t_end - run.t0)))
    n = len(run.attempts)
    rows.append(("Attempts", f"{n} ({n - 1} restart{'s' * (n != 2)})"))
    rows.append(("Hangs / collective errors", str(len(of["hang"]) + len(of["collective_error"]))))
    committed = of["checkpoint_committed"]
    failed = len(of["checkpoint_failed"])
    rows.append(("Checkpoints committed", f"{len(committed)}" + (f" ({failed} failed)" if failed
                                                                  else "")))
    rows.append(("Last committed step", str(committed[-1]["step"]) if committed else "none"))
    g = run.goodput
    if g.wall_s > 0:
        rows.append(("ETTR", f"{g.ettr:.1%} ({_duration(g.productive_s)} productive of "
                             f"{_duration(g.wall_s)})"))
        rows.append(("Badput", ", ".join(f"{esc(k.replace('_', ' '))} {_duration(v)} "
                                         f"({v / g.wall_s:.1%})" for k, v in _badput(g))
                     or "none"))
    advice = goodput.advise(g, (config.get("metrics") or {}).get("assumed_mtbf_s", 0.0))
    if advice:
        rows.append(("Checkpoint interval advice",
                     f"every {_duration(advice.optimal_interval_s)} for an expected ETTR of "
                     f"{advice.expected_ettr:.1%} (Young/Daly: {_duration(advice.save_cost_s)} "
                     f"per save, {_duration(advice.restart_cost_s)} per restart, "
                     f"{_duration(advice.mtbf_s)} between failures)"))
    if run.ratios is not None:
        rows.append(("Stragglers", run.ratios.describe()))
    return rows


def _attempts_table(run: Run) -> str:
    rows = []
    groups = run.by_attempt(run.events)
    for a in run.attempts:
        kinds = {e["event"]: e for e in groups[a.index]}
        loaded = kinds.get("checkpoint_loaded")
        if "run_end" in kinds:  # a preemption's agreed save ends with one too
            ended = ("stopped on request" if kinds["run_end"].get("stopped") else
                     "preempted" if "preempted" in kinds else "finished")
        elif ender := next((kinds[k] for k in ("hang", "collective_error", "preempted")
                            if k in kinds), None):
            ended = ender["event"].replace("_", " ")
        elif a.index == len(run.attempts) - 1:
            ended = "still running, or died without logging why"
        else:
            ended = "died without logging why (no hang or preemption recorded)"
        host = f"{a.record['host']} (rank 0)" if a.record.get("host") else ""
        cells = [str(a.index), _utc(a.start), f"+{_duration(a.start - run.t0)}",
                 _duration(a.end - a.start), str(a.record.get("world_size", "")), host,
                 f"step {loaded['step']}" if loaded else "-", ended]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = ("attempt", "started (UTC)", "after first event", "ran for", "ranks", "host",
            "resumed from", "ended by")
    return _table(head, rows)


def _incidents_table(run: Run) -> str:
    spells = {id(spell[0]): spell for spell in run.straggler_spells}
    rows = []
    for e in run.events:
        if e["event"] not in INCIDENTS or (e["event"] == "health" and e.get("severity") == "ok"):
            continue
        if e["event"] == "straggler" and id(e) not in spells:
            continue  # a repeat, counted in its spell's first row
        rank, text, level = _incident(e)
        if len(spells.get(id(e), [])) > 1:
            spell = spells[id(e)]
            text += (f"; reported {len(spell)} times until {_utc(spell[-1]['ts'])}, at worst "
                     f"{max(s.get('slowdown') or 0 for s in spell)}× slower")
        cells = [_utc(e["ts"]), f"+{_duration(e['ts'] - run.t0)}", e["event"].replace("_", " "),
                 rank]
        rows.append(f"<tr class={level}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
                    + f"<td class=wrap>{html.escape(text)}</td></tr>")
    if not rows:
        return "<p>None: no hangs, collective errors, stragglers, preemptions, checkpoint " \
               "failures or health problems were logged.</p>"
    return _table(("at (UTC)", "after first event", "event", "rank", "what happened"), rows)


def _incident(e: Event) -> tuple[str, str, str]:
    """(rank it concerns, the sentence, row class) for one incident event."""
    kind = e["event"]
    rank = "-" if e.get("rank") is None else str(e["rank"])
    if kind in ("hang", "collective_error"):
        culprits = e.get("culprits") or []
        text = e.get("reason", "")
        if e.get("verdict"):
            text += f". Verdict: {e['verdict']}"
        if e.get("report"):
            text += f". Report: {e['report']}"
        return ", ".join(map(str, culprits)) or rank, text, "bad"
    if kind == "straggler":
        return (str(e.get("straggler_rank")), f"rank {e.get('straggler_rank')} on "
                f"{e.get('host')} is {e.get('slowdown')}× slower than the others "
                f"(step {e.get('step')})", "warn")
    if kind == "preempted":
        return rank, f"signal {e.get('signal')} at step {e.get('step')}", "warn"
    if kind == "checkpoint_failed":
        return rank, f"checkpoint of step {e.get('step')} failed: {e.get('error')}", "bad"
    if kind == "checkpoint_rejected":
        return rank, (f"checkpoint of step {e.get('step')} rejected: "
                      + "; ".join(map(str, e.get("problems") or []))), "bad"
    if kind == "node_excluded":
        return rank, f"host {e.get('host')} excluded: {e.get('reason')}", "bad"
    where = e.get("host") or "?"
    if e.get("gpu") is not None:
        where += f" GPU {e['gpu']}"
    return (rank, f"{str(e.get('severity')).upper()} {e.get('check')} on {where}: "
                  f"{e.get('message')}", "bad" if e.get("severity") == "fatal" else "warn")


# -- small helpers --------------------------------------------------------------------------


def _table(head: tuple[str, ...], rows: list[str]) -> str:
    return ("<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead>\n"
            "<tbody>\n" + "\n".join(rows) + "\n</tbody></table>")


def _badput(g: goodput.Breakdown) -> list[tuple[str, float]]:
    """The categories that lost time, largest first (those under 0.05 s would read 0.0)."""
    return sorted(((k, v) for k, v in g.badput_s.items() if v >= 0.05), key=lambda kv: -kv[1])


def _attempt_color(i: int) -> str:
    return ATTEMPT_COLORS[i % len(ATTEMPT_COLORS)]


def _category_color(category: str) -> str:
    """A fixed colour per goodput category, shared by the timeline and the goodput bar."""
    return CATEGORY_COLORS.get(category) or OTHER_COLORS[zlib.crc32(category.encode())
                                                         % len(OTHER_COLORS)]


def _ink(background: str) -> str:
    """Text colour that reads on ``background``."""
    r, g, b = to_rgb(background)
    return "#212121" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))
