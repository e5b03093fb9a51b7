"""Store traffic of rendezvous and process-group start-up at 1K-16K simulated ranks.

At start-up every rank talks to one TCPStore (a single server thread on rank 0's host),
so the store requests per rank decide how start-up grows with the job. This benchmark
replays two start-up patterns against a real libuv TCPStore server on loopback, with
one real client connection per simulated rank, and fits the growth exponent ``k`` of
``time ~ a * n^k`` for each.

- **llmtrain** (``llmtrain.distributed.process_group`` on NCCL, ``device_id`` bound):
  a rank connects (explicit libuv server on rank 0, ``wait_for_workers=False``), then
  ProcessGroupNCCL's eager init exchanges NCCL unique ids: with more than 128 ranks
  torch uses NCCL's scalable init, where ceil(n/128) evenly spread root ranks each
  ``set`` one 128-byte id and every rank ``multi_get``s all root ids (one request; with
  at most 128 ranks it is one id from rank 0, the same traffic). No store barrier
  (``TORCH_DIST_INIT_BARRIER`` unset), and DeviceMesh subgroups are NCCL communicator
  splits, so they add no store traffic. O(n) requests, O(n^2/128) bytes.
- **naive** (gloo's full-mesh connect, which torch's gloo backend runs for every group,
  then c10d's store-based barrier: the O(n^2) start-up traffic MegaScale (NSDI '24)
  reports at scale): a rank connects, ``set``s its 128-byte address, ``get``s every
  other rank's address one key at a time, then the barrier: ``add(1)``, ``add(0)`` to
  read the count, the rank that sees ``n`` sets the release key, all ``wait`` on it.
  O(n^2) requests. (gloo's values also grow by 8 bytes per peer and it ``wait``s
  before each ``get``; both are left out, so this understates gloo's real cost.)
- **connect** only, the floor both share: every rank opens its client connection.

What is simulated is the store traffic only: no NCCL or gloo transport, no torchrun
agent, no peer-to-peer connections. Ranks are spread over ``--procs`` worker processes
of ``--threads`` threads each; a thread drives its ranks through each step in turn (all
their connects, then all their sets, then all their reads), since a thread must not
block on a key one of its own later ranks has yet to set. Server and clients share this
machine's cores, so absolute times are single-machine figures; the exponents and the
ratio are the point. A time is the wall time from a common start (no connection open
yet) until the last simulated rank is done; each run has a fresh server.

Every pattern runs at the ``--sizes`` and at a half and a quarter of the smallest. A
connect or llmtrain point is the median of ``--reps`` runs. The naive pattern runs
once per size, upwards while its predicted time (from its fit so far) stays within
``--naive-budget-s``; its larger sizes are extrapolated from its fit: marked so in the
table, and in the JSON under keys of their own (``naive_s_<n>_extrapolated``,
``naive_over_llmtrain_<n>_extrapolated``), never under a measured figure's name.

c10d looks up every client socket's peer name, which stalls 5 s at a time where the
resolver is slow (as in this project's sandbox), so the script re-runs itself in a
private network namespace (``unshare --net``, loopback up), where the lookup fails at
once.

    python benchmarks/store_scale.py [--sizes 1024,2048,4096,8192,16384] [--procs 2]
        [--threads 16] [--reps 3] [--naive-budget-s 60]

About 2 minutes on 2 CPU cores (the naive pattern is measured up to 1024 ranks there);
progress goes to stderr. Prints a table, then one JSON line:
{"llmtrain_s_16384": ..., "naive_s_1024": ..., "naive_s_16384_extrapolated": ...,
"llmtrain_growth_exponent": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from reaper import reaping

HOST = "127.0.0.1"
NETNS_ENV = "LLMTRAIN_STORE_SCALE_NETNS"
RANKS_PER_ROOT = 128        # torch's TORCH_NCCL_RANKS_PER_ROOT default
NCCL_ID = b"\x01" * 128     # sizeof(ncclUniqueId)
ADDRESS = b"\x02" * 128     # a rank's listening address (hostname + sockaddr)
STORE_TIMEOUT = timedelta(seconds=600)
FD_MARGIN = 64              # descriptors besides the store sockets (pipes, libs, ...)


# -- the two patterns: one thread's share of the simulated ranks ----------------------

def llmtrain_pattern(mine: list[tuple[int, dist.TCPStore]], n: int) -> None:
    roots = math.ceil(n / RANKS_PER_ROOT)
    root_index = {i * n // roots: i for i in range(roots)}
    keys = [f"UniqueNCCLID:{i}" for i in range(roots)]
    for rank, store in mine:
        if rank in root_index:
            store.set(keys[root_index[rank]], NCCL_ID)
    for _, store in mine:
        store.multi_get(keys)


def naive_pattern(mine: list[tuple[int, dist.TCPStore]], n: int) -> None:
    for rank, store in mine:
        store.set(f"gloo/{rank}", ADDRESS)
    for rank, store in mine:
        for peer in range(n):
            if peer != rank:
                store.get(f"gloo/{peer}")
    for _, store in mine:  # c10d's _store_based_barrier
        store.add("barrier", 1)
    for _, store in mine:
        if store.add("barrier", 0) == n:
            store.set("barrier:last_worker", b"1")
    for _, store in mine:
        store.wait(["barrier:last_worker"])


def connect_only(mine: list[tuple[int, dist.TCPStore]], n: int) -> None:
    """Nothing past the connection itself."""


PATTERNS = {"connect": connect_only, "llmtrain": llmtrain_pattern, "naive": naive_pattern}


def store_calls(pattern: str, n: int) -> int:
    """Store calls the pattern makes in all, connects included."""
    if pattern == "llmtrain":
        return n + math.ceil(n / RANKS_PER_ROOT) + n
    return n + n + n * (n - 1) + 2 * n + 1 + n


# -- processes ----------------------------------------------------------------------

def serve(port_out, stop) -> None:
    """The store server, alone in its process as on a real rank 0."""
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=STORE_TIMEOUT, use_libuv=True)
    port_out.send(store.port)
    stop.wait()


def start_server(ctx):
    """A fresh store server process (``serve``): (the process, its port, the event that
    stops it)."""
    port_in, port_out = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    server = ctx.Process(target=serve, args=(port_out, stop))
    server.start()
    return server, port_in.recv(), stop


def lane_slices(n: int, procs: int, threads: int) -> list[list[list[int]]]:
    """Ranks 0..n-1 dealt over ``procs`` processes of ``threads`` lanes, round robin."""
    lanes = procs * threads
    return [[list(range(p * threads + t, n, lanes)) for t in range(threads)]
            for p in range(procs)]


def worker(pattern: str, n: int, port: int, slices: list[list[int]], ready, go, results) -> None:
    """Simulated ranks on threads; each thread reports its finish time, or its error."""
    def run(ranks: list[int]) -> None:
        go.wait()
        try:
            mine = [(r, dist.TCPStore(HOST, port, n, is_master=False, wait_for_workers=False,
                                      timeout=STORE_TIMEOUT, use_libuv=True)) for r in ranks]
            PATTERNS[pattern](mine, n)
            results.put(time.monotonic())
        except Exception as e:  # the parent fails the run with it
            results.put(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(s,)) for s in slices]
    for t in threads:
        t.start()
    ready.put(True)
    for t in threads:
        t.join()


def run_point(pattern: str, n: int, procs: int, threads: int, limit_s: float) -> float:
    """Seconds from the common start until the last of ``n`` simulated ranks is done."""
    ctx = mp.get_context("fork")  # no re-import of torch per process
    server, port, stop = start_server(ctx)
    go, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=worker, args=(pattern, n, port, slices, ready, go, results))
               for slices in lane_slices(n, procs, threads)]
    ends = []
    try:
        for w in workers:
            w.start()
        for _ in workers:
            ready.get(timeout=120)
        start = time.monotonic()
        go.set()
        deadline = start + limit_s
        for _ in range(procs * threads):
            try:
                end = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{pattern} pattern at {n} ranks: not done after "
                                   f"{limit_s:.0f} s") from None
            if isinstance(end, str):
                raise RuntimeError(f"{pattern} pattern at {n} ranks failed: {end}")
            ends.append(end)
    finally:
        stop_all(workers, stop, server, grace_s=5)
    return max(ends) - start


def stop_all(workers: list, stop, server, grace_s: float) -> None:
    """Joins the worker processes (killing any still alive after ``grace_s``), then stops
    the store server process."""
    for w in workers:
        w.join(timeout=grace_s)
        if w.is_alive():
            w.kill()
            w.join()
    stop.set()
    server.join()


# -- set-up, fit, report ------------------------------------------------------------

def in_private_netns() -> None:
    """Re-runs the running script (this one, or another benchmark that calls this) inside
    ``unshare --net`` with loopback up, unless it already is."""
    if os.environ.get(NETNS_ENV) == "1":
        return
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    probe = None if missing else subprocess.run(
        ["unshare", "--net", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if missing or probe.returncode != 0:
        why = f"{', '.join(missing)} not found" if missing else probe.stderr.strip()
        sys.exit(f"{os.path.basename(sys.argv[0])}: needs a private network namespace "
                 f"(unshare --net, as root or with CAP_SYS_ADMIN) so c10d's reverse-DNS "
                 f"lookups of client sockets cannot stall connects for 5 s each; that "
                 f"failed: {why}")
    env = {**os.environ, NETNS_ENV: "1"}
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that peer names don't resolve
    os.execvpe("unshare", ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"',
                           "sh", sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]], env)


def raise_fd_limit(n: int) -> None:
    """The server holds a socket per simulated rank (a worker, one per rank it drives)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + FD_MARGIN
    if need > hard:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {n} ranks need {need} open files in "
                 f"the server process; the hard limit (ulimit -Hn) is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, need)), hard))


