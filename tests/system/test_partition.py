"""A partition, for real: "nodes" in network namespaces of their own, one node's link
taken down while its processes live. The job must go on without it, and when the link
comes back, the cut-off rank, which was in the middle of a checkpoint write, must not
write into the job's storage: the job has re-formed without it (fencing)."""

import os
import signal
import time
from pathlib import Path

from conftest import events, wait_for_event
from needs import netns

from llmtrain.chaos.netns import Network
from llmtrain.checkpoint import storage
from llmtrain.config import CheckpointConfig

STEPS = 30


def test_a_partitioned_rank_that_comes_back_is_fenced_out_of_the_checkpoints(cluster, tmp_path):
    netns()
    faults = tmp_path / "faults.txt"
    # rank 1 stops inside its shard write of step 20 (a writer stalled, as on a hard NFS
    # mount that lost its server): its late write is what the fence must refuse
    faults.write_text("sigstop@checkpoint_write:rank=1,step=20,id=stall\n")
    ckpt = tmp_path / "ckpt"
    network = Network(tmp_path)
    c = cluster("2:2", ("--training.steps", str(STEPS), "--checkpoint.interval_steps", "10",
                        "--checkpoint.keep_last", "10", "--checkpoint.url", str(ckpt),
                        "--metrics.address", "127.0.0.1", "--metrics.port", "0",
                        "--health.monitor", "false", "--reliability.faults", "env",
                        "--warm.enable", "false"),  # the fence under a cold restart
                env={"LLMTRAIN_FAULTS_FILE": str(faults)}, network=network, max_restarts=3)
    for name in ("node1", "node2"):
        c.start(name)
    c.start("node3", spare=True)
    struck = Path(f"{faults}.fired/stall.1")
    deadline = time.time() + 180
    while not struck.exists():
        assert time.time() < deadline, c.log("node1")
        time.sleep(0.2)
    cut_off = {e["rank"]: e for e in events(c.run, "startup")}[1]
    network.cut(cut_off["host"])
    cut = time.time()

    # the others name the silent rank, restart without its node (the spare takes its
    # place), and commit step 20 again, from the checkpoint of step 10
    recovery = wait_for_event(c.run, "recovery", c.nodes["node1"], timeout=240,
                              where=lambda e: e["ts"] > cut)
    hang = [e for e in events(c.run, "hang") if e["ts"] > cut][0]
    assert 1 in hang["culprits"], hang
    # each rank says its start-up at its first step: the spare's may come after rank 0's
    wait_for_event(c.run, "startup", c.nodes["node1"], timeout=60,
                   where=lambda e: e["ts"] > cut and e["host"] == "node3")
    assert {e["host"] for e in events(c.run, "startup") if e["ts"] > cut} == {"node1", "node3"}
    committed = wait_for_event(c.run, "checkpoint_committed", c.nodes["node1"], timeout=120,
                               where=lambda e: e["ts"] > recovery["ts"] and e["step"] == 20)
    step20 = storage.step_dir(str(ckpt), 20)
    assert storage.verify(step20, checksums=True) == []
    written = {p.name: p.stat().st_mtime_ns for p in Path(step20).iterdir()}

    # the link comes back and the stalled writer wakes up, in a job that moved on
    network.heal(cut_off["host"])
    os.kill(cut_off["pid"], signal.SIGCONT)
    # the job may finish its last steps first: what must live until the event is the
    # cut-off node, whose rank writes it
    fenced = wait_for_event(c.run, "fenced", c.nodes[cut_off["host"]], timeout=60,
                            where=lambda e: e["ts"] > committed["ts"])
    assert fenced["host"] == cut_off["host"] and fenced["rank"] == 1
    # whichever of its threads asks first: one of the stalled writer's threads (one shard
    # file each), or its watchdog (which would otherwise answer the hang it missed, and
    # end the process before the write)
    assert fenced["what"] in (*(f"checkpoint file {step20}/__1_{i}.distcp"
                                for i in range(CheckpointConfig().writer_threads)),
                              "the watchdog's heartbeats and reports"), fenced
    assert "re-formed as" in fenced["reason"] and "without this rank" in fenced["reason"]
    # the step-20 checkpoint the job committed is untouched. (Without the fence the late
    # writer rewrites its two shard files there; a replay is bitwise deterministic here,
    # so only the files' times would show it.)
    time.sleep(1)
    assert {p.name: p.stat().st_mtime_ns for p in Path(step20).iterdir()} == written
    assert storage.verify(step20, checksums=True) == []
    assert c.wait("node1") == 0 and c.wait("node3") == 0
    assert events(c.run, "run_end")[-1]["steps"] == STEPS
