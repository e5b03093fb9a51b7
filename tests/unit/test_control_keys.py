"""Signed control keys, against a real TCPStore and a stranger's client of it: a value
written without the job's secret evicts nobody, aborts nothing, fences no write, adds no
report and gives no plan; it is reported as a ``control_key_forged`` event naming the key.
A pickle at torchrun's rendezvous key runs nothing in a standby launcher. The job's secret
comes from the scheduler (or a single launcher makes its own) and is refused when missing
where several launchers must share it."""

import json
import pickle
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from llmtrain.config import ConfigError, JobConfig, WarmConfig
from llmtrain.distributed.failure import FailureWatch
from llmtrain.distributed.signed_store import (SECRET_ENV, SECRET_FILE_ENV, Forged, SignedStore,
                                               job_secret, report_forged_to)
from llmtrain.events import EventLog, read_events
from llmtrain.launch.config import LaunchConfig
from llmtrain.launch.node import ensure_secret
from llmtrain.launch.standby import Vacancies, answer_evictions
from llmtrain.recovery.fence import Fence
from llmtrain.recovery.eviction import EvictionWatch, evict
from llmtrain.recovery.roll_call import owner
from llmtrain.recovery.warm import WarmPath, job_namespace

JOB = "job"
NAMESPACE = f"llmtrain/warm/{JOB}/"


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         use_libuv=True)


@pytest.fixture
def forged(tmp_path):
    """The ``control_key_forged`` events this process reports."""
    report_forged_to(EventLog(str(tmp_path), rank=0))
    yield lambda: [e["key"] for e in read_events(str(tmp_path), "control_key_forged")]
    report_forged_to(None)


def member(server: dist.TCPStore) -> SignedStore:
    """A client of the job's namespace holding the job's secret (the tests' own)."""
    return job_namespace(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                       use_libuv=True, timeout=timedelta(seconds=5)), JOB)


def stranger(server: dist.TCPStore) -> dist.TCPStore:
    """Anyone who reaches the store's port: no secret."""
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True,
                         timeout=timedelta(seconds=5))


def test_a_forged_eviction_kills_no_worker(server, forged):
    """Writing ``evict/<holder>`` and bumping ``evictions`` (what made an agent SIGKILL a
    healthy worker) asks nothing; the job's own eviction still kills."""
    store = member(server)
    worker = subprocess.Popen(["sleep", "60"], start_new_session=True)
    holder = owner(worker.pid, "node2")
    store.set("where/3", "round/g0/")
    store.set("round/g0/owner/3", holder)
    store.set("round/g0/size", "4")
    store.set(f"rank_of/{holder}", "3")
    watch = EvictionWatch(store, [holder])
    evil = stranger(server)
    for value in ("7", "1"):
        evil.set(f"{NAMESPACE}evict/{holder}", value)
        evil.add(f"{NAMESPACE}evictions", 1)
        assert watch.asked() == []
    assert worker.poll() is None
    assert forged() == [f"evict/{holder}"]
    # the job's own ask (a hang's watchdog, with the secret) is answered: the worker dies
    evict(store, [3], wait_s=0)
    assert answer_evictions(worker, watch) and worker.wait(timeout=5) == -9


def test_a_forged_failure_key_aborts_nothing(server, forged):
    """A generation's ``failed`` key set by a stranger wakes no rank's watch (on NCCL it
    aborted every communicator); the job's own report does, at once."""
    acted = []
    watch = FailureWatch(lambda: member(server), "round/g0/failed",
                         on_failure=lambda _: acted.append("aborted"))
    time.sleep(0.2)
    stranger(server).set(f"{NAMESPACE}round/g0/failed", "1")
    assert not watch.woke.wait(1.0) and acted == []
    assert forged() == ["round/g0/failed"]
    member(server).set("round/g0/failed", "1")
    assert watch.woke.wait(5) and acted == ["aborted"]


def test_a_forged_fence_token_refuses_no_write(server, forged, tmp_path):
    """Raising ``fence/token`` refused every checkpoint write for good; now the write goes
    on, the genuine token is put back, and a real newer membership still fences."""
    fence = Fence(member(server), EventLog(str(tmp_path), rank=1), 2.0)
    fence.join("1-a/g0")
    stranger(server).set(f"{NAMESPACE}fence/token", "99-z/g9")
    fence.check("checkpoint file __1_0.distcp")  # no Fenced
    assert member(server).get("fence/token") == b"1-a/g0"
    assert fence.superseded() is None and forged() == ["fence/token"]
    assert read_events(str(tmp_path), "fenced") == []
    Fence(member(server), EventLog(str(tmp_path), rank=0), 2.0).join("1-a/g1")
    with pytest.raises(RuntimeError, match="re-formed as 1-a/g1"):
        fence.check("checkpoint file __1_1.distcp")


