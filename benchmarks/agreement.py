"""The warm path's agreement at 256-16K simulated ranks against a real TCPStore.

Every simulated rank runs llmtrain's own agreement code (``llmtrain.recovery.warm``:
``WarmPath.report``, ``decide`` and the wait for the plan, the code a survivor runs after
a failed collective) through its own client connection to one libuv TCPStore server in
its own process, as on a real job. One rank is lost (its agent marks it gone, as
``llmtrain.launch.agent`` does) and one spare waits in the pool. Ranks are spread over
``--procs`` processes of ``--threads`` threads; all of them start reporting at once after
a barrier.

Per size it measures:
- store requests and bytes per rank (a survivor that does not decide, counted on its
  client), and the decider's (the first reporter: its wait for the tally, the one read of
  the report log, the plan and the spare's claim);
- the store's total requests and bytes for the whole agreement;
- time from the failure (the barrier) to the plan stored, and to every survivor holding
  it; whether the plan names the lost rank and the spare;
- the baseline, measured in the same run up to ``--baseline-up-to`` ranks: the pattern
  this agreement replaced, in which every survivor read every other's report (O(n^2)
  requests in all), and the ratio of the store requests to it.

``warm.settle_s`` is set far above the times measured, so a plan comes from a complete
tally, never from the settle time running out. The simulated ranks share this machine's
cores with the store server, so the times are those of 2 cores doing the work of
thousands of hosts: an upper bound.

    python benchmarks/agreement.py [--sizes 256,...,16384] [--block 8] [--procs 2]
        [--threads 16] [--baseline-up-to 1024]

About 2 minutes on 2 CPU cores; progress goes to stderr. Prints a table, then one JSON
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
from control_plane import Counted  # noqa: E402
from store_scale import (fit, in_private_netns, lane_slices, raise_fd_limit,  # noqa: E402
                         start_server, stop_all)

from llmtrain.config import WarmConfig  # noqa: E402
from llmtrain.distributed.signed_store import SignedStore  # noqa: E402
from llmtrain.recovery.roll_call import mark_gone  # noqa: E402
from llmtrain.recovery.warm import WarmPath, ward_of  # noqa: E402
from reaper import reaping  # noqa: E402

HOST = "127.0.0.1"
STORE_TIMEOUT = timedelta(seconds=600)
WARM = WarmConfig(enable=True, settle_s=60.0, budget_s=120.0)
SECRET = b"a benchmark's job secret, 32+ chars"


class Store(Counted):
    """The requests the agreement makes, counted (see ``control_plane.Counted``)."""

    def get(self, key: str) -> bytes:
        value = self.store.get(key)
        self._count([key], [value])
        return value

    def add(self, key: str, n: int) -> int:
        self._count([key])
        return self.store.add(key, n)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value = self.store.compare_set(key, expected, desired)
        self._count([key], [expected, desired])
        return value

    def append(self, key: str, value: str) -> None:
        self._count([key], [value])
        self.store.append(key, value)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._count(keys)
        self.store.wait(keys, timeout)


def lost_rank(n: int) -> int:
    return n // 2 + 1


def lane(ranks: list[int], n: int, block: int, port: int, sync, shared, results,
         naive: bool) -> None:
    """One thread's simulated ranks: connect and enter generation 0, then, after the
    barrier, the failure: each reports (the lost one's agent marks it gone instead); the
    decider decides on a thread of its own; then each waits for the plan."""
    try:
        paths = {r: WarmPath(WARM, SignedStore(Store(dist.TCPStore(  # signed, as in a job
            HOST, port, n, is_master=False, wait_for_workers=False, timeout=STORE_TIMEOUT,
            use_libuv=True)), SECRET, "bench"), "round", r, n, block) for r in ranks}
        sync.wait()  # connected, every rank in generation 0
        sync.wait()  # the failure
        deadline = time.monotonic() + WARM.budget_s
        out = {"plain": None, "decider": None, "plans": [], "got_plan_at": 0.0}
        decider, before = None, {}
        for r, path in paths.items():
            before[r] = path.store.raw.snapshot()
            if r == lost_rank(n):
                mark_gone(path.store, r)
                continue
            if path.report({"own": [10], "replicas": [10], "ward": ward_of(r, n, block)}):
                decider = threading.Thread(target=decide, args=(path, deadline, shared, out))
                decider.start()
                del before[r]  # its requests are the decider's
        for r, path in paths.items():
            if r == lost_rank(n) or r not in before:  # lost, or the decider (on its thread)
                continue
            plan = path._plan(deadline)
            out["got_plan_at"] = max(out["got_plan_at"], time.time())
            out["plans"].append([plan.lost, plan.spares])
            if out["plain"] is None and r in before:
                requests, nbytes = (a - b for a, b in zip(path.store.raw.snapshot(), before[r]))
                out["plain"] = {"requests": requests, "bytes": nbytes}
        if decider is not None:
            decider.join()
        out["requests"] = sum(p.store.raw.requests for p in paths.values())
        out["bytes"] = sum(p.store.raw.bytes for p in paths.values())
        if naive:
            out["naive"] = all_read_all(paths, n, sync)
        results.put(out)
    except Exception as e:  # the parent fails the point with it
        sync.abort()
        results.put(f"{type(e).__name__}: {e}")


def all_read_all(paths: dict[int, WarmPath], n: int, sync) -> dict:
    """The baseline: the pattern this agreement replaced, in which every survivor stored
    its report under a key of its own and then read every other survivor's (a check and
    a get each; its polling of a count at 100 Hz meanwhile is left out, to its favour).
    Returns this lane's requests, bytes and finish time."""
    survivors = [r for r in range(n) if r != lost_rank(n)]
    before = {r: p.store.raw.snapshot() for r, p in paths.items()}
    sync.wait()  # the failure, again
    for r, p in paths.items():
        if r != lost_rank(n):
            p.store.set(f"naive/report/{r}", json.dumps({"own": [10], "replicas": [10]}))
    sync.wait()  # every report stored: the wait for them is not this baseline's cost
    for r, p in paths.items():
        if r != lost_rank(n):
            for other in survivors:
                if p.store.check([f"naive/report/{other}"]):
                    p.store.get(f"naive/report/{other}")
    after = {r: p.store.raw.snapshot() for r, p in paths.items()}
    return {"requests": sum(after[r][0] - before[r][0] for r in paths),
            "bytes": sum(after[r][1] - before[r][1] for r in paths), "done": time.time()}


