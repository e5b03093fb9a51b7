"""What chaos reads off a job's event log as a whole: the steps the fault-free reference
skips (those the job skipped for good), and what led to each cold restart."""

from llmtrain.chaos.summary import table
from llmtrain.chaos.timeline import restarts, skipped_at_last


def ev(ts: float, event: str, **fields) -> dict:
    return {"ts": ts, "event": event, **fields}


def test_a_skipped_step_replayed_after_a_restore_is_no_longer_skipped():
    nan = [ev(1, "step_skipped", step=195), ev(2, "step_skipped", step=250)]
    assert skipped_at_last(nan) == [195, 250]
    # a warm recovery to step 194 replayed 195, which the NaN (struck once) left alone
    replayed = [*nan[:1], ev(1.5, "warm_recovery", step=194), *nan[1:]]
    assert skipped_at_last(replayed) == [250]
    # a restore to after the skipped step, or from before it was skipped, replays nothing
    assert skipped_at_last([ev(0.5, "checkpoint_loaded", step=100), *nan,
                            ev(3, "rollback", to_step=250), ev(4, "rollback", to_step=None)]
                           ) == [195, 250]
    # skipped again in the replay (a bad batch, not a transient fault): skipped for good
    again = [*replayed[:2], ev(1.7, "step_skipped", step=195)]
    assert skipped_at_last(again) == [195]


def test_each_cold_restart_says_what_came_before_it():
    """A cold restart that no fault's row explains (CI saw one after the job's stop,
    every fault recovered warm, and the verdict said only that the job did not finish)
    says what the ranks and launchers said since the attempt before it."""
    events = [ev(10, "attempt_start", host="node1", restart_count=0),
              ev(12, "step", step=1),
              ev(20, "failure", rank=1, error="RuntimeError: Connection closed by peer"),
              ev(49, "collective_stuck", rank=2, waited_s=7.5, collective={
                  "pg": "default_pg", "seq": 54, "op": "gloo:all_reduce"}),
              ev(50, "warm_recovery_failed", rank=3, reason="TimeoutError: the write of "
                                                            "checkpoint 10 did not end"),
              ev(60, "run_end", rank=0, steps=31, stopped=True),
              ev(61, "node_exit", host="node2", exit_code=1, torchrun_exit=1),
              ev(68, "attempt_start", host="node1", restart_count=1),
              ev(70, "failure", rank=0, error="later")]
    assert restarts(events) == [{
        "at_s": 58.0, "host": "node1", "restart_count": 1,
        "after": ["failure (rank 1): RuntimeError: Connection closed by peer",
                  "collective_stuck (rank 2): gloo:all_reduce #54 on default_pg",
                  "warm_recovery_failed (rank 3): TimeoutError: the write of checkpoint 10 "
                  "did not end",
                  "run_end (rank 0): step 31, stopped True", "node_exit (node2): exit 1"]}]
    assert restarts(events, shown=1)[0]["after"] == ["node_exit (node2): exit 1"]
    assert restarts(events[:7]) == []  # one attempt: no restart
    result = {"finished": False, "steps": 31, "faults": 0, "detected": 0, "correct": 0,
              "committed_checkpoints_lost": [], "verdicts": [],
              "restarts": restarts(events, shown=2)}
    assert ("cold restart at +58.0 s (rank 0 on node1, restart 1) after: run_end (rank 0): "
            "step 31, stopped True; node_exit (node2): exit 1") in table(result, ci=False)
