"""What a standby node reads as a vacancy, in rounds formed by torch's own rendezvous
handlers on a real store: a warm job's running round that lost a node's agent is not one
(joining it would restart every rank cold), a restart's round short of a node is."""

import pickle
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from llmtrain.config import JobConfig
from llmtrain.launch import standby
from llmtrain.launch.config import LaunchConfig
from llmtrain.launch.standby import Vacancies, standby_vacancies
from llmtrain.launch.store import store_server
from llmtrain.distributed.signed_store import SECRET_ENV, new_secret
from llmtrain.recovery.presence import node_gone
from llmtrain.recovery.warm import job_namespace

RDZV_ID = "job"


@pytest.fixture
def rendezvous(monkeypatch):
    """(LaunchConfig of a 2-node job, a maker of its agents' rendezvous handlers)."""
    monkeypatch.setattr(standby, "STANDBY_GRACE_S", 0.0)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the launcher runs them
    server = store_server("127.0.0.1", 0)
    lc = LaunchConfig(nnodes="2:2", rdzv_endpoint=f"127.0.0.1:{server.port}", rdzv_id=RDZV_ID,
                      join_timeout_s=20, external_store=True, standby=True)

    def agent():
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                              timeout=timedelta(seconds=20))
        params = RendezvousParameters("c10d", lc.rdzv_endpoint, RDZV_ID, 2, 2,
                                      join_timeout=20, last_call_timeout=1,
                                      keep_alive_interval=1, keep_alive_max_attempt=3)
        return create_handler(store, C10dRendezvousBackend(store, RDZV_ID), params)
    yield lc, agent


def next_round(*handlers) -> None:
    """Every handler's agent enters the next round together, as after a restart."""
    threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


def until(probe, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.1)
    return value


def state(lc: LaunchConfig):
    """torch's rendezvous state, as a standby reads it."""
    return pickle.loads(Vacancies(lc).backend.get_state()[0])


def test_a_running_round_that_lost_an_agent_is_no_vacancy_in_a_warm_job(rendezvous):
    lc, agent = rendezvous
    a, b = agent(), agent()
    next_round(a, b)
    next_round(a, b)  # a restart: round 1, which restarts_only counts
    b._stop_heartbeats()  # b's node died; a warm spare took its rank, a's workers go on
    # a's keep-alive sweeps b out
    s = until(lambda: (got := state(lc)).participants.keys() == {a._this_node} and got,
              "sweep")
    assert (s.round, s.complete, len(s.participants)) == (1, True, 1)
    warm, cold = JobConfig(), JobConfig()
    warm.warm.enable, cold.warm.enable = True, False
    assert not standby_vacancies(warm, lc).claim()  # a warm job's standby stays out
    assert standby_vacancies(cold, lc).claim()  # a cold job's standby joins: agents admit it
    a._stop_heartbeats()


def test_a_restarts_round_short_of_a_node_takes_one_standby(rendezvous):
    lc, agent = rendezvous
    a, b = agent(), agent()
    next_round(a, b)
    first = Vacancies(lc, restarts_only=True)
    assert not first.claim()  # round 0, complete: nothing to take
    next_round(a, b)
    b._stop_heartbeats()
    # a restarts and waits in the next round for a node that never comes
    waiting = threading.Thread(target=a.next_rendezvous, daemon=True)
    waiting.start()
    s = until(lambda: (got := state(lc)).participants and not got.complete and got,
              "round waiting for a node")
    assert (s.round, s.complete, len(s.participants)) == (2, False, 1)
    second = Vacancies(lc, restarts_only=True)
    assert first.claim() and not second.claim()  # one place, one standby
    next_round(agent())  # the standby that took it: the round completes
    waiting.join(timeout=30)
    s = state(lc)
    assert (s.round, s.complete, len(s.participants)) == (2, True, 2)
    a._stop_heartbeats()


def test_a_round_short_of_a_node_known_dead_is_joined_without_the_grace(rendezvous,
                                                                        monkeypatch):
    """A standby waits STANDBY_GRACE_S for a short round's nodes to come back, unless the
    nodes it lacks are of the last full round and known dead (their agents' presence
    connections closed): then no survivor is on its way, and it joins at once."""
    lc, agent = rendezvous
    monkeypatch.setattr(standby, "STANDBY_GRACE_S", 600.0)
    monkeypatch.setenv(SECRET_ENV, new_secret())
    a, b = agent(), agent()
    next_round(a, b)
    spare = Vacancies(lc)
    assert not spare.claim()  # a full round: it notes who is in it
    b._stop_heartbeats()  # b's node died
    threading.Thread(target=a.next_rendezvous, daemon=True).start()  # a restarts
    until(lambda: (s := state(lc)).round == 1 and not s.complete, "a short round")
    assert not spare.claim()  # short, but b might be slow, not dead: the grace holds
    node_gone(job_namespace(spare.store, RDZV_ID), str(b._this_node))
    assert spare.claim()  # b is dead: its place is taken at once
    a._stop_heartbeats()