def fit(points: dict[int, float]) -> tuple[float, float]:
    """(a, k) of time ~ a * n^k, least squares on log-log."""
    xs = [math.log(n) for n in points]
    ys = [math.log(t) for t in points.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - k * mx), k


def measure_naive(sizes: list[int], procs: int, threads: int, budget_s: float,
                  say) -> dict[int, float]:
    """Measures upwards while the predicted time fits the budget (quadratic guess until
    two points give a fit)."""
    measured: dict[int, float] = {}
    for n in sizes:
        if len(measured) >= 2:
            a, k = fit(measured)
            predicted = a * n ** k
        elif measured:
            last = max(measured)
            predicted = measured[last] * (n / last) ** 2
        else:
            predicted = 0.0
        if predicted > budget_s:
            say(f"naive    {n:>6} ranks: predicted {predicted:.0f} s > budget "
                f"{budget_s:g} s, extrapolated")
            break
        measured[n] = run_point("naive", n, procs, threads, max(120.0, 4 * budget_s))
        say(f"naive    {n:>6} ranks: {measured[n]:.3f} s")
    if len(measured) < 2:
        sys.exit("store_scale: the naive pattern needs two measured sizes for a fit; "
                 "raise --naive-budget-s or add smaller --sizes")
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384",
                        help="simulated rank counts, comma-separated")
    parser.add_argument("--procs", type=int, default=2, help="client worker processes")
    parser.add_argument("--threads", type=int, default=16, help="threads per worker process")
    parser.add_argument("--reps", type=int, default=3,
                        help="runs of each connect and llmtrain point (the median counts)")
    parser.add_argument("--naive-budget-s", type=float, default=60.0,
                        help="largest predicted time of one naive point worth measuring")
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if sizes[0] < 4 or min(args.procs, args.threads, args.reps) < 1:
        parser.error("--sizes must be >= 4; --procs, --threads and --reps >= 1")
    in_private_netns()
    raise_fd_limit(sizes[-1])

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rows = sorted({sizes[0] // 4, sizes[0] // 2, *sizes})
    say(f"store_scale: {args.procs} processes x {args.threads} threads of clients, "
        f"one libuv TCPStore server, loopback in a private network namespace")
    medians: dict[str, dict[int, float]] = {"connect": {}, "llmtrain": {}}
    for pattern, points in medians.items():
        for n in rows:
            runs = [run_point(pattern, n, args.procs, args.threads, 600.0)
                    for _ in range(args.reps)]
            points[n] = statistics.median(runs)
            say(f"{pattern:<8} {n:>6} ranks: {points[n]:.3f} s "
                f"(median of {', '.join(f'{t:.3f}' for t in runs)})")
    conn, ours = medians["connect"], medians["llmtrain"]
    naive = measure_naive(rows, args.procs, args.threads, args.naive_budget_s, say)
    _, k_conn = fit(conn)
    _, k_ours = fit(ours)
    a_naive, k_naive = fit(naive)
    naive_all = {n: naive.get(n, a_naive * n ** k_naive) for n in rows}
    extrapolated = [n for n in rows if n not in naive]

    print(f"\nstore traffic at start-up: wall time until every simulated rank is done "
          f"({args.procs} processes x {args.threads} threads of clients, one libuv "
          f"TCPStore server, loopback)")
    print(f"{'ranks':>7}{'connect s':>11}{'llmtrain s':>12}{'naive s':>12}"
          f"{'naive/llmtrain':>16}{'llmtrain calls':>16}{'naive calls':>14}")
    for n in rows:
        mark = " (naive extrapolated)" if n in extrapolated else ""
        print(f"{n:>7}{conn[n]:>11.3f}{ours[n]:>12.3f}{naive_all[n]:>12.3f}"
              f"{naive_all[n] / ours[n]:>16.1f}{store_calls('llmtrain', n):>16,}"
              f"{store_calls('naive', n):>14,}{mark}")
    print(f"growth exponent k of time ~ a*n^k (least squares on log-log): llmtrain "
          f"{k_ours:.2f} over {min(ours)}-{max(ours)} ranks, naive {k_naive:.2f} over "
          f"{min(naive)}-{max(naive)} ranks, connect only {k_conn:.2f}")
    if extrapolated:
        print(f"naive at {', '.join(map(str, extrapolated))} ranks: extrapolated with its fit "
              f"(a measured point would exceed --naive-budget-s {args.naive_budget_s:g}); "
              f"in the JSON as naive_s_<n>_extrapolated")

    figures: dict[str, object] = {}
    for n in rows:
        figures[f"connect_s_{n}"] = round(conn[n], 4)
        figures[f"llmtrain_s_{n}"] = round(ours[n], 4)
        tail = "_extrapolated" if n in extrapolated else ""
        figures[f"naive_s_{n}{tail}"] = round(naive_all[n], 4)
        figures[f"naive_over_llmtrain_{n}{tail}"] = round(naive_all[n] / ours[n], 2)
    figures.update(llmtrain_growth_exponent=round(k_ours, 3),
                   naive_growth_exponent=round(k_naive, 3),
                   connect_growth_exponent=round(k_conn, 3),
                   naive_extrapolated_sizes=extrapolated,
                   procs=args.procs, threads=args.threads, reps=args.reps)
    print(json.dumps(figures))


if __name__ == "__main__":
    with reaping():
        main()
