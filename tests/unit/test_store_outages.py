"""A rendezvous store that restarts empty under a running job, on a real store process
killed with SIGKILL and started again on its port: the store views llmtrain holds connect
again, torchrun's agent no longer stops its workers over the outage, and a warm spare's
launcher takes its place in the pool again (it had died with a DistNetworkError)."""

import os
import signal
import time

import pytest
import torch.distributed as dist
from conftest import RestartableStore, sigstop
from torch.distributed.elastic.multiprocessing.api import (SignalException,
                                                          _terminate_process_handler)
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from llmtrain.launch.agent import tolerate_store_outages
from llmtrain.launch.config import LaunchConfig
from llmtrain.launch.standby import Vacancies, store_errors
from llmtrain.recovery.pool import PoolPlace, spares_waiting
from llmtrain.recovery.warm import job_namespace


@pytest.fixture
def store():
    restartable = RestartableStore()
    yield restartable
    restartable.close()


def test_a_signed_store_view_connects_again_after_the_store_restarted(store):
    """torch's TCPStore client fails every request for good once its server restarted:
    the view's request that meets the broken connection connects anew and is made again
    (one that must not be made twice, an ``add``, raises, and the next one connects)."""
    view = store.connect()
    view.set("a", "1")
    store.restart()
    assert not view.check(["a"])  # connected again at once: a new store, empty
    view.set("b", "2")
    assert view.get("b") == b"2"
    store.restart()
    with pytest.raises(dist.DistNetworkError):
        view.add("n", 1)  # it may have counted before the connection broke: not again
    assert view.add("n", 1) == 1


def test_torchruns_look_for_waiting_nodes_does_not_stop_the_workers(store):
    """torchrun's agent asks its rendezvous every monitor interval whether nodes wait;
    with the store out, that raised, and the agent shut down every worker (SIGTERM, which
    they logged as a preemption). Tolerated, it answers that none waits."""
    client = store.client()
    params = RendezvousParameters("c10d", f"127.0.0.1:{store.port}", "job", 1, 1,
                                  join_timeout=10, last_call_timeout=1)
    handler = create_handler(client, C10dRendezvousBackend(client, "job"), params)
    handler.next_rendezvous()
    store.restart()
    time.sleep(1.5)  # past the handler's cache of the state: it asks the store
    with pytest.raises(Exception):  # torchrun's own: what ended the node's workers
        handler.num_nodes_waiting()
    tolerate_store_outages(handler)
    assert handler.num_nodes_waiting() == 0
    assert handler.num_nodes_waiting() == 0  # said once; still none


def test_a_sigterm_during_the_look_for_waiting_nodes_still_stops_the_agent(store):
    """torchrun's SIGTERM handler raises in its main thread wherever it is: inside the look
    for waiting nodes, the exception was taken for a store outage, and the preemption it
    was (Slurm's SIGTERM to the launcher) never began (seen in a chaos run)."""
    client = store.client()
    params = RendezvousParameters("c10d", f"127.0.0.1:{store.port}", "job", 1, 1,
                                  join_timeout=10, last_call_timeout=1)
    handler = create_handler(client, C10dRendezvousBackend(client, "job"), params)
    handler.next_rendezvous()
    asked = handler.num_nodes_waiting

    def signalled() -> int:
        os.kill(os.getpid(), signal.SIGTERM)  # handled before the call returns
        return asked()
    handler.num_nodes_waiting = signalled
    tolerate_store_outages(handler)
    before = signal.signal(signal.SIGTERM, _terminate_process_handler)
    try:
        with pytest.raises(SignalException):
            handler.num_nodes_waiting()
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_warm_spare_joins_the_pool_again_after_the_store_lost_it(store):
    """The pool lives in the store: after a restart nobody counts the spare, and its
    number may go to another spare. Its launcher finds its place no longer names it and
    joins again, ready as it was (its view connects again); its look for a vacancy, through
    torchrun's backend, raises once and then connects again (the launcher died of that
    DistNetworkError)."""
    lc = LaunchConfig(nnodes="2:2", rdzv_endpoint=f"127.0.0.1:{store.port}", rdzv_id="job",
                      standby=True, external_store=True, join_timeout_s=2)
    vacancies = Vacancies(lc, restarts_only=True)
    pool = job_namespace(vacancies.store, "job", reconnect=vacancies.client)
    place = PoolPlace(pool, budget_s=5)
    place.ready = True
    place.keep()
    assert spares_waiting(pool) == 1
    store.restart()
    with pytest.raises(store_errors()):
        vacancies.claim()
    assert vacancies.claim() is False  # connected again: no round is short
    other = PoolPlace(job_namespace(store.client(), "job"), budget_s=5)  # took number 1
    place.KEEP_EVERY_S = 0.0
    place.keep()
    assert place.number == 2 and other.number == 1 and spares_waiting(pool) == 2
    assert pool.get(f"spares/{place.number}/ready") == b"1"


