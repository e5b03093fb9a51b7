"""The goodput accounting on hand-made timelines, and the Young/Daly advice."""

import math

import pytest

from llmtrain.metrics.goodput import CATEGORIES, account, advise, recovery, young_daly


def span(category, start, end, **kw):
    return {"ts": end, "event": "span", "rank": 0, "category": category, "name": category,
            "start": start, "end": end, **kw}


def attempt(ts, launch, process_start):
    return {"ts": ts, "event": "attempt_start", "rank": 0, "launch": launch,
            "process_start": process_start, "world_size": 2}


def two_attempts_with_a_hang():
    """Launch at 0; start-up to 3; steps 1-10 in 3-5, a save 5-5.2, steps 11-20 in 5-7;
    a hang diagnosed at 8; the second attempt starts at 9, loads step 10 by 10 and redoes
    11-20 in 10-12; the run ends at 12.5."""
    return [
        attempt(0.6, 0.0, 0.5),
        span("startup", 0.5, 3.0),
        span("productive", 3.0, 5.0, steps=[1, 10]),
        {"ts": 5.2, "event": "checkpoint_staged", "rank": 0, "step": 10, "blocking_s": 0.2},
        span("checkpoint_stall", 5.0, 5.2),
        span("productive", 5.0, 7.0, steps=[11, 20]),
        {"ts": 8.0, "event": "hang", "rank": 0, "reason": "rank 1 stuck"},
        attempt(9.5, 0.0, 9.0),
        {"ts": 10.0, "event": "checkpoint_loaded", "rank": 0, "step": 10},
        span("checkpoint_load", 9.5, 10.0),
        span("productive", 10.0, 12.0, steps=[11, 20]),
        {"ts": 12.5, "event": "run_end", "rank": 0},
    ]


def test_every_second_lands_in_exactly_one_category():
    b = account(two_attempts_with_a_hang())
    assert b.wall_s == pytest.approx(12.5)
    assert b.productive_s + sum(b.badput_s.values()) == pytest.approx(b.wall_s)
    assert set(b.badput_s) == set(CATEGORIES)
    assert b.productive_s == pytest.approx(4.0)  # 3-5 and 10-12; 5-7 was redone
    assert b.badput_s["startup"] == pytest.approx(3.0)  # launch 0 to 3
    assert b.badput_s["lost_steps"] == pytest.approx(1.8)  # 5.2-7 (the save claims 5-5.2)
    assert b.badput_s["checkpoint_stall"] == pytest.approx(0.2)
    assert b.badput_s["hang"] == pytest.approx(1.0)  # last progress 7 to the verdict at 8
    assert b.badput_s["restart"] == pytest.approx(1.0)  # 8 to the new process at 9
    assert b.badput_s["checkpoint_load"] == pytest.approx(0.5)
    assert b.badput_s["other"] == pytest.approx(1.0)  # 9-9.5 and 12-12.5
    assert b.ettr == pytest.approx(4.0 / 12.5)
    assert (b.attempts, b.failures) == (2, 1)
    assert b.save_cost_s == pytest.approx(0.2)


def test_a_partly_redone_span_is_prorated_and_a_running_job_counts_to_now():
    events = two_attempts_with_a_hang()
    events[8] = {"ts": 10.0, "event": "checkpoint_loaded", "rank": 0, "step": 15}
    b = account(events[:-1], now=20.0)
    # steps 11-15 of the 5-7 span were kept (its first half, less the save's 0.2 s)
    assert b.productive_s == pytest.approx(2.0 + 0.8 + 2.0)
    assert b.badput_s["lost_steps"] == pytest.approx(1.0)
    assert b.wall_s == pytest.approx(20.0)
    assert b.productive_s + sum(b.badput_s.values()) == pytest.approx(20.0)


def one_attempt_with_a_warm_recovery():
    """Steps 1-10 in 3-5, 11-20 in 5-7; the watchdog names a stopped rank at 8, a spare
    restores the snapshot of step 15 by 8.5 (the group re-formed in 8.5-9), and steps
    16-20 are redone in 9-10 (step 16 by 9.2, where the recovery is reported; a peer's
    span of it may end just before)."""
    return [
        attempt(0.6, 0.0, 0.5),
        span("startup", 0.5, 3.0),
        span("productive", 3.0, 5.0, steps=[1, 10]),
        span("productive", 5.0, 7.0, steps=[11, 20]),
        {"ts": 8.0, "event": "hang", "rank": 1, "reason": "rank 0 stopped"},
        span("restart", 8.5, 9.0),
        span("productive", 9.0, 9.2, steps=[16, 16]),
        {"ts": 9.2, "event": "warm_recovery", "rank": 1, "step": 15, "lost": [0],
         "marks": {"restored": 8.5}},
        span("productive", 9.2, 10.0, steps=[17, 20]),
    ]


def test_a_warm_recovery_counts_its_redone_steps_and_its_gap():
    b = account(one_attempt_with_a_warm_recovery())
    assert b.productive_s == pytest.approx(2.0 + 1.0 + 1.0)  # 16-20 once, not twice
    assert b.badput_s["lost_steps"] == pytest.approx(1.0)  # 6-7: steps 16-20, redone
    assert b.badput_s["hang"] == pytest.approx(1.0)  # last progress 7 to the verdict 8
    assert b.badput_s["restart"] == pytest.approx(1.0)  # 8 to 8.5, then the re-forming
    assert b.badput_s["other"] == pytest.approx(0.0)
    assert (b.attempts, b.failures) == (1, 1)


