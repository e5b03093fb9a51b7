"""The watchdog's control plane at 256-16K simulated ranks against a real TCPStore.

Every simulated rank runs llmtrain's own aggregation (``llmtrain.reliability.heartbeats``:
``ControlPlane`` and ``verdict``, the code the watchdog thread runs) through its own
client connection to one libuv TCPStore server in its own process, as on a real job:
ranks publish heartbeats, node leaders (one per ``--block`` ranks) reduce their node's,
rank 0 reads the node summaries and judges them; each straggler window the same for
collective arrival times. Ranks are spread over ``--procs`` processes of ``--threads``
threads; all of them meet at a barrier between phases, so a phase's wall time is what
the store and the simulated cluster took for it.

The heartbeats carry the worst case: every rank is quiet and says which collective it
waits in (a hang, when rank 0's judgement matters), so every node summary has a party.

Per size it measures:
- per-heartbeat cost on one plain rank, on a node leader (its reduction on top of its own
  heartbeat) and on rank 0 (reading and judging the summaries): store requests and bytes
  per call (counted on the client), wall time and the calling thread's CPU time (the least
  of ``--reps`` calls made while the other ranks are idle, so that 2 cores shared by all
  simulated ranks do not blur it; CPU time leaves out waiting for the store and for cores
  other processes hold);
- the store's load per heartbeat round of all ranks: requests, bytes, the server
  process's CPU seconds, and the round's wall time;
- detection: a rank (not a leader) falls silent, its last heartbeat already older than the
  hang timeout (the timeout itself does not grow with the world, so what is measured is
  the pipeline after it); rounds run until rank 0's verdict names it: the seconds from the
  silence to the verdict, and the rounds;
- one straggler window (``--arrivals`` collectives per rank, one rank 5 % late at each):
  the same three per-call costs, and whether rank 0 named that rank slowest.

Then fits ``cost ~ a * n^k`` per figure over the sizes. The simulated ranks share this
machine's cores, so a round of all ranks' heartbeats takes seconds at 16K: the simulated
heartbeat interval (hence the staleness threshold, one and a half intervals) and the hang timeout
are scaled up (``--interval-s``) so that healthy ranks stay fresh between rounds.

c10d looks up every client socket's peer name, which stalls where the resolver is slow,
so the script re-runs itself in a private network namespace (``unshare --net``), as
``benchmarks/store_scale.py`` does.

    python benchmarks/control_plane.py [--sizes 256,...,16384] [--block 8] [--procs 2]
        [--threads 16] [--reps 5] [--arrivals 64]

About 3 minutes on 2 CPU cores; progress goes to stderr. Prints a table, then one JSON
line of the figures and the growth exponents.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from store_scale import (fit, in_private_netns, lane_slices, raise_fd_limit,  # noqa: E402
                         start_server, stop_all)

from llmtrain.distributed.signed_store import SignedStore  # noqa: E402
from llmtrain.reliability.heartbeats import ControlPlane, verdict  # noqa: E402
from reaper import reaping  # noqa: E402

HOST = "127.0.0.1"
STORE_TIMEOUT = timedelta(seconds=600)
SECRET = b"a benchmark's job secret, 32+ chars"
CALL = "gloo:all_reduce sizes=[[4096]] dtypes=['Float']"
FACTOR, FLOOR_S = 10.0, 3.0  # reliability.not_arrived_* defaults


class Counted:
    """A store client that counts the requests and bytes (keys and values, both ways) it
    carries: what one rank costs the store."""

    def __init__(self, store: dist.TCPStore):
        self.store, self.requests, self.bytes = store, 0, 0

    def _count(self, keys: list[str], values=()) -> None:
        self.requests += 1
        self.bytes += sum(map(len, keys)) + sum(len(v) for v in values)

    def set(self, key: str, value) -> None:
        self._count([key], [value])
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        self._count(keys)
        return self.store.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.store.multi_get(keys)
        self._count(keys, values)
        return values

    def snapshot(self) -> tuple[int, int]:
        return self.requests, self.bytes


def heartbeat(wall: float) -> dict:
    """A quiet rank's heartbeat, waiting in collective #100 of the default group."""
    return {"step": 1234, "phase": "backward", "wall": wall, "host": "node", "progress_age":
            4.0, "long": False, "at": {"default_pg": [100, CALL, True, 4.0, 0.05]}}


