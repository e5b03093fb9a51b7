"""The warm path with tensor parallelism inside each node: 2 "nodes" of 2 ranks (a tp 2
group each, one HSDP replica each), real kills. A lost rank's place is taken by a spare
from the memory of its buddy; a node lost with no spare drops its whole replica and the
other goes on from its own memory; a spare that comes later is a new replica, its tensors
sent by the ranks of the same place in the surviving one."""

import os
import signal

import pytest
import torch
from conftest import check, events, llmtrain, step_losses, wait_for_event
from test_elastic import final_weights

from llmtrain.checkpoint import storage
from llmtrain.exit_codes import ExitCode

pytestmark = pytest.mark.slow

STEPS = 60
TRAIN = ("--training.steps", str(STEPS), "--checkpoint.interval_steps", "10",
         "--warm.snapshot_every", "10", "--metrics.log_every", "1",
         "--metrics.address", "127.0.0.1", "--metrics.port", "0",
         "--parallelism.tp", "2", "--training.micro_batch_size", "4",
         "--parallelism.dp_replicate", "-1", "--parallelism.dp_shard", "1")
NODE = ("--nproc-per-node", "2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job, 4 ranks under torchrun, no fault: its run dir."""
    run = tmp_path_factory.mktemp("warm_tp") / "reference"
    check(llmtrain(run, *TRAIN, nproc=4))
    return run


def test_a_tp_rank_killed_is_replaced_by_a_spare_from_memory_bit_for_bit(cluster, reference):
    """One worker of node2 (one half of a tp group) is killed: its place goes to a spare,
    which takes that rank's shards of the last snapshot from the buddy's replica; nobody
    restarts, and the run ends with the weights of a run that never failed."""
    c = cluster("2:2", TRAIN)
    c.start("node1", *NODE)
    c.start("node2", *NODE)
    c.start("spare1", *NODE, spare=True)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 12,
                   timeout=180)
    victim = next(e for e in events(c.run, "startup") if e["host"] == "node2")
    os.kill(victim["pid"], signal.SIGKILL)
    rec = wait_for_event(c.run, "warm_recovery", c.nodes["node1"], timeout=120)
    assert (rec["kind"], rec["lost"], rec["joined"]) == ("spare", [victim["rank"]],
                                                        [victim["rank"]]), rec
    assert rec["hosts_joined"] == {str(victim["rank"]): "spare1"}, rec
    assert c.wait("node1") == ExitCode.CLEAN, c.log("node1")
    assert len(events(c.run, "attempt_start")) == 1  # nobody restarted
    assert not events(c.run, "checkpoint_loaded") and not events(c.run, "warm_path_off")
    ref, got = final_weights(reference, STEPS), final_weights(c.run, STEPS)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def test_a_tp_node_lost_without_a_spare_drops_its_replica_and_a_spare_grows_it_back(
        cluster, reference, tmp_path):
    """node2 dies whole at step 15 and no spare waits: node1's tp group, a replica of its
    own, goes on alone from its snapshot of step 10 (nothing sent, nothing read from
    storage). Two spares that come later (a standby launcher offers one spare, whatever
    its --nproc-per-node) are taken in as a second replica, each sent its tensors by the
    survivor of the same tp place. Every step trains as
    the 4-rank run did: the same samples in the same global batch, the losses equal but
    for float32 reduction order (the tolerance of tests/integration/test_tensor_parallel)."""
    slow = tmp_path / "faults.txt"  # armed while the spare starts: time only, not numbers
    c = cluster("1:2", (*TRAIN, "--reliability.faults", "env"),
                env={"LLMTRAIN_FAULTS_FILE": str(slow)})
    c.start("node1", *NODE)
    c.start("node2", *NODE)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 15,
                   timeout=180)
    c.kill("node2")
    shrink = wait_for_event(c.run, "warm_recovery", c.nodes["node1"], timeout=120)
    slow.write_text("slow@step:factor=4,id=slow\n")
    c.start("node3", *NODE, spare=True)
    c.start("node4", *NODE, spare=True)
    grow = wait_for_event(c.run, "warm_grow", c.nodes["node1"], timeout=120)
    slow.write_text("")
    for name in ("node1", "node3", "node4"):
        assert c.wait(name) == ExitCode.CLEAN, c.log(name)
    assert (shrink["kind"], len(shrink["lost"]), shrink["step"],
            shrink["world_size"]) == ("shrink", 2, 10, 2), shrink
    assert set(shrink["hosts_lost"].values()) == {"node2"}, shrink
    assert (len(grow["joined"]), grow["world_size"]) == (2, 4), grow
    assert set(grow["hosts_joined"].values()) == {"node3", "node4"}, grow
    assert len(events(c.run, "attempt_start")) == 1 and not events(c.run, "checkpoint_loaded")
    ref, got = step_losses(reference), step_losses(c.run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=2e-4), step
    assert storage.verify(storage.step_dir(str(c.run / "checkpoints"), STEPS),
                          checksums=True) == []