def test_a_rollback_loses_the_steps_since_its_checkpoint():
    events = one_attempt_with_a_warm_recovery()[:4] + [
        {"ts": 7.5, "event": "rollback", "rank": 0, "step": 20, "to_step": 10},
        span("checkpoint_load", 7.5, 8.0),
        span("productive", 8.0, 10.0, steps=[11, 20])]
    b = account(events)
    assert b.productive_s == pytest.approx(4.0)
    assert b.badput_s["lost_steps"] == pytest.approx(2.0)  # all of 11-20 the first time


def test_no_attempt_no_time():
    b = account([{"ts": 1, "event": "step", "rank": 0}])
    assert (b.wall_s, b.productive_s, b.ettr) == (0.0, 0.0, 0.0)


def test_young_daly_against_the_textbook():
    # C = 60 s to save, M = 6 h between failures: Young's sqrt(2CM) = 1609.97 s
    a = young_daly(60.0, 6 * 3600.0, 300.0)
    young = math.sqrt(2 * 60 * 6 * 3600)
    assert young * 0.95 < a.optimal_interval_s < young * 1.05
    waste = 60 / a.optimal_interval_s + (a.optimal_interval_s / 2 + 300) / (6 * 3600)
    assert a.expected_ettr == pytest.approx(1 - waste)
    # the optimum beats its neighbours in expected ETTR
    for tau in (a.optimal_interval_s / 2, a.optimal_interval_s * 2):
        assert 1 - (60 / tau + (tau / 2 + 300) / (6 * 3600)) < a.expected_ettr


def test_advice_needs_a_save_and_a_failure_rate():
    b = account(two_attempts_with_a_hang())
    a = advise(b)
    assert a.mtbf_s == pytest.approx(12.5) and a.save_cost_s == pytest.approx(0.2)
    b.failures = 0
    assert advise(b) is None
    assert advise(b, assumed_mtbf_s=3600).mtbf_s == 3600


def test_a_process_start_is_read_to_the_clock_tick():
    """/proc/stat's btime is whole seconds: boot time from it put a start up to a second
    early, and the ledger's wall time past the run it measured."""
    import subprocess
    import time

    from llmtrain.metrics.goodput import process_start_time
    before = time.time()
    child = subprocess.Popen(["sleep", "2"])
    try:
        assert before - 0.05 <= process_start_time(child.pid) <= time.time() + 0.05
    finally:
        child.kill()
        child.wait()


def run_end(ts, steps, *, complete, stopped=False):
    return {"ts": ts, "event": "run_end", "rank": 0, "steps": steps, "stopped": stopped,
            "complete": complete}


def test_a_start_after_a_finished_run_is_no_recovery():
    """A hang, then a restart: a recovery with its parts. A run that had finished and is
    launched again (more steps) recovered from nothing; one stopped on request, or
    preempted (it saved and ended), did."""
    events = two_attempts_with_a_hang()
    hang = recovery(events[:-2], 10.5)
    assert hang["total_s"] == pytest.approx(2.5) and hang["marks"]["failure_detected"] == 8.0
    assert hang["detected_by"] == "hang"
    finished = events[:6] + [run_end(7.5, 20, complete=True),
                             *events[7:-2]]  # the hang replaced by the run's end
    assert recovery(finished, 10.5) is None
    early = events[:6] + [run_end(7.5, 20, complete=False), *events[7:-2]]
    stopped = [{**e, "stopped": True} if e["event"] == "run_end" else e for e in early]
    assert recovery(stopped, 10.5)["total_s"] == pytest.approx(3.5)  # since the last step
    preempted = [*early[:6], {"ts": 7.2, "event": "preempted", "rank": 0}, *early[6:]]
    assert recovery(preempted, 10.5)["marks"]["failure_detected"] == 7.2
    assert recovery(preempted, 10.5)["silent_ranks"] == []  # rank 1 ended with rank 0
    assert recovery(preempted, 10.5)["detected_by"] == "preempted"


def test_a_restart_after_a_failed_gpus_stop_vote_is_a_recovery():
    """Rank 1's GPU fails a check at 5.5 (its node excluded); the ranks vote to stop at
    step 15, save it (6.5-7) and end the attempt early: rank 0's run_end (not stopped on
    request, not preempted) at 7.2. The restart with a spare in rank 1's place is a
    recovery from the last progress, the save, to the first step; nobody died silently."""
    events = [
        attempt(0.6, 0.0, 0.5),
        span("startup", 0.5, 3.0),
        span("productive", 3.0, 5.0, steps=[1, 10]),
        {"ts": 5.5, "event": "node_excluded", "rank": 1, "host": "node2", "step": 12},
        span("productive", 5.0, 6.5, steps=[11, 15]),
        {"ts": 6.5, "event": "stop_vote", "rank": 1, "step": 15},
        span("checkpoint_stall", 6.5, 7.0),
        run_end(7.2, 15, complete=False),
        attempt(9.5, 0.0, 9.0),
        {"ts": 10.0, "event": "checkpoint_loaded", "rank": 0, "step": 15},
        span("checkpoint_load", 9.5, 10.0, name="resume"),
    ]
    rec = recovery(events, 10.5)
    assert rec is not None, "the restart after the stop vote was taken for a finished run"
    assert rec["total_s"] == pytest.approx(3.5)  # last progress (the save) at 7 to 10.5
    assert rec["marks"]["last_progress"] == 7.0 and rec["marks"]["checkpoint_loaded"] == 10.0
    assert rec["silent_ranks"] == []
    assert account(events, now=10.5).failures == 1