def arrival_entries(rank: int, count: int, straggler: int) -> list[dict]:
    """Flight-recorder entries of ``count`` collectives 10 ms apart; ``straggler`` enters
    each 0.5 ms late, the others within a few microseconds."""
    late = 500_000 if rank == straggler else (rank * 7919) % 5000
    return [{"process_group": ["0", "default_pg"], "collective_seq_id": s, "retired": True,
             "time_created_ns": 10**18 + s * 10**7 + late} for s in range(1, count + 1)]


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Lane:
    """One thread's simulated ranks, walking through the script phase by phase; every lane
    and the parent meet at ``sync`` between phases."""

    def __init__(self, ranks: list[int], n: int, args, port: int, sync, shared):
        self.n, self.args, self.sync, self.shared = n, args, sync, shared
        self.silenced = n // 2 + 1  # not a leader (with blocks of 2 or more)
        self.straggler = n // 3 + 1
        self.planes = {}
        for r in ranks:
            client = Counted(dist.TCPStore(HOST, port, n, is_master=False,
                                           wait_for_workers=False, timeout=STORE_TIMEOUT,
                                           use_libuv=True))
            # signed as in a job: the secret's HMAC is part of each beat's cost
            self.planes[r] = ControlPlane(SignedStore(client, SECRET, "bench"), r, n,
                                          args.block, args.interval_s)
        self.out: dict = {"requests": 0, "bytes": 0, "costs": {}, "named_slowest": None}

    def _round(self, skip: int | None = None) -> None:
        """One heartbeat round: every rank beats, leaders reduce, rank 0 judges."""
        for r, p in self.planes.items():
            if r != skip:
                p.publish(heartbeat(time.time()))
                p.store.raw.check(["event"])
        self.sync.wait()
        for p in self.planes.values():
            if p.leader:
                p.summarize()
        self.sync.wait()
        if 0 in self.planes:
            found = verdict(self.planes[0].world(), self.args.interval_s * 6, FACTOR, FLOOR_S,
                            self.planes[0].stale_s)
            if found and f"rank {self.silenced} " in found[1]:
                self.shared["detected"].value = time.time()
        self.sync.wait()

    def _alone(self, name: str, rank: int, call) -> None:
        """``call`` on ``rank`` ``--reps`` times while the other ranks are idle: its wall
        time and its thread's CPU time (the least of each: other work on this shared
        machine only adds) and its store requests and bytes per call."""
        if rank in self.planes:
            p = self.planes[rank]
            before, times, cpu = p.store.raw.snapshot(), [], []
            for _ in range(self.args.reps):
                start, start_cpu = time.perf_counter(), time.thread_time()
                call(p)
                times.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
            after = p.store.raw.snapshot()
            self.out["costs"][name] = {"s": min(times), "cpu_s": min(cpu),
                                       "requests": (after[0] - before[0]) / self.args.reps,
                                       "bytes": (after[1] - before[1]) / self.args.reps}
        self.sync.wait()

    def run(self) -> None:
        a, block = self.args, self.args.block
        self.sync.wait()  # connected
        for _ in range(a.rounds):  # the store's load per round, counted on every rank
            self._round()
        self.out["requests"] = sum(p.store.raw.requests for p in self.planes.values())
        self.out["bytes"] = sum(p.store.raw.bytes for p in self.planes.values())
        self.sync.wait()
        beat = lambda p: (p.publish(heartbeat(time.time())), p.store.raw.check(["event"]))  # noqa: E731
        self._alone("plain", 1, beat)
        self._alone("leader", block, lambda p: p.summarize())
        self._alone("rank0", 0, lambda p: verdict(p.world(), a.interval_s * 6, FACTOR, FLOOR_S,
                                                          p.stale_s))
        # detection: the silenced rank's last heartbeat is already past the hang timeout
        if self.silenced in self.planes:
            self.planes[self.silenced].publish(heartbeat(time.time() - a.interval_s * 6 - 1))
            self.shared["silenced"].value = time.time()
        self.sync.wait()
        for _ in range(20):
            self._round(skip=self.silenced)
            if self.shared["detected"].value:
                break
        # one straggler window
        for r, p in self.planes.items():
            p.publish_arrivals(arrival_entries(r, a.arrivals, self.straggler))
        self.sync.wait()
        self._alone("arrivals_plain", 1, lambda p: p.publish_arrivals(
            arrival_entries(1, a.arrivals, self.straggler)))
        for p in self.planes.values():
            if p.leader:
                p.reduce_arrivals()
        self.sync.wait()
        self._alone("arrivals_leader", block, lambda p: p.reduce_arrivals())
        if 0 in self.planes:
            scores = self.planes[0].stragglers()
            self.out["named_slowest"] = bool(scores and scores.top[0][0] == self.straggler)
        self._alone("arrivals_rank0", 0, lambda p: p.stragglers())


