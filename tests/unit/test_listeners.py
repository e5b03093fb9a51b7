"""Network listeners bind where the config says: loopback unless told otherwise."""

import datetime
import socket
import urllib.request

import pytest
import torch.distributed as dist

from llmtrain.config import MetricsConfig
from llmtrain.launch.store import store_server
from llmtrain.metrics.prometheus import Exporter


@pytest.fixture(scope="module")
def outside_address() -> str:
    """A non-loopback IPv4 address of this machine, as another host would reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            address = s.getsockname()[0]
        except OSError:
            address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    return address


def reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


def test_exporter_listens_on_loopback_by_default(tmp_path, outside_address):
    assert MetricsConfig().address == "127.0.0.1"
    exporter = Exporter(MetricsConfig(port=0), str(tmp_path), rank=0, local_rank=0,
                        host="h", world_size=1)
    exporter.start()
    try:
        assert exporter.server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics") as r:
            assert b"llmtrain_world_size" in r.read()
        assert not reachable(outside_address, exporter.port)
    finally:
        exporter.close()


def test_store_listens_only_where_it_is_told(outside_address):
    store = store_server("127.0.0.1", 0)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, use_libuv=True,
                           timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert not reachable(outside_address, store.port)
    everywhere = store_server("0.0.0.0", 0)  # what a cluster asks for explicitly
    assert reachable(outside_address, everywhere.port)
