"""The rendezvous store as a process of its own (``llmtrain rdzv-store``)."""

from __future__ import annotations

import datetime
import signal

import torch.distributed as dist


def serve_store(host: str, port: int) -> None:
    """A rendezvous store in its own process, so no training node is a single point of
    failure for the rendezvous (torchrun agents connect with ``is_host=0``)."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          multi_tenant=True, use_libuv=True,
                          timeout=datetime.timedelta(seconds=300))
    print(f"llmtrain rdzv-store: serving {host}:{port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del store