def test_a_forged_report_and_plan_decide_nothing(server, forged):
    """A stranger's line in a generation's report log does not count a lost rank as alive,
    and a plan it writes where survivors wait is not followed."""
    cfg = WarmConfig(enable=True, settle_s=0.3, budget_s=3)
    store = member(server)
    paths = {r: WarmPath(cfg, store, "round", r, 2, 1) for r in range(2)}
    evil = stranger(server)
    evil.append(f"{NAMESPACE}round/g0/reports", json.dumps({"rank": 1, "own": [4],
                                                           "replicas": [4]}) + "\n")
    evil.append(f"{NAMESPACE}round/g0/reports", "no newline")  # glued to the next line?
    assert paths[0].report({"own": [4], "replicas": [4]})
    paths[0].decide()
    # rank 1 counted lost all the same (unsigned, its forged report made "every rank alive")
    assert store.get("round/g0/decision/0") == b"cold:no warm spare waits for rank 1"
    assert forged() == ["round/g0/reports"]
    # a plan key the survivors of the next generation wait for, written by a stranger
    later = WarmPath(cfg, store, "round", 0, 2, 1, gen=1)
    evil.set(f"{NAMESPACE}round/g1/decision/0", json.dumps({"gen": 2}))
    with pytest.raises(Exception, match="no plan within"):
        later._plan(time.monotonic() + 0.5)
    assert "round/g1/decision/0" in forged()


def test_a_signed_value_is_bound_to_its_key_and_job(server):
    """A genuine value copied under another key, or into another job's namespace, fails
    its check."""
    store = member(server)
    store.set("round/g0/failed", "1")
    raw = stranger(server).get(f"{NAMESPACE}round/g0/failed")
    evil = stranger(server)
    evil.set(f"{NAMESPACE}round/g1/failed", raw)  # replayed into the next generation
    evil.set("llmtrain/warm/other/round/g0/failed", raw)  # into another job
    with pytest.raises(Forged):
        store.get("round/g1/failed")
    other = job_namespace(stranger(server), "other")
    with pytest.raises(Forged):
        other.get("round/g0/failed")
    assert store.get("round/g0/failed") == b"1"


class _Payload:
    """What a stranger would store to run code where it is unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_at_the_rendezvous_key_runs_nothing_in_a_standby(server, tmp_path):
    """torchrun keeps its rendezvous state as a pickle in the store, and every standby
    launcher reads it every 0.5 s: a pickle that calls anything is refused, and the spare
    sees no vacancy."""
    marker = tmp_path / "ran"
    C10dRendezvousBackend(stranger(server), JOB).set_state(pickle.dumps(_Payload(marker)))
    vacancies = Vacancies(LaunchConfig(nnodes="2:2", rdzv_endpoint=f"127.0.0.1:{server.port}",
                                       rdzv_id=JOB, standby=True, external_store=True))
    assert vacancies._missing() is None
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Payload(marker)))  # what a plain unpickle would have done
    assert marker.exists()


def test_the_job_secret_comes_from_the_scheduler_or_the_only_launcher(tmp_path):
    """Several launchers (nodes or spares) must be given one secret: without it the launch
    refuses, naming what to set. A launcher alone makes its own for its workers, with an
    external store or not (without one, `llmtrain launch --nproc-per-node 2` with no
    secret set failed in every worker). A file works; one too short is refused."""
    multi = LaunchConfig(nnodes="2:3", external_store=True)
    with pytest.raises(ConfigError, match=SECRET_ENV):
        ensure_secret(multi, {})
    with pytest.raises(ConfigError, match=SECRET_ENV):
        ensure_secret(LaunchConfig(nnodes="1", standby=True, external_store=True), {})
    alone: dict[str, str] = {}
    ensure_secret(LaunchConfig(nnodes="1", external_store=True), alone)
    assert len(alone[SECRET_ENV]) == 64
    # the watchdogs meet in the store at --rdzv-endpoint, external or not: it signs too
    with pytest.raises(ConfigError, match=SECRET_ENV):
        ensure_secret(LaunchConfig(nnodes="2"), {})
    one_node: dict[str, str] = {}
    ensure_secret(LaunchConfig(nnodes="1"), one_node)
    assert len(one_node[SECRET_ENV]) == 64
    path = tmp_path / "secret"
    path.write_text("s" * 40 + "\n")
    assert job_secret({SECRET_FILE_ENV: str(path)}) == b"s" * 40
    with pytest.raises(ConfigError, match="fewer than 16"):
        job_secret({SECRET_ENV: "short"})
    with pytest.raises(ConfigError, match="cannot read"):
        job_secret({SECRET_FILE_ENV: str(tmp_path / "missing")})
    assert JobConfig()  # the config needs nothing of it


@pytest.mark.parametrize("kind", ["tcp", "hash"])
def test_a_wait_with_under_a_millisecond_left_ends_at_once(server, kind):
    """A timedelta under a millisecond reaches c10d as 0 ms, which a TCPStore takes as
    expired and a HashStore as no timeout at all: a wait for a key that never comes, with
    0.4 ms left, returns None at once on both (on a HashStore it waited for ever)."""
    store = SignedStore(server if kind == "tcp" else dist.HashStore(), b"k" * 32, JOB)
    began = time.monotonic()
    assert store.wait_genuine("never", timedelta(microseconds=400)) is None
    assert time.monotonic() - began < 1.0
