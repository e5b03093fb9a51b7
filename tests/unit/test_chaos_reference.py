"""The fault-free reference chaos compares against skips what the job skipped for good."""

from llmtrain.chaos.timeline import skipped_at_last


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