def worker(n: int, args, port: int, slices: list[list[int]], sync, shared, results) -> None:
    def lane(ranks: list[int]) -> None:
        try:
            it = Lane(ranks, n, args, port, sync, shared)
            it.run()
            results.put(it.out)
        except Exception as e:  # the parent fails the point with it
            sync.abort()
            results.put(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=lane, args=(s,)) for s in slices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_point(n: int, args) -> dict:
    ctx = mp.get_context("fork")
    server, port, stop = start_server(ctx)
    lanes = args.procs * args.threads
    sync = ctx.Barrier(lanes + 1, timeout=600)
    shared = {"detected": ctx.Value("d", 0.0), "silenced": ctx.Value("d", 0.0)}
    results = ctx.Queue()
    workers = [ctx.Process(target=worker, args=(n, args, port, slices, sync, shared, results))
               for slices in lane_slices(n, args.procs, args.threads)]
    try:
        for w in workers:
            w.start()
        try:  # the lanes' script, barrier by barrier (see Lane.run)
            sync.wait()  # all connected
            cpu, start = cpu_seconds(server.pid), time.monotonic()
            for _ in range(3 * args.rounds):
                sync.wait()
            round_s = (time.monotonic() - start) / args.rounds
            server_cpu = (cpu_seconds(server.pid) - cpu) / args.rounds
            for _ in range(1 + 3 + 1):  # counted; three costs alone; silenced
                sync.wait()
            for rounds in range(1, 21):
                for _ in range(3):
                    sync.wait()
                if shared["detected"].value:
                    break
            for _ in range(5):  # the straggler window
                sync.wait()
        except threading.BrokenBarrierError:
            pass  # a lane failed: its error is in the results
        outs = [results.get(timeout=900) for _ in range(lanes)]
    finally:
        stop_all(workers, stop, server, grace_s=10)
    errors = [o for o in outs if isinstance(o, str)]
    if errors:
        raise RuntimeError(f"{n} ranks: {errors[0]}")
    costs = {k: v for o in outs for k, v in o["costs"].items()}
    detected = shared["detected"].value
    return {"round_s": round_s, "server_cpu_s": server_cpu,
            "store_requests": sum(o["requests"] for o in outs) / args.rounds,
            "store_bytes": sum(o["bytes"] for o in outs) / args.rounds,
            "detect_s": detected - shared["silenced"].value if detected else None,
            "detect_rounds": rounds if detected else None,
            "named_slowest": next(o["named_slowest"] for o in outs
                                  if o["named_slowest"] is not None),
            **{f"{role}_{k}": v for role, c in costs.items() for k, v in c.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,512,1024,2048,4096,8192,16384")
    parser.add_argument("--block", type=int, default=8, help="ranks per node")
    parser.add_argument("--procs", type=int, default=2, help="client worker processes")
    parser.add_argument("--threads", type=int, default=16, help="threads per worker process")
    parser.add_argument("--rounds", type=int, default=2, help="heartbeat rounds for the load")
    parser.add_argument("--reps", type=int, default=15,
                        help="calls per per-rank cost (the least counts)")
    parser.add_argument("--arrivals", type=int, default=64,
                        help="collectives per rank in the straggler window (the watchdog "
                             "publishes up to 512)")
    parser.add_argument("--interval-s", type=float, default=5.0,
                        help="simulated heartbeat interval; the hang timeout is 6 of them")
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if sizes[0] < 4 * args.block:
        parser.error("every size needs 4 nodes at least")
    in_private_netns()
    raise_fd_limit(sizes[-1])

    rows: dict[int, dict] = {}
    for n in sizes:
        rows[n] = run_point(n, args)
        r = rows[n]
        print(f"control_plane {n:>6} ranks: round {r['round_s']:.2f} s, rank 0 "
              f"{r['rank0_s'] * 1e3:.1f} ms, detected after {r['detect_s']}", file=sys.stderr,
              flush=True)

    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    print(f"\nwatchdog control plane, {args.block} ranks per node, {args.procs} processes x "
          f"{args.threads} threads of simulated ranks, one libuv TCPStore server")
    print("per heartbeat: ms and store requests / bytes per call, on one rank of each role; "
          "the store's load per round of all ranks")
    head = (f"{'ranks':>6}{'nodes':>6} | {'plain ms':>8}{'req':>4}{'bytes':>6} | "
            f"{'leader ms':>9}{'req':>4}{'bytes':>7} | {'rank0 ms':>8}{'cpu':>7}{'req':>4}"
            f"{'bytes':>8} | {'round s':>7}{'store req':>10}{'store MB':>9}{'srv cpu s':>10}"
            f" | {'detect s':>8}{'rounds':>7} | {'window rank0 ms':>15}{'cpu':>7}"
            f"{'slowest ok':>11}")
    print(head)
    for n, r in rows.items():
        detect = (f"{r['detect_s']:>8.2f}{r['detect_rounds']:>7}" if r["detect_s"] is not None
                  else f"{'-':>8}{'-':>7}")
        print(f"{n:>6}{n // args.block:>6} | {ms(r['plain_s']):>8}{r['plain_requests']:>4.0f}"
              f"{r['plain_bytes']:>6.0f} | {ms(r['leader_s']):>9}{r['leader_requests']:>4.0f}"
              f"{r['leader_bytes']:>7.0f} | {ms(r['rank0_s']):>8}{ms(r['rank0_cpu_s']):>7}"
              f"{r['rank0_requests']:>4.0f}"
              f"{r['rank0_bytes']:>8.0f} | {r['round_s']:>7.2f}{r['store_requests']:>10.0f}"
              f"{r['store_bytes'] / 1e6:>9.2f}{r['server_cpu_s']:>10.2f} | {detect} | "
              f"{ms(r['arrivals_rank0_s']):>15}{ms(r['arrivals_rank0_cpu_s']):>7}"
              f"{str(r['named_slowest']):>11}")
    fitted = ["plain_s", "leader_s", "rank0_s", "rank0_cpu_s", "rank0_bytes", "round_s",
              "store_requests", "store_bytes", "server_cpu_s", "detect_s",
              "arrivals_rank0_s", "arrivals_rank0_cpu_s", "arrivals_leader_s"]
    exponents = {}
    for key in fitted:
        points = {n: r[key] for n, r in rows.items() if r[key]}
        if len(points) >= 2:
            exponents[key] = round(fit(points)[1], 3)
    print("growth exponent k of cost ~ a*n^k (least squares on log-log, "
          f"{sizes[0]}-{sizes[-1]} ranks): " +
          ", ".join(f"{k} {v:.2f}" for k, v in exponents.items()))
    figures: dict[str, object] = {f"{k}_growth_exponent": v for k, v in exponents.items()}
    for n, r in rows.items():
        for key in ("plain_s", "leader_s", "rank0_s", "rank0_cpu_s", "rank0_bytes", "round_s",
                    "store_requests", "store_bytes", "server_cpu_s", "detect_s",
                    "detect_rounds", "arrivals_rank0_s", "arrivals_rank0_cpu_s",
                    "named_slowest"):
            v = r[key]
            figures[f"{key}_{n}"] = round(v, 6) if isinstance(v, float) else v
    figures.update(block=args.block, procs=args.procs, threads=args.threads,
                   arrivals=args.arrivals, interval_s=args.interval_s)
    print(json.dumps(figures))


if __name__ == "__main__":
    with reaping():
        main()
