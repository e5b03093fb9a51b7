"""Chaos follows its job's event log (llmtrain/chaos/job.py): each look reads only what
was written since the last, and the events stay in time order across the processes'
files, as a whole read of the log gives them."""

import json
import random

from llmtrain.chaos.job import Job
from llmtrain.chaos.runner import Chaos, ChaosConfig
from llmtrain.events import read_events


def test_the_jobs_log_is_followed_in_time_order_across_processes(tmp_path):
    """Chaos follows the job's log (each look reads what is new): an event another process
    wrote late, older than what was read already, takes its place by time, for every kind
    and for all; ``since`` and ``latest`` see the log as a whole read of it would."""
    chaos = Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults="kill_rank"))
    job = Job(chaos.cfg, tmp_path, ["node1", "node2"], 0, cluster=None, mount=None,
              network=None, faults_file=tmp_path / "faults.txt", rng=random.Random(0))
    assert job.events() == [] and job.latest("step") is None  # no log yet
    events = tmp_path / "run" / "events"
    events.mkdir(parents=True)

    def write(rank: int, *lines: tuple[float, str]) -> None:
        with open(events / f"rank-{rank}.jsonl", "a") as f:
            for ts, kind in lines:
                f.write(json.dumps({"ts": ts, "event": kind, "rank": rank, "step": ts}) + "\n")
    write(0, (1.0, "step"), (3.0, "step"))
    write(1, (2.0, "health"))
    assert [e["ts"] for e in job.events()] == [1.0, 2.0, 3.0]
    write(1, (2.5, "step"), (4.5, "health"))  # rank 1's, older than rank 0's last
    write(0, (4.0, "step"))
    assert [e["ts"] for e in job.events()] == [1.0, 2.0, 2.5, 3.0, 4.0, 4.5]
    assert [e["ts"] for e in job.events("step")] == [1.0, 2.5, 3.0, 4.0]
    assert [e["ts"] for e in job.events("step", since=2.5)] == [2.5, 3.0, 4.0]
    assert job.latest("health")["ts"] == 4.5 and job.step() == 4.0
    assert job.events() == read_events(str(job.run))  # as a whole read gives it
