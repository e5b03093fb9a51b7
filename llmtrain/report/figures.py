"""The report's figures: each builds one from the indexed log, or says why there is none
(a string), or that it does not apply to this run (None: no section at all)."""

from __future__ import annotations

import statistics
import zlib
from collections import defaultdict
from typing import Any, Callable

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm, to_rgb
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator

from llmtrain.metrics import goodput
from llmtrain.report.formatting import duration
from llmtrain.report.run import Event, Run

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
RECOVERY_COLORS = {"spare": "#0277bd", "shrink": "#ef6c00", "grow": "#2e7d32", "cold": "#6d4c41"}
Built = Figure | str | None


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


def _loss(run: Run) -> Built:
    if not run.of["step"]:
        return "the log has no step events (rank 0 writes one every metrics.log_every steps)"
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.add_subplot()
    _per_attempt(ax, run, lambda e: e["step"], "loss")
    ax.set(xlabel="step", ylabel="loss", title="Training loss")
    ax.legend(loc="upper right")
    return fig


def _throughput(run: Run) -> Built:
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


class _Lanes:
    """The timeline's axes: one lane per kind of thing, drawn as bars and marks."""

    def __init__(self, run: Run, lanes: list[str]):
        self.run, self.y = run, {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
        self.fig = Figure(figsize=(10, 1.4 + 0.6 * len(lanes)), layout="constrained")
        self.ax = self.fig.add_subplot()

    def bar(self, lane: str, start: float, end: float, color: str, label: str | None = None,
            height: float = 0.7, **kw: Any) -> None:
        x = self.run.x
        self.ax.broken_barh([(x(start), x(end) - x(start))],
                            (self.y[lane] - height / 2, height), color=color, label=label, **kw)

    def mark(self, lane: str, events: list[Event], marker: str, color: str, label: str,
             text: Callable[[Event], str] | None = None,
             at: Callable[[Event], float] = lambda e: e["ts"]) -> None:
        if not events:
            return
        x, y = self.run.x, self.y[lane]
        self.ax.scatter([x(at(e)) for e in events], [y] * len(events), marker=marker, s=60,
                        color=color, edgecolor="white", linewidth=0.6, zorder=3, label=label)
        for j, e in enumerate(events if text else []):
            self.ax.annotate(text(e), (x(at(e)), y), xytext=(0, 9 if j % 2 else -14),
                             textcoords="offset points", ha="center", fontsize=7, color=color)


def _timeline(run: Run) -> Built:
    of = run.of
    lanes = ["attempts"]
    lanes += ["phases"] if of["span"] else []
    lanes += ["checkpoints"] if any(of[k] for k in ("checkpoint_committed", "checkpoint_failed",
                                                    "checkpoint_loaded",
                                                    "checkpoint_rejected")) else []
    lanes += ["recoveries"] if run.warm_changes or of["recovery"] else []
    lanes += ["incidents"] if any(of[k] for k in ("hang", "collective_error", "straggler",
                                                  "preempted")) else []
    health = [e for e in of["health"] if e.get("severity") != "ok"] + of["node_excluded"]
    lanes += ["health"] if health else []
    t = _Lanes(run, lanes)
    _attempts_and_phases(t)
    for lane, draw in (("checkpoints", _checkpoint_marks), ("recoveries", _recovery_marks),
                       ("incidents", _incident_marks)):
        if lane in t.y:
            draw(t)
    for severity, color in HEALTH_COLORS.items():
        t.mark("health", [e for e in of["health"] if e.get("severity") == severity], "o",
               color, f"health {severity}")
    if of["node_excluded"]:
        t.mark("health", of["node_excluded"], "X", "#212121", "node excluded",
               lambda e: str(e.get("host")))
    ax = t.ax
    ax.set_yticks(list(t.y.values()), list(t.y))
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlim(0, (run.x(run.t_end) or 1.0) * 1.01)
    ax.grid(axis="y", visible=False)
    ax.spines["left"].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.set(xlabel=f"wall time since the first event ({run.unit})", title="Timeline")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        t.fig.legend(handles, labels, loc="outside lower center", ncols=min(len(handles), 5),
                     fontsize=8)
    return t.fig


def _attempts_and_phases(t: _Lanes) -> None:
    run, width = t.run, t.run.x(t.run.t_end) or 1.0
    for a in run.attempts:
        t.bar("attempts", a.start, a.end, _attempt_color(a.index))
        if run.x(a.end) - run.x(a.start) > 0.06 * width:
            t.ax.text((run.x(a.start) + run.x(a.end)) / 2, t.y["attempts"], f"attempt {a.index}",
                      ha="center", va="center", color="white", fontsize=8, fontweight="bold")
    by_category: dict[str, list[Event]] = defaultdict(list)
    for s in run.of["span"]:
        by_category[s["category"]].append(s)
    for category, spans in sorted(by_category.items()):
        t.ax.broken_barh([(run.x(s["start"]), (s["end"] - s["start"]) / run.unit_s)
                          for s in spans], (t.y["phases"] - 0.35, 0.7),
                         color=_category_color(category), label=category.replace("_", " "))


def _checkpoint_marks(t: _Lanes) -> None:
    of = t.run.of
    few = len(of["checkpoint_committed"]) <= 12
    t.mark("checkpoints", of["checkpoint_committed"], "^", COMMIT_COLOR, "checkpoint committed",
           (lambda e: str(e["step"])) if few else None)
    t.mark("checkpoints", of["checkpoint_loaded"], "D", "#7e57c2", "checkpoint loaded",
           lambda e: f"load {e['step']}")
    t.mark("checkpoints", of["checkpoint_failed"] + of["checkpoint_rejected"], "X", "#c62828",
           "checkpoint failed/rejected", lambda e: str(e["step"]))


def _recovery_marks(t: _Lanes) -> None:
    """Each recovery from the failure (or the vote to grow) to its first step, labelled with
    its path and time: the grey "restart" strip of the phases lane, explained."""
    kinds: dict[str, list[Event]] = defaultdict(list)
    for e in t.run.warm_changes:
        kinds[e.get("kind", "spare")].append(e)
    kinds["cold"] = t.run.of["recovery"]
    for kind, events in kinds.items():
        color = RECOVERY_COLORS.get(kind, "#455a64")
        for e in events:
            marks = {k: v for k, v in (e.get("marks") or {}).items() if v is not None}
            if marks:
                t.bar("recoveries", min(marks.values()), max(marks.values()), color, height=0.3)
        t.mark("recoveries", events, "o", color, f"{kind} recovery" if kind != "grow" else
               "grow", lambda e, k=kind: f"{k} {e.get('total_s', 0):.2f}s",
               at=lambda e: min(v for v in (e.get("marks") or {"": e["ts"]}).values()
                                if v is not None))


def _incident_marks(t: _Lanes) -> None:
    of = t.run.of
    for e in of["hang"] + of["collective_error"]:
        if e.get("reported_after_s"):  # from the last progress until the report
            t.bar("incidents", e["ts"] - e["reported_after_s"], e["ts"], "#ef9a9a",
                  "stalled until reported", height=0.4)
    t.mark("incidents", of["hang"] + of["collective_error"], "X", "#c62828",
           "hang / collective error", lambda e: e["event"].replace("collective_", ""))
    firsts = [spell[0] for spell in t.run.straggler_spells]
    t.mark("incidents", of["straggler"], "v", "#ef6c00", "straggler",
           lambda e: f"rank {e.get('straggler_rank')}" if any(e is f for f in firsts) else "")
    t.mark("incidents", of["preempted"], "s", "#6a1b9a", "preempted")


def _world_size(run: Run) -> Built:
    """The job's size over time, where it changed (a warm shrink or grow, a cold restart
    at another size)."""
    sizes = run.world_sizes
    if len({n for _, n in sizes}) < 2:
        return None
    fig = Figure(figsize=(9, 2.6), layout="constrained")
    ax = fig.add_subplot()
    xs = [run.x(t) for t, _ in sizes] + [run.x(run.t_end)]
    ax.step(xs, [n for _, n in sizes] + [sizes[-1][1]], where="post", lw=2, color="#1f4e79")
    for e in run.warm_changes:
        kind = e.get("kind", "spare")
        at = run.x((e.get("marks") or {}).get("restored", e["ts"]))
        ax.axvline(at, color=RECOVERY_COLORS.get(kind, "#455a64"), lw=1, ls=":")
        ax.annotate(f"{kind} at step {e['step']}", (at, 1), xytext=(3, -4), va="top",
                    textcoords="offset points", xycoords=("data", "axes fraction"), fontsize=8,
                    color=RECOVERY_COLORS.get(kind, "#455a64"))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(n for _, n in sizes) * 1.25)
    ax.set_xlim(0, run.x(run.t_end) or 1.0)
    ax.set(xlabel=f"wall time since the first event ({run.unit})", ylabel="ranks",
           title=f"World size: {min(n for _, n in sizes)} to {max(n for _, n in sizes)} ranks")
    return fig


