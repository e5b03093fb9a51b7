"""The running chaos job as the fault kinds see it: its event log (what it is doing, and
waiting for what it must do), its ranks and nodes, the verdicts so far, and the hands a
kind needs to judge a recovery and bring a lost node back as a spare."""

from __future__ import annotations

import random
import time
from bisect import bisect_left, insort
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmtrain.chaos import logs
from llmtrain.chaos.local_cluster import LocalCluster
from llmtrain.chaos.mount import FaultMount
from llmtrain.chaos.netns import Network
from llmtrain.chaos.scripted_gpu import write_gpu_script
from llmtrain.chaos.settings import ChaosConfig
from llmtrain.chaos.timeline import SIZE_EVENTS, sizes
from llmtrain.chaos.verdict import WENT_ON, Verdict, recovery_path
from llmtrain.distributed.signed_store import SignedStore
from llmtrain.events import EventTail


def _ts(event: dict) -> float:
    return event["ts"]


class JobStopped(RuntimeError):
    """A rank ended the job on an error no restart fixes (its ``fatal`` event, exit 78:
    a bad config, training diverged): nothing a wait is for can come any more."""


class Job:
    """One chaos run's job: ``cluster`` (its nodes and store), ``mount`` (its checkpoint
    filesystem), ``network`` (the nodes' namespaces, or None on loopback), ``spares``
    (the spare pool's store namespace), and the verdicts of the faults injected so far."""

    def __init__(self, cfg: ChaosConfig, workdir: Path, names: list[str], spare_nodes: int,
                 cluster: LocalCluster, mount: FaultMount, network: Network | None,
                 faults_file: Path, rng: random.Random):
        self.cfg, self.dir, self.names, self.spare_nodes = cfg, workdir, names, spare_nodes
        self.rng = rng  # the run's: its schedule's draws and the ranks' picks, one sequence
        self.cluster, self.mount, self.network = cluster, mount, network
        self.run = workdir / "run"
        self.faults_file = faults_file  # run-time faults (``reliability.faults``)
        self.spares: SignedStore | None = None  # the spare pool's namespace, once it runs
        self.verdicts: list[Verdict] = []
        self.log_marks: list[dict[str, int]] = []  # each verdict's: the nodes' log sizes
        # verdicts judged again at the end (what a fault caused may come late), by index
        self.rejudge: dict[int, Callable[[], None]] = {}
        self.truncated: set[int] = set()  # committed steps chaos broke on purpose
        self.started_at: dict[str, float] = {}  # node -> when chaos last started it
        self.standby: set[str] = set()  # the nodes chaos last started as spares
        self.last_fault = False  # the fault in flight is the schedule's last
        # the event log, followed: each look reads only what was written since the last
        # (re-reading a fast job's whole log at every look of a wait took most of chaos's
        # own CPU, which the job's ranks and spares on the same cores went without)
        self._tail = EventTail(str(self.run))
        self._events: dict[str | None, list[dict]] = {None: []}  # by kind; None: all

    # -- its event log ------------------------------------------------------------------

    def events(self, kind: str | None = None, since: float = 0.0) -> list[dict]:
        """The job's events (of ``kind``) since ``since``, in time order. The events are
        the same objects from one call to the next: read them, never change them."""
        for e in self._tail.read():
            for key in (None, e["event"]):
                found = self._events.setdefault(key, [])
                if found and found[-1]["ts"] > e["ts"]:  # another process's, written late
                    insort(found, e, key=_ts)
                else:
                    found.append(e)
        found = self._events.get(kind, [])
        return found[bisect_left(found, since, key=_ts):]

    def latest(self, kind: str, since: float = 0.0) -> dict | None:
        """The last event of ``kind`` since ``since``."""
        found = self.events(kind, since)
        return found[-1] if found else None

    def latest_before(self, kind: str, since: float, until: float) -> dict | None:
        """The last event of ``kind`` between ``since`` and ``until``."""
        found = [e for e in self.events(kind, since) if e["ts"] < until]
        return found[-1] if found else None

    def wait(self, probe: Callable[[], Any], what: str, timeout: float) -> Any:
        """``probe()``'s first true value, polled; a TimeoutError naming ``what`` if none
        comes within ``timeout`` seconds, a JobStopped as soon as the job has ended on a
        fatal error (rather than minutes of waits that cannot end well)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = probe()
            if value:
                return value
            if fatal := self.latest("fatal"):
                raise JobStopped(f"chaos: waited for {what} in vain: rank {fatal['rank']} "
                                 f"ended the job: {fatal['error']}")
            time.sleep(0.2)
        raise TimeoutError(f"chaos: waited {timeout:.0f} s for {what} in vain; see "
                           f"{self.dir}/*.log")

    def ended(self, since: float) -> dict | None:
        """The job's end at its last step, since ``since``."""
        return next((e for e in self.events("run_end", since)
                     if e["steps"] == self.cfg.steps), None)

    # -- its ranks and nodes --------------------------------------------------------------

    def world(self) -> tuple[float, int]:
        """Since when the job has had its present size, and that size."""
        changes = [e for kind in SIZE_EVENTS for e in self.events(kind)]
        return max(sizes(changes), default=(0.0, 0))

    def ranks(self) -> dict[int, dict]:
        """The ranks of the job as it is: rank -> its startup event (pid, host)."""
        since, size = self.world()
        return {e["rank"]: e for e in self.events("startup", since) if e["rank"] < size}

    def hosts(self) -> set[str]:
        """The nodes this attempt's ranks run on."""
        return {e["host"] for e in self.ranks().values()}

    def step(self) -> int:
        """The last step the job logged."""
        last = self.latest("step")
        return last["step"] if last else 0

    def pick_rank(self) -> tuple[int, dict]:
        """The rank a fault hits (``cfg.rank``, or a random one), and its startup event."""
        ranks = self.ranks()
        rank = (self.cfg.rank if self.cfg.rank is not None
                else self.rng.choice(sorted(ranks)))
        return rank, ranks[rank]

    def start(self, name: str, spare: bool = True) -> None:
        """Starts node ``name`` (``spare``: on standby) with its scripted GPU."""
        # a node, or a warm spare, says it launched (``node_launch``, or ``warm_path_off``
        # before it waits cold); a cold spare says nothing until it is needed
        if not spare or self.cfg.warm:
            self.started_at[name] = time.time()
        else:
            self.started_at.pop(name, None)
        (self.standby.add if spare else self.standby.discard)(name)
        self.cluster.start(name, env={"LLMTRAIN_NVML_SCRIPT": str(self.gpu_script(name))},
                           spare=spare)

    def gpu_script(self, name: str) -> Path:
        """Node ``name``'s scripted GPU state (its NVML stand-in's script)."""
        return self.dir / "nvml" / f"{name}.json"

    def set_gpu(self, name: str, healthy: bool, gpu: int = 0) -> None:
        """Node ``name``'s GPUs (one per local rank) turn healthy, or its GPU ``gpu``
        reports uncorrectable ECC errors."""
        write_gpu_script(self.gpu_script(name), healthy, count=self.cfg.tp, bad=gpu)

    def end_node(self, name: str) -> None:
        """Node ``name`` ends whole (launcher, agent, workers), if it has not."""
        if self.cluster.nodes[name].poll() is None:
            self.cluster.kill(name)
        self.cluster.nodes[name].wait()

    # -- the verdicts ---------------------------------------------------------------------

    def verdict(self, kind: str, target: str, at_step: int | None = None) -> Verdict:
        """A new fault's verdict, injected now (at the job's last step, or ``at_step``)."""
        v = Verdict(kind, target, self.step() if at_step is None else at_step, time.time())
        self.verdicts.append(v)
        self.log_marks.append(self.log_sizes())
        return v

    def index(self, v: Verdict) -> int:
        """``v``'s place among the verdicts."""
        return next(i for i, x in enumerate(self.verdicts) if x is v)

    def window(self, v: Verdict) -> tuple[float, dict[str, int], dict[str, int] | None]:
        """What belongs to fault ``v``: from its injection to the next fault's (or the
        end): that time, and the nodes' log marks at both ends (None: to the end)."""
        i = self.index(v)
        if i + 1 < len(self.verdicts):
            return self.verdicts[i + 1].injected_at, self.log_marks[i], self.log_marks[i + 1]
        return float("inf"), self.log_marks[i], None

    def log_sizes(self) -> dict[str, int]:
        """How far each node's log has been written."""
        return logs.log_sizes(self.dir, self.names)

    def tracebacks(self, since: dict[str, int], until: dict[str, int] | None) -> list[str]:
        """The tracebacks in the nodes' logs between two marks of :meth:`log_sizes`."""
        return logs.tracebacks(self.dir, self.names, since, until)

    # -- recoveries -----------------------------------------------------------------------

    def recovered(self, v: Verdict, since: float, node: str | None = None,
                  timeout: float = 240) -> dict:
        """Waits for the first step after the recovery, warm or cold; fills in its path,
        time and steps lost. ``node``: the one that held the lost rank; if it lives on
        without its worker after a warm recovery, it is started again as the next spare.
        A standby node still running has put a new warm spare in the lost one's place
        itself: with spares that needs nothing; without, the job grows back into it."""
        rec = self.wait(lambda: self.latest("warm_recovery", since)
                        or self.latest("recovery", since), "recovery", timeout)
        v.path = recovery_path(rec)
        if v.action.startswith("flight-recorder report"):  # a watchdog's verdict
            v.action += "; " + WENT_ON.get(v.path, "restart from the last checkpoint")
        v.recover_s = rec["marks"]["first_step"] - v.injected_at
        if v.path != "cold":
            v.restored = rec["step"]
            # A standby whose spare held the rank offers a new spare at once, which the
            # job may claim within a second: ended then, it would take the claimed spare
            # with it (a second fault, of the harness's making)
            standing = (self.cfg.warm and node in self.standby
                        and self.cluster.nodes[node].poll() is None)
            # its agent has no worker left: back as a spare (with TP, a node whose other
            # ranks train on keeps them)
            lost = self.lost_ranks(rec) or []
            others = [r for r, e in self.ranks().items() if e["host"] == node and r not in lost]
            if node is not None and standing and not self.spare_nodes:
                # unless it ends instead: a standby that joined a cold restart as a node
                # ends, as any node does, once a shrink has dropped its last rank
                standing = self.taken_back(v, node, v.injected_at, or_ends=True)
            if node is not None and not standing and not others:
                self.end_node(node)
                self.back(v, node)
        else:
            loaded = self.latest("checkpoint_loaded", since)
            v.restored = loaded["step"] if loaded else 0
        # a save at the stop (gpu_bad) can be past the step the fault was injected at
        v.steps_lost = max(0, v.at_step - v.restored)
        return rec

    def back(self, v: Verdict, node: str) -> None:
        """``node``, which left the job, comes back repaired as a spare: at once while
        spares wait for the job (unless no fault is left to need it); with none,
        ``repair_s`` after its fault, and a job that runs without it takes it in (a warm
        grow, or a restart): the verdict says which, and the time it cost the others."""
        if self.spare_nodes:
            if not self.last_fault:
                self.start(node)
            return
        time.sleep(max(0.0, v.injected_at + self.cfg.repair_s - time.time()))
        since = time.time()
        self.start(node)
        self.taken_back(v, node, since)

    def taken_back(self, v: Verdict, node: str, since: float, or_ends: bool = False) -> bool:
        """Waits for the job to take ``node``, a standby since ``since``, back in: the
        verdict says how (a warm grow, or a restart) and the time it cost the others.
        ``or_ends``: False as soon as the node's launcher ends instead (nothing of it is
        left to take back)."""
        def came() -> dict | None:
            return self.latest("warm_grow", since) or self.latest("recovery", since)

        def gone() -> dict | None:
            return ({"event": "node_ended"} if or_ends and self.cluster.nodes[node].poll()
                    is not None else None)
        if came() is None and self.world()[1] == self.cfg.world_size:
            return True
        back = self.wait(lambda: came() or self.ended(since) or gone(),
                         f"the job to take {node} back", 180)
        if back["event"] == "node_ended":
            return False
        if back["event"] == "run_end":  # it reached its last step first: nothing to grow
            return True
        v.returned = "grow" if back["event"] == "warm_grow" else "cold"
        v.return_s = (back["total_s"] if v.returned == "grow" else
                      back["marks"]["first_step"] - since)
        return True

    @staticmethod
    def lost_ranks(rec: dict) -> list[int] | None:
        """The ranks a recovery says died: lost (warm) or silent (cold)."""
        return rec.get("lost", rec.get("silent_ranks"))
