"""``llmtrain report``: one HTML page, plus PNG figures, that tells a run's story from its
event log.

People take in a picture of a run faster than its logs: whether training was healthy (loss,
throughput), where the wall time went (timeline, goodput), what went wrong and how each
failure was recovered (incidents), how the job's size changed and which rank held the
others back (straggler heatmap). The page embeds its figures, so it is one file that can be
mailed or attached to an incident ticket; the PNGs are written beside it for slides and
chat.
"""

from __future__ import annotations

import base64
import html
import io
import os
import statistics
import time

import fsspec
import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg

from llmtrain.events import read_events
from llmtrain.fsio import is_local, join
from llmtrain.metrics import goodput
from llmtrain.metrics.console import param_count
from llmtrain.report.figures import FIGURES, STYLE, badput
from llmtrain.report.formatting import cells, duration, table, utc
from llmtrain.report.incidents import PATHS, incidents_table
from llmtrain.report.run import Attempt, Event, Run

WHAT_ENDED = {"spare": "rank(s) {lost} lost: a warm spare took over",
              "shrink": "rank(s) {lost} lost: the job shrank",
              "grow": "spare(s) joined: the job grew"}


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
            if fig is None:  # not this run's kind of figure: no section
                if os.path.exists(path):
                    os.remove(path)
                continue
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
tr.bad td{background:#fdecea} tr.warn td{background:#fff5e0} tr.recovered td{background:#e8f4fd}
.ok{color:#1b5e20;font-weight:600} .notok{color:#b71c1c;font-weight:600}
td.wrap{max-width:40em;word-break:break-word}
figure{margin:.4em 0 1em} img{max-width:100%}
figcaption{color:#555;font-size:.9em}
.missing{color:#777;font-style:italic}
"""


def _page(run: Run, sections: list[str]) -> str:
    name = html.escape(os.path.basename(run.dir.rstrip("/")) or run.dir)
    generated = f"generated {utc(time.time())} from {len(run.events)} events"
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
{incidents_table(run)}
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
              f" at {utc(run.t_end)}, {duration(time.time() - run.t_end)} ago")
    rows = [("Status", status)]
    config = start.get("config") or {}
    if start:
        model = (config.get("model") or {}).get("name", "model")
        rows.append(("Model", esc(f"{model}, {param_count(start.get('params', 0))} params, "
                                  f"{_ranks(run) or start.get('world_size')} ranks on "
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
    rows.append(("Wall time", duration(run.t_end - run.t0)))
    rows += _failure_rows(run)
    committed = of["checkpoint_committed"]
    failed = len(of["checkpoint_failed"])
    rows.append(("Checkpoints committed", f"{len(committed)}" + (f" ({failed} failed)" if failed
                                                                  else "")))
    rows.append(("Last committed step", str(committed[-1]["step"]) if committed else "none"))
    rows += _goodput_rows(run, (config.get("metrics") or {}).get("assumed_mtbf_s", 0.0))
    if run.ratios is not None:
        rows.append(("Stragglers", run.ratios.describe()))
    return rows


def _ranks(run: Run) -> str | None:
    """The job's size, as a range where it changed."""
    sizes = [n for _, n in run.world_sizes]
    if not sizes:
        return None
    return str(sizes[0]) if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"


def _failure_rows(run: Run) -> list[tuple[str, str]]:
    """Attempts and generations, the job's size where it changed, the recoveries and
    their times, hangs."""
    of, n = run.of, len(run.attempts)
    attempts = f"{n} ({n - 1} restart{'s' * (n != 2)})"
    changes = run.warm_changes
    if changes:
        kinds = [PATHS.get(e.get("kind", "spare"), "warm") for e in changes]
        attempts = (f"{n} ({n - 1} cold restart{'s' * (n != 2)}), {n + len(changes)} "
                    f"generations: " + ", ".join(f"{kinds.count(k)} {k}"
                                                 for k in dict.fromkeys(kinds)))
    rows = [("Attempts", attempts)]
    # the changes of size (a restart at the size the job had is none)
    sizes = [(t, s) for i, (t, s) in enumerate(run.world_sizes)
             if not i or s != run.world_sizes[i - 1][1]]
    if len(sizes) > 1:
        rows.append(("World size", html.escape(
            f"{_ranks(run)} ranks: " + " → ".join(
                f"{s} ({duration(t - run.t0)} in)" if i else f"{s}"
                for i, (t, s) in enumerate(sizes)))))
    recoveries = sorted([(e["ts"], PATHS.get(e.get("kind", "spare"), "warm"), e.get("total_s"))
                         for e in changes] + [(e["ts"], "cold", e.get("total_s"))
                                              for e in of["recovery"]])
    if recoveries:
        rows.append(("Recoveries", html.escape(
            f"{len(recoveries)}: " + ", ".join(f"{p} {t:.2f} s" for _, p, t in recoveries
                                                if t is not None)
            + " (from the failure, or the vote to grow, to the first step after it)")))
    rows.append(("Hangs / collective errors", str(len(of["hang"]) + len(of["collective_error"]))))
    return rows


def _goodput_rows(run: Run, assumed_mtbf_s: float) -> list[tuple[str, str]]:
    """ETTR, badput and the checkpoint interval advice, priced with the recoveries the run
    had: each warm recovery and each cold restart at what it cost (from the failure to the
    first step after it)."""
    g, rows = run.goodput, []
    if g.wall_s > 0:
        rows.append(("ETTR", f"{g.ettr:.1%} ({duration(g.productive_s)} productive of "
                             f"{duration(g.wall_s)})"))
        rows.append(("Badput", ", ".join(f"{html.escape(k.replace('_', ' '))} {duration(v)} "
                                         f"({v / g.wall_s:.1%})" for k, v in badput(g))
                     or "none"))
    advice = goodput.advise(g, assumed_mtbf_s)
    if advice is None:
        return rows
    warm = [e["total_s"] for e in run.of["warm_recovery"] if e.get("total_s") is not None]
    cold = [e["total_s"] for e in run.of["recovery"] if e.get("total_s") is not None]
    unmeasured = max(0, len(run.attempts) - 1 - len(cold))  # restarts without their event
    costs = warm + cold + [g.restart_cost_s or 0.0] * unmeasured
    priced = "per restart"
    if costs:
        advice = goodput.young_daly(advice.save_cost_s, advice.mtbf_s,
                                    statistics.mean(costs))
        priced = "per failure, the mean of " + " and ".join(
            f"{len(ts)} {what} ({', '.join(duration(t) for t in ts)})" for what, ts in (
                ("warm recovery" if len(warm) == 1 else "warm recoveries", warm),
                ("cold restart" if len(cold) == 1 else "cold restarts", cold)) if ts)
        if unmeasured:
            priced += f" and {unmeasured} cold restart(s) estimated from the start-up"
    rows.append(("Checkpoint interval advice",
                 f"every {duration(advice.optimal_interval_s)} for an expected ETTR of "
                 f"{advice.expected_ettr:.1%} (Young/Daly: {duration(advice.save_cost_s)} "
                 f"per save, {duration(advice.restart_cost_s)} {priced}, "
                 f"{duration(advice.mtbf_s)} between failures)"))
    return rows


def _attempts_table(run: Run) -> str:
    """One row per generation: each attempt (a start of every process), and each warm
    change inside it (a spare took a lost rank's place, the job shrank or grew)."""
    rows = []
    groups = run.by_attempt(run.events)
    for a in run.attempts:
        changes = [e for e in run.warm_changes if run.attempt_of(e["ts"]) == a.index]
        loaded = next((e for e in groups[a.index] if e["event"] == "checkpoint_loaded"), None)
        begin, ranks, host = a.start, a.record.get("world_size", ""), a.record.get("host")
        resumed, name = f"step {loaded['step']}" if loaded else "-", str(a.index)
        for e in changes:
            marks = e.get("marks") or {}
            at = marks.get("restored", e["ts"])
            kind = e.get("kind", "spare")
            ended = WHAT_ENDED.get(kind, kind).format(lost=", ".join(map(str, e.get("lost") or [])))
            rows.append(_generation(run, name, begin, at, ranks, host, resumed, ended))
            begin, ranks = at, e.get("world_size") or ranks
            host = run.host_after(0, next(iter(marks.values()), at)) or host
            resumed = f"step {e['step']} from memory ({PATHS.get(kind, kind)})"
            name = f"{a.index}, gen {e.get('gen', '?')}"
        rows.append(_generation(run, name, begin, a.end, ranks, host, resumed,
                                _attempt_ended(run, a, groups[a.index])))
    head = ("attempt", "started (UTC)", "after first event", "ran for", "ranks", "host",
            "resumed from", "ended by")
    return table(head, rows)


def _generation(run: Run, name: str, start: float, end: float, ranks: object,
                host: str | None, resumed: str, ended: str) -> str:
    return cells([name, utc(start), f"+{duration(start - run.t0)}", duration(end - start),
                  str(ranks), f"{host} (rank 0)" if host else "", resumed, ended])


# the events that end an attempt, as its row says them (a round that never formed has no
# attempt of its own: its loss ends the attempt before it)
ENDERS = {"hang": "hang", "collective_error": "collective error", "preempted": "preempted",
          "fatal": "fatal", "warm_recovery_failed": "warm recovery failed",
          "round_node_lost": "a node of the next round died before its group formed"}


def _attempt_ended(run: Run, a: Attempt, events: list[Event]) -> str:
    kinds = {e["event"]: e for e in events}
    if "run_end" in kinds:  # a preemption's agreed save ends with one too
        return ("stopped on request" if kinds["run_end"].get("stopped") else
                "preempted" if "preempted" in kinds else "finished")
    enders = [e["event"] for e in events if e["event"] in ENDERS]
    if enders:  # the last of them
        before = [k for k in enders[:-1] if k != "round_node_lost"]
        if enders[-1] == "round_node_lost" and before:  # what ended it, then its next round
            return f"{ENDERS[before[-1]]}, then {ENDERS['round_node_lost']}"
        return ENDERS[enders[-1]]
    if a.index == len(run.attempts) - 1:
        return "still running, or died without logging why"
    return "died without logging why (no hang or preemption recorded)"
