"""The link health check against real links: two network namespaces on a bridge, one
node's sends shaped by ``tc tbf`` to a rate with a tiny queue, real TCP across. The node
whose sends are dropped reports its link lossy; a node with a clean link (paced, with a
deep queue) does not."""

import json
import subprocess
import sys
import textwrap

import pytest
from needs import netns

from llmtrain.chaos.netns import Network

# Runs as one node: samples the check, sends 4 MB to the other node, samples again.
SENDER = textwrap.dedent("""
    import json, socket, sys
    from llmtrain.config import HealthConfig
    from llmtrain.reliability.health.checks import HealthChecker
    checker = HealthChecker(HealthConfig(link_window_s=60), None, host=sys.argv[2])
    def link():
        return next(f for f in checker.node() if f.check == "link")
    link()
    with socket.create_connection((sys.argv[1], 45678), timeout=60) as s:
        s.sendall(b"x" * (4 << 20))
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
    finding = link()
    print(json.dumps({"severity": finding.severity, "value": finding.value,
                      "message": finding.message}))
""")
RECEIVER = textwrap.dedent("""
    import socket
    server = socket.create_server(("0.0.0.0", 45678))
    print("ready", flush=True)
    conn, _ = server.accept()
    while conn.recv(1 << 16):
        pass
    conn.sendall(b"k")
""")


@pytest.mark.parametrize("shaped", [True, False])
def test_the_node_whose_sends_are_dropped_reports_its_link(tmp_path, shaped):
    netns()
    network = Network(tmp_path)
    try:
        for name in ("node1", "node2"):
            network.add(name)
        if shaped:
            network.degrade("node2", "20mbit")
        else:  # a healthy link: a finite rate and a queue that does not drop
            network.pace("node2")
        receiver = subprocess.Popen(network.command("node1", [sys.executable, "-c", RECEIVER]),
                                    stdout=subprocess.PIPE, text=True)
        assert receiver.stdout.readline().strip() == "ready"
        sent = subprocess.run(network.command("node2", [
            sys.executable, "-c", SENDER, network.address("node1"), "node2"]),
            capture_output=True, text=True, timeout=120)
        receiver.wait(timeout=30)
        assert sent.returncode == 0, sent.stderr
        finding = json.loads(sent.stdout.strip().splitlines()[-1])
    finally:
        network.close()
    if shaped:
        assert finding["severity"] == "warn", finding
        assert finding["value"] > 0.02 and "check this node's NIC" in finding["message"]
    else:
        assert finding["severity"] == "ok" and finding["value"] < 0.02, finding