def _goodput_figure(run: Run) -> Built:
    g = run.goodput
    if g.wall_s <= 0:
        return "the log has no attempt_start events to measure the wall time from"
    parts = [("productive", g.productive_s), *badput(g)]
    total = sum(v for _, v in parts)
    fig = Figure(figsize=(9, 2.4), layout="constrained")
    ax = fig.add_subplot()
    left = 0.0
    for name, seconds in parts:
        share = seconds / total
        ax.barh(0, seconds / run.unit_s, left=left / run.unit_s, height=0.6,
                color=_category_color(name), edgecolor="white", linewidth=1,
                label=f"{name.replace('_', ' ')}: {duration(seconds)} ({share:.1%})")
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
           f"{duration(g.productive_s)} productive of {duration(g.wall_s)}")
    fig.legend(loc="outside lower center", ncols=min(len(parts), 3), fontsize=8)
    return fig


def _stragglers(run: Run) -> Built:
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


FIGURES: list[tuple[str, str, str, Callable[[Run], Built]]] = [
    ("loss", "Loss", "Loss at each logged step, one colour per attempt; after a restart the "
     "curve picks up from the checkpoint the attempt resumed from (dotted lines: committed "
     "checkpoints).", _loss),
    ("throughput", "Throughput", "Tokens per second over wall time, one colour per attempt; "
     "gaps are restarts, dips at the dotted lines are checkpoint stalls.", _throughput),
    ("timeline", "Timeline", "Where the wall time went: each attempt, the phases rank 0 "
     "measured, checkpoints, recoveries (from the failure to the first step after it, with "
     "their path: warm spare, shrink, grow or cold), hangs, stragglers and health events.",
     _timeline),
    ("goodput", "Goodput", "Productive time against each kind of lost time (badput) over "
     "the whole run, restarts included; ETTR is the productive share.", _goodput_figure),
    ("world_size", "World size", "Ranks in the job over wall time: a warm shrink goes on "
     "without the lost nodes, a grow takes spares in (dotted lines: the warm changes).",
     _world_size),
    ("stragglers", "Stragglers", "Each rank's slowdown against the others in each watchdog "
     "window, from when ranks reached their collectives (1×: nobody waits for it): red is "
     "slower, grey not reported. A red row is a straggler.",
     _stragglers),
]


# -- colours --------------------------------------------------------------------------




def badput(g: goodput.Breakdown) -> list[tuple[str, float]]:
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
