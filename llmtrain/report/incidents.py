"""The report's Incidents: every failure, hang, desync, eviction, failed GPU, warm recovery
(a spare in a lost rank's place, a shrink, a grow), cold restart and store fault, one row
each, in time order. A recovery's row tells the whole story: how the failure was detected,
the path the job took (warm spare, warm shrink, warm grow, cold), the time from the failure
to the first step after it, the steps redone, and the ranks and nodes lost with who
replaced them. The ranks' own reports of the failure (``failure`` events, one per survivor)
are its detection, not rows of their own."""

from __future__ import annotations

import html
from dataclasses import dataclass

from llmtrain.report.formatting import cells, duration, table, utc
from llmtrain.report.run import Event, Run
from llmtrain.report.sentences import SAY, sign, where

# A failure's first signs: what a recovery's story names as its detection.
SIGNS = ("failure", "hang", "collective_error", "evicted", "node_excluded", "stop_vote",
         "fatal", "preempted", "health", "round_node_lost")
PATHS = {"spare": "warm spare", "shrink": "warm shrink", "grow": "warm grow"}
HEAD = ("at (UTC)", "after first event", "event", "ranks / nodes", "path", "to first step",
        "steps redone", "what happened")


@dataclass
class Incident:
    """One row of the Incidents table."""
    ts: float
    event: str          # what it was, in words ("warm recovery", "cold restart", "hang")
    ranks: str          # the ranks (and nodes) it concerns
    text: str           # the story
    level: str          # the row's class: "bad", "warn" or "recovered"
    path: str = "-"     # a recovery's path
    to_first_step: str = "-"
    redone: str = "-"
    story: bool = False  # a recovery (listed after the signs it names at the same time)


def incidents(run: Run) -> list[Incident]:
    """Every incident of the run, in time order."""
    told: set[int] = set()  # the failure events a recovery's story names as its detection
    found = _warm_stories(run, told) + _cold_stories(run, told)
    spells = {id(spell[0]): spell for spell in run.straggler_spells}
    spells.update(_spells(run, told))
    repeats = {id(e) for spell in spells.values() for e in spell[1:]}
    for e in run.events:
        kind = e["event"]
        if kind not in SAY or id(e) in told or id(e) in repeats or (
                kind == "health" and e.get("severity") == "ok"):
            continue
        spell = spells.get(id(e), [e])
        ranks, text, level = SAY[kind](e)
        if kind != "straggler" and len(spell) > 1:
            ranks = ", ".join(dict.fromkeys(SAY[kind](s)[0] for s in spell))
        if kind == "health" and len(spell) > 1:
            hosts = ", ".join(dict.fromkeys(where(s) for s in spell))
            text = (f"{str(e.get('severity')).upper()} {e.get('check')} on {hosts}: "
                    f"{e.get('message')}; reported {len(spell)} times until "
                    f"{utc(spell[-1]['ts'])}")
        elif kind != "straggler" and len(spell) > 1:
            text += f" (said {len(spell)} times, until {utc(spell[-1]['ts'])})"
        if kind == "straggler" and len(spell) > 1:
            text += (f"; reported {len(spell)} times until {utc(spell[-1]['ts'])}, at worst "
                     f"{max(s.get('slowdown') or 0 for s in spell)}× slower")
        path = {"warm_recovery_failed": "warm → cold", "failure": e.get("path") or "cold"}
        found.append(Incident(e["ts"], kind.replace("_", " "), ranks, text, level,
                              path=path.get(kind, "-")))
    return sorted(found, key=lambda i: (i.ts, i.story))


def _spells(run: Run, told: set[int]) -> dict[int, list[Event]]:
    """Events that say the same, grouped under the first: health findings of one check,
    severity and message (a clock not synchronized on every node), and any other kind's
    events whose sentence is the same word for word (every rank saying the warm path is
    off, for the same reason)."""
    spells: dict[tuple, list[Event]] = {}
    for e in run.events:
        kind = e["event"]
        if kind not in SAY or kind == "straggler" or id(e) in told:
            continue
        if kind == "health":
            if e.get("severity") == "ok":
                continue
            key: tuple = (kind, e.get("check"), e.get("severity"), e.get("message"))
        else:
            key = (kind, *SAY[kind](e)[1:])
        spells.setdefault(key, []).append(e)
    return {id(spell[0]): spell for spell in spells.values()}


