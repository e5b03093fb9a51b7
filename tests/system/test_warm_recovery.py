"""The warm path across "nodes" (``llmtrain launch`` agents on loopback, a rendezvous store
of its own, real kills): survivors keep their processes, a warm spare takes the lost
rank's place, state comes back from memory; and the cold path when the warm one cannot."""

import os
import shutil
import signal
import time

import pytest
import torch
from conftest import check, events, llmtrain, step_losses, wait_for_event
from nvml_states import node, write_script
from test_elastic import final_weights

from llmtrain.checkpoint import storage
from llmtrain.checkpoint.storage import step_dir
from llmtrain.exit_codes import ExitCode
from llmtrain.launch.node import EXIT_GRACE_S
from llmtrain.recovery.pool import spares_waiting
from llmtrain.recovery.warm import job_namespace
from llmtrain.reliability.health.exclusion import excluded_hosts

STEPS = 45
TRAIN = ("--training.steps", str(STEPS), "--checkpoint.interval_steps", "20",
         "--metrics.log_every", "5", "--metrics.address", "127.0.0.1", "--metrics.port", "0")
# No --warm.enable: the warm path is the default under `llmtrain launch --external-store`.


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job run without a fault: its final weights."""
    run = tmp_path_factory.mktemp("warm") / "reference"
    check(llmtrain(run, *TRAIN, nproc=2))
    return final_weights(run, STEPS)


def host_of(run, rank: int) -> str:
    """The node whose process holds ``rank`` now (the last to start as that rank)."""
    return [e for e in events(run, "startup") if e["rank"] == rank][-1]["host"]


def test_three_faults_each_recovered_warm_and_the_weights_match(cluster, reference, tmp_path):
    """A node killed whole, then one rank's worker killed (its agent lives on), then a GPU
    failing its health check: each time a warm spare takes the lost rank, nobody restarts,
    and the run ends with the weights of a run that never failed, bit for bit."""
    # a lost node's silence waited out would take 10 s: its processes' connections to the
    # store's presence listener close as they die, and it is known at once. From step 32
    # every rank runs 3x slower (the same numbers): the job's tail outlasts node1's agent
    # ending (1.6 s after the second fault, its worker polled every second), which the
    # recoveries, now fast, had left 0.1-0.5 s short of the job's end.
    settle = ("--warm.settle_s", "10", "--reliability.faults", "slow@step:step=32,factor=3")
    c = cluster("2:2", TRAIN)
    c.start("node1", *settle)
    c.start("node2", *settle)
    scripts = {}
    for name in ("spare1", "spare2", "spare3"):
        scripts[name] = (tmp_path / f"{name}-gpus.json", node(1))
        write_script(*scripts[name])
        c.start(name, "--health.interval_s", "0.2", *settle, spare=True,
                env={"LLMTRAIN_NVML_SCRIPT": str(scripts[name][0])})

    def recovered(n: int, then_step: int | None, rank: int) -> dict:
        """The ``n``-th warm recovery, once training has reached ``then_step`` (watching the
        node that holds ``rank``)."""
        node = c.nodes[host_of(c.run, rank)]
        rec = wait_for_event(c.run, "warm_recovery", node, timeout=120,
                             where=lambda e: e["gen"] == n)
        if then_step is not None:
            wait_for_event(c.run, "step", node, timeout=120,
                           where=lambda e: e["step"] >= then_step)
        return rec

    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 10, timeout=180)
    c.kill("node2")  # 1: a node lost whole
    victim = next(e for e in events(c.run, "startup") if e["host"] == "node1")
    first = recovered(1, then_step=20, rank=victim["rank"])
    assert first["lost"] == [1 - victim["rank"]]
    assert first["parts_s"]["failure_detected->agreed"] < 3.0, first  # not settle_s
    os.kill(victim["pid"], signal.SIGKILL)  # 2: a worker killed; node1's agent lives on
    assert recovered(2, then_step=None, rank=1 - victim["rank"])["lost"] == [victim["rank"]]
    # 3: the GPU under rank 0 (now on a spare) fails as soon as the second recovery is
    # done, 25 steps (2-2.5 s) before the end; its monitor looks every 0.2 s. (Failed
    # after step 25 and node1's exit, a run once ended before the monitor saw it.)
    wait_for_event(c.run, "startup", c.nodes[host_of(c.run, 1 - victim["rank"])],
                   where=lambda e: e["rank"] == victim["rank"] and e["host"] != "node1")
    failing = host_of(c.run, 0)
    path, state = scripts[failing]
    state["gpus"][0]["ecc"]["volatile"]["sram"] = 1
    write_script(path, state)
    # node1's agent has no worker left: it ends at once, not after the job
    assert c.wait("node1", timeout=60) == ExitCode.CLEAN, c.log("node1")
    assert c.wait(failing) == ExitCode.EXCLUDE_NODE, c.log(failing)
    assert recovered(3, then_step=STEPS, rank=1)["lost"] == [0]
    for name in (n for n in scripts if n != failing):
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    end = max(e["ts"] for e in events(c.run, "run_end"))
    assert next(e for e in events(c.run, "node_exit") if e["host"] == "node1")["ts"] < end
    assert "ecc_volatile" in excluded_hosts(str(c.run))[failing]["reason"]
    assert not events(c.run, "warm_recovery_failed") and not events(c.run, "stop_vote")
    assert len(events(c.run, "attempt_start")) == 1  # nobody restarted
    got = final_weights(c.run, STEPS)
    assert reference.keys() == got.keys()
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


def test_a_standby_node_whose_spares_rank_was_lost_offers_a_new_spare(cluster, reference):
    """Two standby nodes. node2 dies: a spare takes its rank. That spare's worker is killed:
    the other standby node's spare takes the rank, and the first standby node, its rank
    lost and replaced, starts a new spare on that device. That new spare is the only one
    waiting when the second standby node's worker is killed in turn, and takes the rank:
    three warm recoveries, nobody restarted, the weights of a run that never failed."""
    # From step 10 every rank runs 3x slower (the same numbers): the job must outlast
    # two recoveries and a new spare's start (imports) before the third fault; at full
    # speed it once reached its end first.
    slow = ("--reliability.faults", "slow@step:step=10,factor=3")
    c = cluster("2:2", TRAIN)
    for name in ("node1", "node2"):
        c.start(name, *slow)
    for name in ("spare1", "spare2"):
        c.start(name, *slow, spare=True)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 8,
                   timeout=180)
    rank = next(e["rank"] for e in events(c.run, "startup") if e["host"] == "node2")
    c.kill("node2")
    holders = []
    for gen in (1, 2, 3):
        rec = wait_for_event(c.run, "warm_recovery", c.nodes["node1"], timeout=120,
                             where=lambda e: e["gen"] == gen)
        assert rec["lost"] == [rank] and rec["kind"] == "spare", rec
        holders.append(rec["hosts_joined"][str(rank)])
        spare = wait_for_event(c.run, "startup", c.nodes["node1"],
                               where=lambda e: e["ts"] > rec["ts"] - 5 and e["rank"] == rank
                               and e["host"] == holders[-1])
        if gen == 2:  # the new spare is in the pool once ready: the fault waits for it
            pool = job_namespace(c.store_client(), "local", c.env)
            deadline = time.monotonic() + 60
            while spares_waiting(pool) == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
        if gen < 3:
            os.kill(spare["pid"], signal.SIGKILL)
    # spare1, spare2, then the first of them again, on its new spare
    assert holders[0] != holders[1] and holders[2] == holders[0], holders
    for name in ("node1", "spare1", "spare2"):
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    assert not events(c.run, "warm_recovery_failed")
    assert len(events(c.run, "attempt_start")) == 1  # nobody restarted
    got = final_weights(c.run, STEPS)
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


def test_a_corrupted_replica_is_caught_and_the_cold_path_takes_over(cluster, reference):
    """The survivor's replica of the lost rank has a bit flipped in memory: its checksum
    catches it before the spare gets it, every rank goes cold, and the job still ends
    with the weights of a run that never failed."""
    c = cluster("2:2", TRAIN)
    flip = ("--reliability.faults", "bitflip@replica")
    for name in ("node1", "node2"):
        c.start(name, *flip)
    c.start("spare", *flip, spare=True)
    wait_for_event(c.run, "checkpoint_committed", c.nodes["node1"],
                   where=lambda e: e["step"] == 20, timeout=180)
    c.kill("node2")
    for name in ("node1", "spare"):
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    # named by the rank that holds it, before it is sent, and by the spare that needed it
    corrupt = {e["when"]: e for e in events(c.run, "snapshot_corrupt")}
    assert set(corrupt) == {"before restore", "restore"}, corrupt
    assert "fails its checksum" in corrupt["before restore"]["error"]
    failed = events(c.run, "warm_recovery_failed")
    assert failed and all("failed its check" in e["reason"] for e in failed), failed
    assert not events(c.run, "warm_recovery")
    assert [e["world_size"] for e in events(c.run, "attempt_start")] == [2, 2]  # cold
    got = final_weights(c.run, STEPS)
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


def test_when_the_warm_path_goes_cold_the_waiting_spare_joins_the_restart(cluster, reference):
    """No snapshot is held yet, so the warm path cannot replace the lost node and every
    rank goes cold; the restart's round lacks that node, and the warm spare, never
    claimed, leaves the pool and joins it as a node. The job ends with the weights of a
    run that never failed."""
    c = cluster("2:2", TRAIN)
    never = ("--warm.snapshot_every", "1000")
    for name in ("node1", "node2"):
        c.start(name, *never)
    c.start("spare", *never, spare=True)
    wait_for_event(c.run, "checkpoint_committed", c.nodes["node1"],
                   where=lambda e: e["step"] == 20, timeout=180)
    c.kill("node2")
    for name in ("node1", "spare"):
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    failed = events(c.run, "warm_recovery_failed")
    assert failed and all("no snapshot step" in e["reason"] for e in failed), failed
    assert [e["world_size"] for e in events(c.run, "attempt_start")] == [2, 2]
    assert "spare" in {e["host"] for e in events(c.run, "startup")}
    got = final_weights(c.run, STEPS)
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


@pytest.mark.parametrize("point,reason,within_s", [
    # it died in its generation before it formed: known at once (its presence, or its
    # launcher, marks it gone there), where the survivor waited out warm.budget_s
    ("spare_assigned", "was lost before it formed", 2),
    # it came, then died before the group formed: the group's creation waits the budget
    ("spare_arrived", "DistStoreError", 4 + 1)])
def test_a_spare_that_dies_once_claimed_sends_the_job_cold_within_the_budget(
        cluster, reference, point, reason, within_s):
    """The claimed spare dies before it joins (or once it came, before the group forms):
    the survivor stops waiting for it as soon as it is known dead, or when warm.budget_s is
    spent (not after the group's 300 s creation timeout), every rank goes cold, the
    spare's node joins the restart, and the weights match a run without faults."""
    c = cluster("2:2", TRAIN)
    budget = ("--warm.budget_s", "4")
    for name in ("node1", "node2"):
        c.start(name, *budget)
    c.start("spare", *budget, "--reliability.faults", f"kill@{point}", spare=True)
    wait_for_event(c.run, "checkpoint_committed", c.nodes["node1"],
                   where=lambda e: e["step"] == 20, timeout=180)
    c.kill("node2")
    for name in ("node1", "spare"):
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    failure = next(e for e in events(c.run, "failure") if e.get("path") == "warm")
    failed = events(c.run, "warm_recovery_failed")
    assert len(failed) == 1 and reason in failed[0]["reason"], failed
    assert failed[0]["ts"] - failure["ts"] < within_s, failed
    assert not events(c.run, "warm_recovery")
    assert [e["world_size"] for e in events(c.run, "attempt_start")] == [2, 2]
    got = final_weights(c.run, STEPS)
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


def test_a_replication_thread_that_never_returns_is_left_behind(cluster, reference):
    """Both ranks' replication threads stop before exchanging step 12, as a thread does
    whose gloo transfer lost its peer midway (gloo cannot abort it). When node2 dies, the
    survivor leaves its thread behind with the old group instead of going cold, restores
    the last snapshot both ranks exchanged, and ends with the weights of a run that never
    failed."""
    c = cluster("2:2", TRAIN)
    every_step = ("--warm.snapshot_budget", "0")  # step 12's snapshot, whatever it costs
    for name in ("node1", "node2"):
        c.start(name, *every_step, "--reliability.faults", "hang@replicate:step=12")
    c.start("spare", *every_step, spare=True)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 15,
                   timeout=180)
    c.kill("node2")
    for name in ("node1", "spare"):
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    # torchrun's exit barrier, which node2's agent never reaches, is not waited for: node1
    # ends before its launcher would have had to stop the agent
    end = max(e["ts"] for e in events(c.run, "run_end"))
    node1 = next(e for e in events(c.run, "node_exit") if e["host"] == "node1")
    assert node1["torchrun_exit"] == 0 and node1["ts"] - end < EXIT_GRACE_S
    assert not events(c.run, "warm_recovery_failed")
    (recovery,) = events(c.run, "warm_recovery")
    # not awaited: waiting for the thread would spend warm.budget_s (30 s), then go cold
    # the last snapshot exchanged before the threads stopped: 11, or earlier where a busy
    # thread skipped snapshots (never one the stuck threads held)
    assert recovery["step"] <= 11 and recovery["total_s"] < 10, recovery
    assert len(events(c.run, "attempt_start")) == 1  # nobody restarted
    got = final_weights(c.run, STEPS)
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


