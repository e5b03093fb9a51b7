"""A rendezvous store run as one task of a job (``llmtrain rdzv-store --exit-when-unused``,
as the torchx component runs it) ends once every launcher that used it has ended, whether
it said so or died with its node, and not while one lives."""

import signal
import subprocess
import sys
import time

from llmtrain.distributed.process_group import free_port
from llmtrain.launch.store import LEASE_BEAT_S, Lease


def test_the_store_ends_once_every_launcher_has_released_or_died():
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "llmtrain", "rdzv-store", "--bind",
                              "127.0.0.1", "--port", str(port), "--exit-when-unused",
                              "--lease-timeout-s", "4"], stdout=subprocess.PIPE, text=True)
    holder = None
    try:
        assert store.stdout.readline().startswith("llmtrain rdzv-store: serving")
        # a launcher in a process of its own, to be killed as its node would be
        holder = subprocess.Popen([sys.executable, "-c", (
            "import sys, time; from llmtrain.launch.store import LEASE_BEAT_S, Lease; "
            f"Lease('127.0.0.1:{port}'); print('held', flush=True); time.sleep(600)")],
            stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline() == "held\n"
        mine = Lease(f"127.0.0.1:{port}")
        time.sleep(1)
        mine.release()  # one launcher ended and said so; the other still beats
        time.sleep(5)  # more than the lease timeout: the live launcher's beats count
        assert store.poll() is None, "the store ended while a launcher lived"
        holder.send_signal(signal.SIGKILL)  # its node is gone: no release, no more beats
        killed = time.monotonic()
        out, _ = store.communicate(timeout=30)
        assert store.returncode == 0
        assert "all 2 launcher(s) ended" in out
        # the dead lease counts once silent for the timeout (from its last beat seen, which
        # may be up to one beat before the kill), not before
        assert 4 - LEASE_BEAT_S <= time.monotonic() - killed < 20
    finally:
        for p in (holder, store):
            if p is not None and p.poll() is None:
                p.kill()
