"""Each incident event of the log in words: the ranks it concerns, one sentence, and how bad
it is (the class of its row in the report's Incidents); and the short phrase that names a
failure's first sign where a recovery's story says how it was detected."""

from __future__ import annotations

import re
from typing import Any, Callable

Event = dict[str, Any]
Said = tuple[str, str, str]  # (ranks, sentence, row class: "bad" or "warn")

# gloo's and NCCL's source locations and boilerplate say nothing to an operator
_NOISE = re.compile(r"\[[^\]]*\.(?:cc|cpp|cu|h|hpp):\d+\] |\. This is typically caused by.*$")


def short(error: object, limit: int = 160) -> str:
    """An error's first line without the transport's source location and advice."""
    text = _NOISE.sub("", str(error or "").splitlines()[0] if error else "").strip()
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _rank(e: Event) -> str:
    return "-" if e.get("rank") is None else str(e["rank"])


def _ranks(values: object) -> str:
    return ", ".join(map(str, values or [])) or "-"


def _collective(c: object) -> str:
    c = c if isinstance(c, dict) else {}
    return f"{c.get('op')} #{c.get('seq')} on {c.get('pg')}"


def _hang(e: Event) -> Said:
    text = e.get("reason", "")
    if e.get("verdict"):
        text += f". Verdict: {e['verdict']}"
    if e.get("report"):
        text += f". Report: {e['report']}"
    return (_ranks(e.get("culprits")) if e.get("culprits") else _rank(e)), text, "bad"


def where(e: Event) -> str:
    """The host, and GPU, a health finding is about."""
    return str(e.get("host") or "?") + (f" GPU {e['gpu']}" if e.get("gpu") is not None else "")


def _health(e: Event) -> Said:
    return (_rank(e), f"{str(e.get('severity')).upper()} {e.get('check')} on {where(e)}: "
                      f"{e.get('message')}", "bad" if e.get("severity") == "fatal" else "warn")


def _failure(e: Event) -> Said:
    path = e.get("path") or "cold"
    return _rank(e), f"{sign(e)}; the {path} path was to take over", "bad"