def decide(path: WarmPath, deadline: float, shared, out: dict) -> None:
    """The decider's part, then, as every survivor, the plan (its one store client is
    this thread's alone meanwhile)."""
    before = path.store.raw.snapshot()
    path.decide()
    shared["planned"].value = time.time()
    out["plans"].append([(plan := path._plan(deadline)).lost, plan.spares])
    requests, nbytes = (a - b for a, b in zip(path.store.raw.snapshot(), before))
    out["decider"] = {"requests": requests, "bytes": nbytes}


def worker(n: int, block: int, port: int, slices: list[list[int]], sync, shared,
           results, naive: bool) -> None:
    threads = [threading.Thread(target=lane, args=(s, n, block, port, sync, shared, results,
                                                   naive)) for s in slices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_point(n: int, args) -> dict:
    ctx = mp.get_context("fork")
    server, port, stop = start_server(ctx)
    pool = dist.TCPStore(HOST, port, is_master=False, timeout=STORE_TIMEOUT, use_libuv=True)
    pool.add("spares/registered", 1)  # one warm spare waits
    lanes = args.procs * args.threads
    sync = ctx.Barrier(lanes + 1, timeout=600)
    shared = {"planned": ctx.Value("d", 0.0)}
    results = ctx.Queue()
    naive = n <= args.baseline_up_to
    workers = [ctx.Process(target=worker, args=(n, args.block, port, slices, sync, shared,
                                                results, naive))
               for slices in lane_slices(n, args.procs, args.threads)]
    try:
        for w in workers:
            w.start()
        sync.wait()  # connected
        failed_at = time.time()
        sync.wait()  # the failure
        if naive:
            sync.wait()  # the baseline's failure
            sync.wait()  # its reports stored
            naive_from = time.time()
        outs = [results.get(timeout=900) for _ in range(lanes)]
        stored = json.loads(SignedStore(pool, SECRET, "bench").get("round/g0/decision/0"))
    finally:
        stop_all(workers, stop, server, grace_s=10)
    errors = [o for o in outs if isinstance(o, str)]
    if errors:
        raise RuntimeError(f"{n} ranks: {errors[0]}")
    plain = next(o["plain"] for o in outs if o["plain"] is not None)
    decider = next(o["decider"] for o in outs if o["decider"] is not None)
    lost = lost_rank(n)
    plans = [p for o in outs for p in o["plans"]]
    right = (len(plans) == n - 1 and all(p == [[lost], {str(lost): 1}] for p in plans)
             and stored["lost"] == [lost])
    baseline = {}
    if naive:
        baseline = {"baseline_requests": sum(o["naive"]["requests"] for o in outs),
                    "baseline_bytes": sum(o["naive"]["bytes"] for o in outs),
                    "baseline_read_s": max(o["naive"]["done"] for o in outs) - naive_from}
    return {**baseline, "plain_requests": plain["requests"], "plain_bytes": plain["bytes"],
            "decider_requests": decider["requests"], "decider_bytes": decider["bytes"],
            "store_requests": sum(o["requests"] for o in outs),
            "store_bytes": sum(o["bytes"] for o in outs),
            "plan_s": shared["planned"].value - failed_at,
            "all_s": max(o["got_plan_at"] for o in outs) - failed_at, "plan_right": right}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,512,1024,2048,4096,8192,16384")
    parser.add_argument("--block", type=int, default=8, help="ranks per node")
    parser.add_argument("--procs", type=int, default=2, help="client worker processes")
    parser.add_argument("--threads", type=int, default=16, help="threads per worker process")
    parser.add_argument("--baseline-up-to", type=int, default=1024,
                        help="the largest size the all-read-all baseline runs at (it grows "
                             "as the square of the ranks)")
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if sizes[0] < 4 * args.block:
        parser.error("every size needs 4 nodes at least")
    in_private_netns()
    raise_fd_limit(sizes[-1] + 1)

    rows: dict[int, dict] = {}
    for n in sizes:
        rows[n] = r = run_point(n, args)
        print(f"agreement {n:>6} ranks: plan after {r['plan_s']:.3f} s, all hold it after "
              f"{r['all_s']:.3f} s", file=sys.stderr, flush=True)

    print(f"\nwarm-path agreement, one rank lost, {args.block} ranks per node, {args.procs} "
          f"processes x {args.threads} threads of simulated ranks, one libuv TCPStore server")
    print(f"{'ranks':>6} | {'rank req':>8}{'bytes':>7} | {'decider req':>11}{'bytes':>9} | "
          f"{'store req':>10}{'store MB':>9} | {'plan s':>7}{'all s':>7} | {'right':>5}")
    for n, r in rows.items():
        print(f"{n:>6} | {r['plain_requests']:>8}{r['plain_bytes']:>7} | "
              f"{r['decider_requests']:>11}{r['decider_bytes']:>9} | {r['store_requests']:>10}"
              f"{r['store_bytes'] / 1e6:>9.2f} | {r['plan_s']:>7.3f}{r['all_s']:>7.3f} | "
              f"{str(r['plan_right']):>5}")
    base = {n: r for n, r in rows.items() if "baseline_requests" in r}
    if base:
        print("\nbaseline, every survivor reads every report (the pattern replaced):")
        print(f"{'ranks':>6} | {'store req':>10}{'store MB':>9}{'read s':>8} | "
              f"{'req ratio':>9}{'MB ratio':>9}")
        for n, r in base.items():
            print(f"{n:>6} | {r['baseline_requests']:>10}{r['baseline_bytes'] / 1e6:>9.2f}"
                  f"{r['baseline_read_s']:>8.2f} | "
                  f"{r['baseline_requests'] / r['store_requests']:>9.1f}"
                  f"{r['baseline_bytes'] / r['store_bytes']:>9.1f}")
    fitted = ["plain_requests", "decider_requests", "decider_bytes", "store_requests",
              "store_bytes", "plan_s", "all_s"]
    exponents = {k: round(fit({n: r[k] for n, r in rows.items()})[1], 3) for k in fitted
                 if len(rows) >= 2}
    if len(base) >= 2:
        exponents["baseline_requests"] = round(
            fit({n: r["baseline_requests"] for n, r in base.items()})[1], 3)
    print("growth exponent k of cost ~ a*n^k (least squares on log-log, "
          f"{sizes[0]}-{sizes[-1]} ranks): " +
          ", ".join(f"{k} {v:.2f}" for k, v in exponents.items()))
    figures: dict[str, object] = {f"{k}_growth_exponent": v for k, v in exponents.items()}
    for n, r in rows.items():
        for key, v in r.items():
            figures[f"{key}_{n}"] = round(v, 6) if isinstance(v, float) else v
        if "baseline_requests" in r:
            figures[f"requests_vs_baseline_{n}"] = round(
                r["store_requests"] / r["baseline_requests"], 6)
    figures.update(block=args.block, procs=args.procs, threads=args.threads)
    print(json.dumps(figures))


if __name__ == "__main__":
    with reaping():
        main()
