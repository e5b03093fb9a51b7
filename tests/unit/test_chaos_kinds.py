"""Chaos fault kinds register themselves (llmtrain/chaos/runner.py): one table of kinds,
which the default schedule runs and unknown names are refused against."""

import pytest

from llmtrain.chaos.runner import FAULT_KINDS, KINDS, Chaos, ChaosConfig
from llmtrain.config import ConfigError


def test_every_kind_is_a_chaos_method_and_the_default_runs_them_all():
    assert KINDS == tuple(FAULT_KINDS)
    for name, kind in FAULT_KINDS.items():
        assert kind.name == name and getattr(Chaos, kind.inject.__name__) is kind.inject
    assert ChaosConfig().faults.split(",") == list(KINDS)
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
    chaos = Chaos(ChaosConfig(workdir=str(tmp_path / "chaos"), faults="store_restart",
                              spares=0))
    chaos.dir.mkdir()
    (chaos.dir / "node1.log").write_text(
        "step 5/200 | loss 4.7\n"  # before the mark
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "ValueError: an old one\n")
    mark = chaos._log_sizes()
    with open(chaos.dir / "node1.log", "a") as f:
        f.write("the rendezvous store failed; the workers go on\n"
                "[rank0]: Traceback (most recent call last):\n"
                "[rank0]:   File \"warm.py\", line 142, in spares_waiting\n"
                "[rank0]:     return store.add(\"spares/registered\", 0)\n"
                "[rank0]: torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.\n")
    (chaos.dir / "node2.log").write_text(
        "Traceback (most recent call last):\n  File \"run.py\", line 9, in main\n"
        "    raise RendezvousConnectionError(\n"
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection"
        " to the C10d store has failed.\n")
    assert chaos._tracebacks(mark, None) == [
        "node1: DistNetworkError: Failed to recv, got 0 bytes.",
        "node2: RendezvousConnectionError: The connection to the C10d store has failed."]
    assert chaos._tracebacks({}, mark) == ["node1: ValueError: an old one"]