def incidents_table(run: Run) -> str:
    """The Incidents section's body: the table, or a sentence saying there were none."""
    found = incidents(run)
    rows = [cells([utc(i.ts), f"+{duration(i.ts - run.t0)}", i.event, i.ranks, i.path,
                   i.to_first_step, i.redone, i.text], i.level, wrap_last=True)
            for i in found]
    if not rows:
        return ("<p>None: no hangs, failures, recoveries, collective errors, stragglers, "
                "preemptions, checkpoint failures, store faults or health problems were "
                "logged.</p>")
    recoveries = [i for i in found if i.story]
    lead = ""
    if recoveries:
        lead = "<p>" + html.escape(
            f"{len(recoveries)} recover{'ies' if len(recoveries) != 1 else 'y'}: "
            + "; ".join(f"{i.path} in {i.to_first_step}" for i in recoveries)) + ".</p>\n"
    return lead + table(HEAD, rows)


# -- warm: a new generation of the running job ----------------------------------------------


def _warm_stories(run: Run, told: set[int]) -> list[Incident]:
    stories, since = [], run.t0
    for e in run.warm_changes:
        marks = e.get("marks") or {}
        start = next(iter(marks.values()), e["ts"])
        if e["event"] == "warm_grow":
            stories.append(_grow(run, e, start))
        else:
            since = max(since, run.attempts[run.attempt_of(start)].start)
            signs = _signs(run, since, marks.get("agreed", start + 1.0), told)
            stories.append(_warm(run, e, start, signs))
        since = marks.get("first_step", e["ts"])
    return stories


def _warm(run: Run, e: Event, start: float, signs: list[Event]) -> Incident:
    """A warm recovery: a spare took the lost ranks' places, or the survivors shrank."""
    lost, step, kind = e.get("lost") or [], e["step"], e.get("kind", "spare")
    gone = _who(run, lost, start)
    if kind == "shrink":
        before = run.world_size_at(start)
        ranks = f"{gone} → none"
        how = (f"no spare waited: the survivors went on as {e.get('world_size')} rank(s)"
               + (f" (from {before})" if before else "") + f" from the state of step "
               f"{step}, resharded from memory")
    else:
        took = [f"{run.host_after(r, start) or 'a spare'} as rank {r}" for r in lost]
        ranks = f"{gone} → {', '.join(run.host_after(r, start) or '?' for r in lost)}"
        how = (f"a warm spare took the place: {', '.join(took)}; every rank's state of step "
               f"{step} restored from memory (the lost rank's from its buddy's replica)")
    text = (f"{gone} lost; detected: {_detection(signs)}. {how[0].upper()}{how[1:]}; no "
            f"process restarted. Training again {e.get('total_s', 0):.2f} s after the "
            f"failure{_parts(e)}.")
    return Incident(start, "warm recovery" if kind == "spare" else f"warm {kind}", ranks,
                    text, "recovered", path=PATHS.get(kind, f"warm {kind}"),
                    to_first_step=_seconds(e.get("total_s")),
                    redone=_redone(e.get("failed_at"), step), story=True)


def _grow(run: Run, e: Event, start: float) -> Incident:
    """Spares that came later joined the running job."""
    before = run.world_size_at(start) or 0
    new = list(range(before, e.get("world_size") or before))
    joined = [f"{run.host_after(r, start) or 'a spare'} as rank {r}" for r in new]
    text = (f"spare(s) waited while the job ran below its largest size: the ranks voted to "
            f"grow at step {e['step']}; {', '.join(joined) or 'the spares'} joined, and the job "
            f"went on as {e.get('world_size')} ranks (from {before}), the new ranks' shards "
            f"resharded from memory; no process restarted. Training again "
            f"{e.get('total_s', 0):.2f} s after the vote{_parts(e)}.")
    ranks = "+ " + ", ".join(f"{r} on {run.host_after(r, start) or '?'}" for r in new)
    return Incident(start, "warm grow", ranks, text, "recovered", path="warm grow",
                    to_first_step=_seconds(e.get("total_s")), redone="0", story=True)


