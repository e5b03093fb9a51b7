"""Chaos fault kinds register themselves, each from a module of its own
(llmtrain/chaos/kinds/): one table of kinds, which the default schedule runs and unknown
names are refused against."""

import pytest

from llmtrain.chaos.kinds import FAULT_KINDS, KINDS, kinds_named
from llmtrain.chaos.logs import log_sizes, tracebacks
from llmtrain.chaos.runner import Chaos, ChaosConfig
from llmtrain.config import ConfigError

# the order the kinds register in: a seed's schedule draws from it, so it must not move
ORDER = ("kill_rank", "kill_in_save", "hang", "desync", "slow_rank", "node_loss", "partition",
         "lossy_link", "preempt", "enospc", "eio", "unreadable_checkpoint", "slow_retention",
         "store_stall", "store_restart", "gpu_bad", "truncated_shard", "nan", "bitflip")


def test_every_kind_comes_from_a_module_of_its_own_and_the_default_runs_them_all():
    assert KINDS == tuple(FAULT_KINDS) == ORDER
    for name, kind in FAULT_KINDS.items():
        assert kind.name == name and kind.inject.__name__ == name
        module = kind.inject.__module__
        assert module.startswith("llmtrain.chaos.kinds."), module
        # enospc and eio are one scenario with two errors
        assert module.rpartition(".")[2] in (name, "storage_error"), module
    assert [k.name for k in kinds_named(ChaosConfig().faults)] == list(KINDS)
    assert [k for k in KINDS if FAULT_KINDS[k].needs_netns] == ["partition", "lossy_link"]


def test_an_unknown_kind_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown fault kind\(s\) \['bogus'\]; known: ") as e:
        Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults="hang,bogus"))
    assert all(kind in str(e.value) for kind in KINDS)


def test_a_restarted_store_serves_again_empty_on_the_same_address(tmp_path):
    """store_restart's store: killed with SIGKILL and started again on the same port,
    every key gone; a client connects to it as to the old one."""
    from llmtrain.chaos.local_cluster import LocalCluster

    cluster = LocalCluster(tmp_path, tmp_path / "run", "1:1", ())
    try:
        before = cluster.store_client()
        before.set("fence/token", "1-abc/g0")
        old, port = cluster.store.pid, cluster.port
        cluster.restart_store(down_s=0.5)
        assert cluster.store.pid != old and cluster.store.poll() is None
        assert cluster.port == port
        with pytest.raises(RuntimeError):  # DistNetworkError: its connection was reset
            before.get("fence/token")
        after = cluster.store_client()
        assert not after.check(["fence/token"])
        after.set("k", "v")
        assert after.get("k") == b"v"
    finally:
        cluster.close()


def test_tracebacks_in_the_nodes_logs_are_named_by_node_and_exception(tmp_path):
    names = ["node1", "node2", "node3"]
    (tmp_path / "node1.log").write_text(
        "step 5/200 | loss 4.7\n"  # before the mark
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "ValueError: an old one\n")
    mark = log_sizes(tmp_path, names)
    with open(tmp_path / "node1.log", "a") as f:
        f.write("the rendezvous store failed; the workers go on\n"
                "[rank0]: Traceback (most recent call last):\n"
                "[rank0]:   File \"warm.py\", line 142, in spares_waiting\n"
                "[rank0]:     return store.add(\"spares/registered\", 0)\n"
                "[rank0]: torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.\n")
    (tmp_path / "node2.log").write_text(
        "Traceback (most recent call last):\n  File \"run.py\", line 9, in main\n"
        "    raise RendezvousConnectionError(\n"
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection"
        " to the C10d store has failed.\n")
    assert tracebacks(tmp_path, names, mark, None) == [
        "node1: DistNetworkError: Failed to recv, got 0 bytes.",
        "node2: RendezvousConnectionError: The connection to the C10d store has failed."]
    assert tracebacks(tmp_path, names, {}, mark) == ["node1: ValueError: an old one"]