def test_a_rank_whose_own_step_fails_is_replaced_never_its_waiting_peer(cluster, reference):
    """An EIO reading node2's batch at step 12, then a RuntimeError in node1's own step 30
    (not a collective's): each time the rank that failed leaves and a spare takes its
    place, while its healthy peer, blocked in the step's collective, keeps its process.
    Nobody restarts, and the weights are those of a run that never failed."""
    c = cluster("2:2", TRAIN)
    c.start("node1", "--reliability.faults", "error@loss:step=30")
    c.start("node2", "--reliability.faults", "eio@data_read:step=12")
    c.start("spare1", spare=True)
    c.start("spare2", spare=True)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 5,
                   timeout=180)
    first, second = (next(e["rank"] for e in events(c.run, "startup") if e["host"] == host)
                     for host in ("node2", "node1"))
    for name in c.nodes:
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    failures = {e["rank"]: e for e in events(c.run, "failure") if e.get("cause") == "local"}
    assert set(failures) == {first, second}, failures
    assert "Input/output error" in failures[first]["error"]
    assert "of this rank's own" in failures[second]["error"]
    peers = [e for e in events(c.run, "failure") if e.get("cause") == "peer"]
    # the healthy ones, one each time (an event names the last step done)
    assert {e["step"] for e in peers} == {11, 29}, peers
    recoveries = sorted(events(c.run, "warm_recovery"), key=lambda e: e["gen"])
    assert [r["lost"] for r in recoveries] == [[first], [second]], recoveries
    # each event names the nodes: the one that failed, and the spare that took its rank
    assert [r["hosts_lost"] for r in recoveries] == [{str(first): "node2"},
                                                     {str(second): "node1"}], recoveries
    for r in recoveries:
        (host,) = r["hosts_joined"].values()
        assert host in ("spare1", "spare2") and list(r["hosts_joined"]) == [str(r["lost"][0])]
    assert {f["host"] for f in failures.values()} == {"node1", "node2"}
    assert not events(c.run, "warm_recovery_failed")
    assert len(events(c.run, "attempt_start")) == 1  # nobody restarted
    got = final_weights(c.run, STEPS)
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


