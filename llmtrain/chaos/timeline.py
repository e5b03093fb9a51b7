"""What a chaos job's event log says about the run as a whole: when it changed size, how
long it ran short, which steps it skipped for good, what led to each cold restart, and its
measured ETTR against the Young/Daly model's."""

from __future__ import annotations

from llmtrain.metrics import goodput


# the events that can change the job's size: an attempt's start, then the warm ones (a
# shrink or a grow; a spare's recovery keeps the size)
SIZE_EVENTS = ("attempt_start", "warm_recovery", "warm_grow")


def sizes(events: list[dict]) -> list[tuple[float, int]]:
    """When the job changed size, and to what, in order: each attempt's start, and each
    shrink or grow (when agreed: every rank's trainer is built anew after it)."""
    started = [(e["ts"], e["world_size"]) for e in events if e["event"] == "attempt_start"]
    resized = [(e["marks"]["agreed"], e["world_size"]) for e in events
               if e["event"] in SIZE_EVENTS[1:] and e["kind"] != "spare"]
    return sorted(started + resized)


def time_below(events: list[dict], full: int) -> float:
    """Seconds the job ran at fewer than ``full`` ranks (from a shrink, or a restart
    without a node, to the next change of size, or the end)."""
    changes = sizes(events)
    ends = [t for t, _ in changes[1:]] + [max((e["ts"] for e in events), default=0.0)]
    return sum(max(0.0, end - t) for (t, size), end in zip(changes, ends) if size < full)


def measured_ettr(events: list[dict], recover_s: list[float], checkpoint_every: int) -> dict:
    """The run's ETTR from its whole event log, the number ``llmtrain report`` states (the
    trainer's last ``goodput`` event is taken before the ranks' shutdown and the launchers'
    exit, and reads higher), against the Young/Daly model's for the save cost, the
    recoveries' mean time (``recover_s``, one per fault that cost one) and the failure rate
    measured."""
    b = goodput.account(events)
    step_times = sorted(e["step_time_s"] for e in events if e["event"] == "step")
    if b.wall_s == 0 or not step_times:
        return {}
    mtbf = b.wall_s / max(1, len(recover_s))
    restart_cost = sum(recover_s) / len(recover_s) if recover_s else 0.0
    predicted = goodput.expected_ettr(b.save_cost_s or 0.0,
                                      checkpoint_every * step_times[len(step_times) // 2],
                                      mtbf, restart_cost)
    return {"ettr": b.ettr, "ettr_predicted": predicted, "wall_s": b.wall_s,
            "badput_s": b.badput_s, "mtbf_s": mtbf, "restart_cost_s": restart_cost}


def skipped_at_last(events: list[dict]) -> list[int]:
    """The steps whose update a job skipped the last time it ran them: a restore to an
    earlier step (a warm recovery, a checkpoint, a rollback) replays a skipped step, and a
    NaN that struck once does not come again, so the replay applies it."""
    back = goodput.restores(events) + [(e["ts"], e["step"]) for e in events
                                       if e["event"] == "checkpoint_loaded"]
    last: dict[int, float] = {}
    for e in events:
        if e["event"] == "step_skipped":
            last[e["step"]] = max(last.get(e["step"], 0.0), e["ts"])
    return sorted(step for step, ts in last.items()
                  if not any(t > ts and to < step for t, to in back))


# what the ranks and launchers say before a cold restart, in the order it would lead there
RESTART_CAUSES = ("failure", "collective_stuck", "checkpoint_abandoned", "checkpoint_disowned",
                  "warm_recovery_failed", "fenced", "fatal", "run_end", "node_exit")


def restarts(events: list[dict], shown: int = 6) -> list[dict]:
    """Each cold restart (an attempt after the first): seconds after the first attempt,
    the node and restart count of its rank 0, and what led to it: the last ``shown``
    events of ``RESTART_CAUSES`` since the attempt before, each as "kind (who): what".
    A restart that no fault's row explains (one after the job's stop, a recovery that
    went cold between faults) still says what came before it."""
    starts = [e for e in events if e["event"] == "attempt_start"]
    found = []
    for before, start in zip(starts, starts[1:]):
        causes = [e for e in events if e["event"] in RESTART_CAUSES
                  and before["ts"] <= e["ts"] < start["ts"]]
        found.append({"at_s": round(start["ts"] - starts[0]["ts"], 1),
                      "host": start.get("host"), "restart_count": start.get("restart_count"),
                      "after": [_said(e) for e in causes[-shown:]]})
    return found


def _said(event: dict) -> str:
    who = f"rank {event['rank']}" if event.get("rank") is not None else event.get("host")
    stuck = event.get("collective") or {}
    what = (event.get("reason") or event.get("error")
            or (f"{stuck.get('op')} #{stuck.get('seq')} on {stuck.get('pg')}" if stuck else "")
            or (f"exit {event['exit_code']}" if "exit_code" in event else "")
            or (f"step {event.get('steps')}, stopped {event.get('stopped')}"
                if event["event"] == "run_end" else ""))
    return f"{event['event']} ({who}): {str(what)[:200]}"