# -- cold: every process started again --------------------------------------------------------


def _cold_stories(run: Run, told: set[int]) -> list[Incident]:
    groups = run.by_attempt(run.events)
    stories = []
    for a in run.attempts[1:]:
        before, now = groups[a.index - 1], groups[a.index]
        if any(e["event"] == "run_end" and e.get("complete") for e in before):
            continue  # the run was extended: no failure came before this start
        record = next((e for e in now if e["event"] == "recovery"), None)
        marks = (record or {}).get("marks") or {}
        # the failure came after the previous attempt's last warm change, if it had one
        since = marks.get("last_progress") or max(
            [run.attempts[a.index - 1].start] + [(e.get("marks") or {}).get("first_step", e["ts"])
                                                 for e in run.warm_changes
                                                 if run.attempt_of(e["ts"]) == a.index - 1])
        signs = _signs(run, since, a.record.get("process_start") or a.start, told)
        lost = (record or {}).get("silent_ranks") or []
        gone = _who(run, lost, a.start)
        came = ", ".join(run.host_after(r, a.start) or "a new process" for r in lost)
        excluded = [e["host"] for e in before if e["event"] == "node_excluded" and e.get("host")]
        loaded = next((e["step"] for e in now if e["event"] == "checkpoint_loaded"), None)
        resumed = (f"resumed from the checkpoint of step {loaded}" if loaded is not None
                   else "started from scratch (no checkpoint)")
        total = (record or {}).get("total_s")
        text = ((f"{gone} lost without a word" if lost else "no rank died silently")
                + (f" ({', '.join(excluded)} excluded)" if excluded else "")
                + f"; detected: {_detection(signs)}. Every process started again"
                + (f" (rank 0 on {a.record['host']})" if a.record.get("host") else "")
                + f", {resumed}" + (f"; training again {total:.2f} s after the failure"
                                    f"{_parts(record)}" if total is not None else "") + ".")
        at = signs[0]["ts"] if signs else run.attempts[a.index - 1].end
        stories.append(Incident(at, "cold restart", f"{gone} → {came}" if lost else "-",
                                text, "bad", path="cold", to_first_step=_seconds(total),
                                redone=_redone(_reached(before), loaded or 0), story=True))
    return stories


def _reached(events: list[Event]) -> int | None:
    """The last step an attempt got to: its logged steps, its productive spans and its
    ranks' reports of a failure."""
    steps = [e["step"] for e in events if e["event"] in ("step", "failure")
             and e.get("step") is not None]
    steps += [e["steps"][1] for e in events if e["event"] == "span" and e.get("steps")]
    return max(steps, default=None)


# -- the parts of a story -------------------------------------------------------------------


def _signs(run: Run, since: float, until: float, told: set[int]) -> list[Event]:
    """The failure's first signs between ``since`` and ``until``; the ranks' own reports of
    it are told by the story, not as rows of their own."""
    signs = [e for e in run.events if e["event"] in SIGNS and since <= e["ts"] <= until
             and not (e["event"] == "health" and e.get("severity") != "fatal")]
    told.update(id(e) for e in signs if e["event"] == "failure")
    return signs


def _detection(signs: list[Event]) -> str:
    if not signs:
        return "nothing logged it (a process killed, or crashed hard)"
    more = len(signs) - 1
    return sign(signs[0]) + (f" (and {more} more report{'s' * (more > 1)})" if more else "")


def _who(run: Run, ranks: list[int], at: float) -> str:
    """The lost ranks and the hosts they ran on."""
    named = [f"rank {r}" + (f" on {h}" if (h := run.host_before(r, at)) else "") for r in ranks]
    return ", ".join(named) or "no rank"


def _parts(e: Event) -> str:
    parts = e.get("parts_s") or {}
    return (" (" + ", ".join(f"{k.replace('->', ' → ').replace('_', ' ')} {v:.2f} s"
                             for k, v in parts.items()) + ")") if parts else ""


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _redone(reached: int | None, back_to: int) -> str:
    if reached is None:
        return "-"
    n = max(0, reached - back_to)
    if n == 1:
        return f"1 (step {reached})"
    return f"{n} (steps {back_to + 1}-{reached})" if n else "0"