SAY: dict[str, Callable[[Event], Said]] = {
    "hang": _hang,
    "collective_error": _hang,
    "health": _health,
    "failure": _failure,
    "straggler": lambda e: (str(e.get("straggler_rank")), (
        f"rank {e.get('straggler_rank')} on {e.get('host')} is {e.get('slowdown')}× slower "
        f"than the others (step {e.get('step')})"), "warn"),
    "starved": lambda e: (str(e.get("starved_rank")), (
        f"rank {e.get('starved_rank')} sent no heartbeat for {e.get('silent_s')} s while "
        f"its peers waited for it in step {e.get('step')}, but its process ran: starved (a "
        f"loaded machine, or a long call that keeps the interpreter), not stopped; not "
        f"named hung"), "warn"),
    "preempted": lambda e: (_rank(e), f"signal {e.get('signal')} at step {e.get('step')}",
                            "warn"),
    "stop_vote": lambda e: (_rank(e), f"rank {e.get('rank')} voted to stop at step "
                            f"{e.get('step')} (its GPU failed a health check)", "bad"),
    "evicted": lambda e: (_ranks(e.get("ranks")), (
        f"the watchdog evicted rank(s) {_ranks(e.get('ranks'))} after {e.get('id')}, cutting "
        f"their connections, for the warm path to replace them"), "bad"),
    "round_node_lost": lambda e: (_rank(e), (
        f"rendezvous node(s) {', '.join(e.get('nodes') or [])} died before the process group "
        f"formed: the rank ended for the next round, which formed without them"), "bad"),
    "node_excluded": lambda e: (_rank(e), f"host {e.get('host')} excluded: {e.get('reason')}",
                                "bad"),
    "fatal": lambda e: (_rank(e), (
        f"fatal on {e.get('host')}" + (f" at step {e['step']}" if e.get("step") is not None
                                       else "") + f": {short(e.get('error'), 300)}; a "
        f"restart would fail the same way, so the job stopped"), "bad"),
    "checkpoint_failed": lambda e: (_rank(e), f"checkpoint of step {e.get('step')} failed: "
                                              f"{short(e.get('error'), 300)}", "bad"),
    "checkpoint_disowned": lambda e: (_rank(e), f"checkpoint of step {e.get('step')} let "
                                                f"go of, unwritten: "
                                                f"{short(e.get('reason'), 300)}", "warn"),
    "checkpoint_rejected": lambda e: (_rank(e), (
        f"checkpoint of step {e.get('step')} rejected: "
        + "; ".join(map(str, e.get("problems") or []))), "bad"),
    "checkpoint_unreadable": lambda e: (_rank(e), (
        f"checkpoint of step {e.get('step')} unreadable: {short(e.get('error'), 300)}"),
        "warn"),
    "warm_recovery_failed": lambda e: (_rank(e), (
        f"the warm path failed at step {e.get('step')}: {short(e.get('reason'), 300)}; the "
        f"job goes cold (every process restarts from the last checkpoint)"), "bad"),
    "collective_stuck": lambda e: (_rank(e), (
        f"rank {e.get('rank')} on {e.get('host')} was stuck {e.get('waited_s')} s in "
        f"{_collective(e.get('collective'))}, which its generation's failure did not end: "
        f"it left, for a spare to take its place"), "bad"),
    "process_paused": lambda e: (_rank(e), (
        f"rank {e.get('rank')} on {e.get('host')} did not run for {e.get('seconds')} s at "
        f"step {e.get('step')} (its machine paused, or the process was stopped); the "
        f"watchdog judged nobody on that time"), "warn"),
    "grow_failed": lambda e: (_rank(e), (
        f"a grow voted at step {e.get('step')} failed: {short(e.get('reason'), 300)}; the "
        f"job trains on at its size"), "warn"),
    "preempt_shrink_refused": lambda e: (_ranks(e.get("leaving")), (
        f"preempted rank(s) {_ranks(e.get('leaving'))} could not be left behind at step "
        f"{e.get('step')}: {e.get('reason')}"), "warn"),
    "warm_path_off": lambda e: (_rank(e), (
        "warm recovery is off" + (f" on {e['host']}" if e.get("host") else "")
        + f": {e.get('reason')}; a failure restarts every process (cold)"), "warn"),
    "warm_path_unproven": lambda e: (_rank(e), f"warm path on {e.get('backend')}: "
                                               f"{e.get('reason')}", "warn"),
    "snapshot_corrupt": lambda e: (_rank(e), (
        f"a snapshot of step {e.get('step')} failed its checksum ({e.get('when')}): "
        f"{short(e.get('error'), 300)}"), "bad"),
    "snapshot_replication_failed": lambda e: (_rank(e), (
        f"rank {e.get('rank')}'s snapshot of step {e.get('step')} did not reach its buddy "
        f"(rank {e.get('buddy')}): {short(e.get('error'))}"), "warn"),
    "fenced": lambda e: (_rank(e), (
        f"rank {e.get('rank')} on {e.get('host')} fenced out of the job ({e.get('what')}): "
        f"{e.get('reason')}"), "bad"),
    "fence_unreachable": lambda e: (_rank(e), (
        f"store fault: the rendezvous store did not answer ({e.get('what')}) within "
        f"{e.get('timeout_s')} s: {short(e.get('error'))}"), "warn"),
    "fence_restored": lambda e: (_rank(e), (
        f"store fault: the rendezvous store had lost the job's fence token (restarted "
        f"empty?); {e.get('host')} restored it"), "warn"),
    "control_key_forged": lambda e: (_rank(e), (
        f"a control key in the store failed its signature ({e.get('key')}: {e.get('why')}); "
        f"it was ignored"), "bad"),
    "rollback": lambda e: (_rank(e), (
        f"integrity: {e.get('reason')}; rolled back to the checkpoint of step "
        f"{e.get('to_step')}" + (f", skipping step(s) {_ranks(e.get('skip'))}"
                                 if e.get("skip") else "")), "bad"),
    "loss_spike": lambda e: (_ranks(e.get("ranks")), (
        f"integrity: loss spike at step {e.get('step')}: {e.get('reason')}"), "warn"),
    "replica_diverged": lambda e: (_ranks(e.get("ranks")), (
        f"integrity: replica(s) of rank(s) {_ranks(e.get('ranks'))} diverged at step "
        f"{e.get('step')} ({e.get('how')})"), "bad"),
    "state_check_failed": lambda e: (_ranks(e.get("suspects")), (
        f"integrity: the state check of step {e.get('step')} failed (suspects: "
        f"{_ranks(e.get('suspects'))}; non-finite on {_ranks(e.get('nonfinite_ranks'))})"),
        "bad"),
    "recompute_mismatch": lambda e: (_ranks(e.get("ranks")), (
        f"integrity: a recomputed step {e.get('step')} differed between ranks "
        f"{e.get('pairs')}"), "bad"),
}


def sign(e: Event) -> str:
    """How a failure showed, as the detection of its recovery's story."""
    kind, who = e["event"], f"rank {e.get('rank')}"
    if kind == "failure":
        how = ("its own step failed" if e.get("cause") == "local" else
               "its collective failed (a peer was gone)")
        return f"{who}: {how} at step {e.get('step')}: {short(e.get('error'))}"
    if kind in ("hang", "collective_error"):
        return (f"the watchdog's {kind.replace('_', ' ')} verdict after "
                f"{e.get('detected_after_s', 0):.0f} s: {e.get('verdict') or e.get('reason')}")
    if kind == "health":
        return "a failed health check: " + SAY["health"](e)[1]
    return SAY[kind](e)[1] if kind in SAY else kind.replace("_", " ")
