"""The exporter counts the failures the event log records: a failed save, a failed retention
pass, a failed snapshot replication, each as a counter that starts at 0 (so that the alerts'
increase() sees the first one) and carries no error text as a label."""

from llmtrain.config import MetricsConfig
from llmtrain.events import EventLog
from llmtrain.metrics.prometheus import Exporter

FAILURES = {  # event -> the counter it increments
    "checkpoint_failed": "llmtrain_checkpoint_failures_total",
    "checkpoint_retention_failed": "llmtrain_checkpoint_retention_failures_total",
    "snapshot_replication_failed": "llmtrain_snapshot_replication_failures_total",
    "checkpoint_passed_over": "llmtrain_checkpoint_passed_over_total",
    "fence_unreachable": "llmtrain_fence_unreachable_total",
}


def exporter(run_dir, rank: int) -> Exporter:
    return Exporter(MetricsConfig(port=0), str(run_dir), rank=rank, local_rank=rank, host="h",
                    world_size=2)


def value(e: Exporter, name: str) -> float | None:
    return e.registry.get_sample_value(name, e.base)


def series_labels(e: Exporter, name: str) -> list[dict]:
    return [s.labels for m in e.registry.collect() for s in m.samples if s.name == name]


def test_failure_events_increment_their_counters(tmp_path):
    e = exporter(tmp_path, 0)
    assert {name: value(e, name) for name in FAILURES.values()} == dict.fromkeys(
        FAILURES.values(), 0.0)
    e.observe({"ts": 1.0, "event": "checkpoint_failed", "rank": 0, "step": 10,
               "error": "OSError: [Errno 28] No space left on device"})
    e.observe({"ts": 2.0, "event": "checkpoint_retention_failed", "rank": 0, "step": 20,
               "error": "PermissionError: [Errno 13] Permission denied: '/ckpt/step-5'"})
    e.observe({"ts": 2.5, "event": "checkpoint_retention_failed", "rank": 0, "step": 30,
               "error": "OSError: [Errno 5] Input/output error"})
    e.observe({"ts": 3.0, "event": "snapshot_replication_failed", "rank": 0, "buddy": 1,
               "ward": 1, "step": 21, "stale": False,
               "error": "RuntimeError: Connection closed by peer"})
    # a thread a recovery left behind: its failure is expected, logged but not counted
    e.observe({"ts": 4.0, "event": "snapshot_replication_failed", "rank": 0, "buddy": 1,
               "ward": 1, "step": 22, "stale": True,
               "error": "RuntimeError: Connection closed by peer"})
    e.observe({"ts": 5.0, "event": "checkpoint_passed_over", "rank": 0, "step": 12,
               "tries": 3, "reason": "OSError: [Errno 5] Input/output error"})
    e.observe({"ts": 6.0, "event": "fence_unreachable", "rank": 0, "what": "the commit",
               "mine": "1-a/g0", "timeout_s": 10.0, "error": "TimeoutError: no answer"})
    assert value(e, "llmtrain_checkpoint_passed_over_total") == 1
    assert value(e, "llmtrain_fence_unreachable_total") == 1
    assert value(e, "llmtrain_checkpoint_failures_total") == 1
    assert value(e, "llmtrain_checkpoint_retention_failures_total") == 2
    assert value(e, "llmtrain_snapshot_replication_failures_total") == 1
    for name in FAILURES.values():  # one series per rank: the error is never a label
        assert series_labels(e, name) == [e.base], name


def test_every_rank_counts_its_replication_failures_from_0(tmp_path):
    """Any rank may fail to replicate, and any rank may count a warm recovery (the lowest
    survivor); retention runs on rank 0 only, like the run-wide counts."""
    e = exporter(tmp_path, 1)
    assert value(e, "llmtrain_snapshot_replication_failures_total") == 0
    assert value(e, "llmtrain_warm_recoveries_total") == 0
    assert value(e, "llmtrain_fence_unreachable_total") == 0
    assert value(e, "llmtrain_checkpoint_retention_failures_total") is None


def test_a_restarted_rank_carries_its_retention_failures_not_its_replication_ones(tmp_path):
    """A retention failure stays a failure of the run (its checkpoints are still there);
    replication starts afresh in the new process, so its count does too."""
    log = EventLog(str(tmp_path), 0)
    log.emit("checkpoint_retention_failed", step=20, error="OSError: boom")
    log.emit("checkpoint_failed", step=30, error="OSError: boom")
    log.emit("snapshot_replication_failed", buddy=1, ward=1, step=31, stale=False,
             error="RuntimeError: Connection closed by peer")
    log.close()
    e = exporter(tmp_path, 0)
    e._replay_history()
    assert value(e, "llmtrain_checkpoint_retention_failures_total") == 1
    assert value(e, "llmtrain_checkpoint_failures_total") == 1
    assert value(e, "llmtrain_snapshot_replication_failures_total") == 0


def test_a_rank_other_than_0_replays_only_its_own_log(tmp_path):
    """Every rank replays its history at every start: rank 1 reads its own files only
    (N ranks each reading every rank's log would be N² reads of the run's storage at each
    restart), rank 0 the whole log, for the run-wide counts any rank may have written."""
    for rank in (0, 1, 10):
        log = EventLog(str(tmp_path), rank)
        log.emit("fence_unreachable", what="the commit", mine="1-a/g0", timeout_s=10.0,
                 error="TimeoutError: no answer")
        log.emit("hang", reason="rank 2 sent no heartbeat", culprits=[2])
        log.close()
    # a line in rank 0's file that names rank 1: read, it would count for rank 1
    with open(tmp_path / "events" / "rank-0.jsonl", "a") as f:
        f.write('{"ts": 9.0, "event": "fence_unreachable", "rank": 1, "what": "x", '
                '"mine": "1-a/g0", "timeout_s": 10.0, "error": "TimeoutError"}\n')
    one, zero = exporter(tmp_path, 1), exporter(tmp_path, 0)
    for e in (one, zero):
        e._replay_history()
    assert value(one, "llmtrain_fence_unreachable_total") == 1
    assert value(zero, "llmtrain_fence_unreachable_total") == 1
    assert value(zero, "llmtrain_hangs_total") == 3  # run-wide: every rank's report
    assert value(one, "llmtrain_hangs_total") == 1  # the report it wrote itself
