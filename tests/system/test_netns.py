"""The nodes' network (network namespaces on one bridge) that the fault tests build on."""

import subprocess

from needs import netns

from llmtrain.chaos.netns import HUB_MAC, Network


def test_a_node_joining_the_bridge_does_not_move_the_hubs_address(tmp_path):
    """A Linux bridge takes the lowest address among its ports unless it has one of its
    own: a node joining with a lower one moved the hub's address, and the nodes already
    up, whose ARP caches held the old one, lost the rendezvous store for up to a minute
    (in a chaos run, a healthy rank's heartbeats stopped and it was evicted)."""
    netns()
    network = Network(tmp_path)
    hub = ["ip", "-n", network.hub]
    try:
        network.add("node1")
        # a port with the lowest address there is, then a node as chaos adds a spare
        subprocess.run([*hub, "link", "add", "vlow", "address", "00:00:00:00:00:01",
                        "type", "veth", "peer", "name", "vlow2"], check=True)
        subprocess.run([*hub, "link", "set", "vlow", "master", "br0"], check=True)
        network.add("node2")
        shown = subprocess.run([*hub, "-br", "link", "show", "br0"], check=True,
                               capture_output=True, text=True).stdout.split()
        assert shown[2] == HUB_MAC, shown
    finally:
        network.close()