def test_rank_0s_look_for_spares_neither_waits_for_a_stalled_store_nor_raises(store):
    """Rank 0 asks at every vote whether spares wait to grow the job, and every rank waits
    for its vote: a stopped store held them all (a TCPStore request waits for ever), and an
    error went into the vote as a lost peer. The look runs off the training thread now."""
    from llmtrain.recovery.background_look import BackgroundLook
    from llmtrain.recovery.pool import join_pool, spares_ready

    pool = store.connect()
    look = BackgroundLook(lambda: spares_ready(pool, 1), fresh_s=30)
    number = join_pool(pool)
    pool.set(f"spares/{number}/ready", "1")
    deadline = time.monotonic() + 5
    while not look.latest():  # the first answer comes from a thread
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sigstop(store.proc.pid)
    try:
        began = time.monotonic()
        for _ in range(3):
            look.latest()
        assert time.monotonic() - began < 0.5  # the votes go on
        assert look._thread.is_alive()  # its look waits on the stopped store
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
    failing = BackgroundLook(lambda: pool.raw.get("no/such/key/after/kill"), fresh_s=30)
    store.proc.kill()
    store.proc.wait()
    failing.latest()
    failing._thread.join(10)
    assert failing.latest() is False


def test_a_store_stall_longer_than_the_hang_timeout_is_not_taken_for_a_hang(store, tmp_path):
    """Two ranks' watchdogs beat through the store; it stops (SIGSTOP) for longer than
    the hang timeout, then answers again. Every watchdog waited on it, so nobody is
    silent: before, a tick whose wait fell on the check for a hang event (after the stall
    check) judged the stale beats, and both ranks named rank 0 stopped or dead (a chaos
    run's 30 s stall evicted a healthy rank)."""
    import threading

    from llmtrain.config import ReliabilityConfig
    from llmtrain.reliability.watchdog import Watchdog

    cfg = ReliabilityConfig(hang_timeout_s=2, heartbeat_interval_s=0.5)
    dogs = [Watchdog(cfg, store.connect(), str(tmp_path), events=None, rank=r, world_size=2)
            for r in range(2)]
    declared = []
    for dog in dogs:
        dog._declare = lambda reason, kind="hang", r=dog.rank: declared.append((r, reason))
        dog.beat(1, "step")
        dog.start()
    training = threading.Event()

    def train() -> None:  # both ranks make progress all along: only the store stops
        step = 2
        while not training.is_set():
            for dog in dogs:
                dog.beat(step, "step")
            step += 1
            time.sleep(0.1)
    threading.Thread(target=train, daemon=True).start()
    try:
        time.sleep(1.5)
        sigstop(store.proc.pid)
        time.sleep(4)
        os.kill(store.proc.pid, signal.SIGCONT)
        time.sleep(3)  # the ticks after the stall judge fresh beats
    finally:
        training.set()
        for dog in dogs:
            dog.close()
    assert declared == []
