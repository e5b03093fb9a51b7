"""The warm path across "nodes" (``llmtrain launch`` agents on loopback, a rendezvous store
of its own, real kills): survivors keep their processes, a warm spare takes the lost
rank's place, state comes back from memory; and the cold path when the warm one cannot."""

import os
import signal

import pytest
import torch
from conftest import check, events, llmtrain, wait_for_event
from nvml_states import node, write_script
from test_elastic import final_weights

from llmtrain.chaos.local_cluster import LocalCluster
from llmtrain.exit_codes import ExitCode
from llmtrain.reliability.health.exclusion import excluded_hosts

STEPS = 40
TRAIN = ("--training.steps", str(STEPS), "--checkpoint.interval_steps", "20",
         "--metrics.log_every", "5", "--metrics.address", "127.0.0.1", "--metrics.port", "0",
         "--warm.enable", "true")


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(nnodes: str) -> LocalCluster:
        made.append(LocalCluster(tmp_path, tmp_path / "run", nnodes,
                                 ("--config", "debug_cpu", *TRAIN)))
        return made[-1]
    yield make
    for c in made:
        c.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job run without a fault: its final weights."""
    run = tmp_path_factory.mktemp("warm") / "reference"
    check(llmtrain(run, *TRAIN, nproc=2))
    return final_weights(run, STEPS, run.parent)


def assert_same_weights(reference: dict, run, tmp_path) -> None:
    got = final_weights(run, STEPS, tmp_path)
    assert reference.keys() == got.keys()
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


def test_a_killed_node_is_replaced_warm_and_the_weights_match(cluster, reference, tmp_path):
    c = cluster("2:2")
    for name in ("node1", "node2"):
        c.start(name)
    c.start("node3", spare=True)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 10, timeout=180)
    c.kill("node2")
    assert c.wait("node1") == ExitCode.CLEAN, c.log("node1")
    assert c.wait("node3") == ExitCode.CLEAN, c.log("node3")
    (rec,) = events(c.run, "warm_recovery")
    assert rec["lost"] == [1] and rec["step"] >= 10, rec
    assert not events(c.run, "warm_recovery_failed")
    # no cold restart: one attempt, and the survivor is the process that started
    assert len(events(c.run, "attempt_start")) == 1
    assert_same_weights(reference, c.run, tmp_path)


def test_a_killed_rank_is_replaced_warm_and_its_agent_does_not_restart(cluster, reference,
                                                                     tmp_path):
    c = cluster("2:2")
    for name in ("node1", "node2"):
        c.start(name)
    c.start("node3", spare=True)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 10, timeout=180)
    victim = next(e for e in events(c.run, "startup") if e["host"] == "node2")
    os.kill(victim["pid"], signal.SIGKILL)  # the worker only: its agent lives on
    for name in ("node1", "node2", "node3"):
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    (rec,) = events(c.run, "warm_recovery")
    assert rec["lost"] == [victim["rank"]], rec
    assert len(events(c.run, "attempt_start")) == 1  # no agent restarted its workers
    assert_same_weights(reference, c.run, tmp_path)


def test_without_a_warm_spare_the_cold_path_takes_over(cluster):
    c = cluster("1:2")
    for name in ("node1", "node2"):
        c.start(name)
    wait_for_event(c.run, "checkpoint_committed", c.nodes["node1"],
                   where=lambda e: e["step"] == 20, timeout=180)
    c.kill("node2")
    assert c.wait("node1") == ExitCode.CLEAN, c.log("node1")
    (failed,) = events(c.run, "warm_recovery_failed")
    assert "no warm spare" in failed["reason"], failed
    assert [e["world_size"] for e in events(c.run, "attempt_start")] == [2, 1]
    assert events(c.run, "run_end")[-1]["steps"] == STEPS


def test_a_gpu_failing_mid_run_is_replaced_warm(cluster, tmp_path):
    script = tmp_path / "node2-gpus.json"
    state = node(1)
    write_script(script, state)
    c = cluster("2:2")
    c.start("node1")
    c.start("node2", "--health.interval_s", "1", env={"LLMTRAIN_NVML_SCRIPT": str(script)})
    c.start("node3", spare=True)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 10, timeout=180)
    state["gpus"][0]["ecc"]["volatile"]["sram"] = 1
    write_script(script, state)
    assert c.wait("node2") == ExitCode.EXCLUDE_NODE, c.log("node2")
    assert c.wait("node1") == ExitCode.CLEAN, c.log("node1")
    assert c.wait("node3") == ExitCode.CLEAN, c.log("node3")
    assert "ecc_volatile" in excluded_hosts(str(c.run))["node2"]["reason"]
    (rec,) = events(c.run, "warm_recovery")
    assert len(rec["lost"]) == 1, rec
    assert not events(c.run, "stop_vote")  # no vote, no save, no restart
    assert len(events(c.run, "attempt_start")) == 1
    assert events(c.run, "run_end")[-1]["steps"] == STEPS