def test_a_node_lost_without_a_spare_shrinks_the_job_and_a_spare_that_comes_grows_it_back(
        cluster, tmp_path):
    """Rank 1's worker dies at step 15 and no spare waits: rank 0 goes on alone, in its
    own process, its state resharded from its snapshot of step 10 and its ward's replica
    (no restart, no checkpoint read). A spare that comes later is taken in at a step
    boundary, its shard resharded from rank 0's memory. Each part trains as a cold resume
    at its world size would, bit for bit: at 1 rank from the checkpoint of step 10, then
    at 2 ranks from that run's checkpoint of the grow's step. Every checkpoint is kept.
    Saves are synchronous: the cold resumes start from the checkpoint of step 10, and an
    async write of it still in flight at step 15 (a loaded CI machine) died with rank 1
    and was never committed, as it should not be."""
    job = ("--training.steps", "80", "--checkpoint.interval_steps", "10",
           "--checkpoint.mode", "sync",
           "--checkpoint.keep_last", "100", "--warm.snapshot_every", "10",
           "--metrics.log_every", "1", "--metrics.address", "127.0.0.1", "--metrics.port", "0")
    slow = tmp_path / "faults.txt"  # armed while the spare starts: time only, not numbers
    c = cluster("1:2", (*job, "--reliability.faults", "env"),
                env={"LLMTRAIN_FAULTS": "kill@step:rank=1,step=15",
                     "LLMTRAIN_FAULTS_FILE": str(slow)})
    c.start("node1")
    c.start("node2")
    wait_for_event(c.run, "step", c.nodes["node1"], timeout=180)
    survivor = c.nodes[host_of(c.run, 0)]
    shrink = wait_for_event(c.run, "warm_recovery", survivor, timeout=120)
    slow.write_text("slow@step:rank=0,factor=4,id=slow\n")
    c.start("node3", spare=True)
    wait_for_event(c.run, "warm_grow", survivor, timeout=120)
    slow.write_text("")
    for name in ("node1", "node2", "node3"):  # node2's rank went: it ends, no restart
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    assert (shrink["kind"], shrink["lost"], shrink["step"], shrink["world_size"]) == (
        "shrink", [1], 10, 1)
    first_rank1 = next(e["host"] for e in events(c.run, "startup") if e["rank"] == 1)
    assert (shrink["hosts_lost"], shrink["hosts_joined"]) == ({"1": first_rank1}, {})
    (grow,) = events(c.run, "warm_grow")
    assert (grow["joined"], grow["hosts_joined"]) == ([1], {"1": "node3"}), grow
    g = grow["step"]
    assert grow["world_size"] == 2 and shrink["ts"] < grow["ts"] and 10 < g < 80
    assert [e["world_size"] for e in events(c.run, "attempt_start")] == [2]
    assert not events(c.run, "checkpoint_loaded")
    losses = {e["step"]: e["loss"] for e in events(c.run, "step")
              if e["ts"] > shrink["ts"] and e["rank"] == 0}
    assert sorted(losses) == list(range(11, 81))
    for step in range(10, 81, 10):
        assert storage.verify(step_dir(str(c.run / "checkpoints"), step), checksums=True) == []

    alone, grown = tmp_path / "alone", tmp_path / "grown"
    shutil.copytree(step_dir(str(c.run / "checkpoints"), 10),
                    step_dir(str(alone / "checkpoints"), 10))
    check(llmtrain(alone, *job, "--checkpoint.interval_steps", str(g)))
    shutil.copytree(step_dir(str(alone / "checkpoints"), g), step_dir(str(grown / "checkpoints"), g))
    check(llmtrain(grown, *job, nproc=2))
    assert events(grown, "checkpoint_loaded")[0]["step"] == g
    cold = {s: loss for s, loss in step_losses(alone).items() if 10 < s <= g}
    cold |= {s: loss for s, loss in step_losses(grown).items() if s > g}
    assert losses == cold
