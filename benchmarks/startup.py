"""Time to first step, and what building a model for sharding costs per rank.

- **Time to first step** on the debug model for 1, 2 and 4 gloo ranks (8 with
  ``--world-sizes 1,2,4,8``; on 2 cores it only measures the queue for them): the real
  ``llmtrain train`` under torchrun, its parts from the ``startup`` event, against a stock
  sequence in the same run: ``init_process_group("gloo")`` (env://) + ``init_device_mesh``
  + the full model built and initialized on every rank + ``fully_shard`` + one step on
  random tokens (global batch 16; micro-batch 8, or 16 / ranks where that is less).
  Parts: launch (torchrun agent start to the rank's process start), imports, process
  group (store, group, mesh), model (construction, sharding, initialization, optimizer),
  rest (llmtrain's data and components, both sides' first step), first step after
  launch, and the whole command's wall time. Rank 0's figures, each side's from its
  fastest of ``--repeats`` runs; the two sides alternate.
- **Restart of a compiled run** (``parallelism.compile``): the time to the first step
  of a restart on a node that has not compiled the run (its own inductor cache empty),
  with the run dir's compile cache (llmtrain's) against compiling again, and, for
  reference, on the node that compiled it (torch's local cache). On CPU the run dir's
  cache also carries the built C++ kernels; every process still builds inductor's small
  probes of the CPU's vector ISA.
- **A node's first start** under ``llmtrain launch`` (one node, ``--node-ranks`` ranks,
  one step): as it runs by default, its processes forked from the node's template
  process that imported torch and llmtrain once, against every process importing for
  itself (``--no-template --no-prepared-workers``): the whole command's wall time, rank
  0's first step after its launch, and the CPU seconds of every process the launcher
  started (its own included), as ratios.
- **Construction**, 1B-class shapes (Llama 3.2 1B: dim 2048, 16 layers, vocab 128256,
  tied) on 2 real gloo ranks: llmtrain's meta -> ``parallelize`` -> ``to_empty`` ->
  ``init_weights`` vs the full model on every rank then ``fully_shard``; the slowest
  rank's time and the largest rank's peak RSS, as ratios. (The 8B preset in float32 is
  32 GB whole, more than this machine holds, so the ratio is taken on 1B shapes.)
- **Presets**: one rank of a simulated world (torch's fake process group; building and
  sharding a model needs no collectives) builds Llama 3 8B over 8 ranks and 70B over 64
  with their preset parallelism (FP8, checkpointing, compile wrappers) the llmtrain way;
  its peak RSS against the whole model's float32 bytes shows no rank allocates the model.

    python benchmarks/startup.py [--world-sizes 1,2,4] [--repeats 2] [--compile-ranks 2]
                                 [--node-ranks 2]
                                 [--presets llama3_8b:8,llama3_70b:64] [--skip-construct]

Prints tables, then one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reaper import reaping

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# the job's secret, as a job script gives it: the run dir's compile cache is signed with
# it, and loaded only where it is (the same in every start of a benchmark)
os.environ.setdefault("LLMTRAIN_JOB_SECRET", secrets.token_hex(32))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# llmtrain's start-up spans, grouped into the parts the stock sequence also has; any
# other span (data, components, ...) falls into "rest" with the first step.
GROUPS = {"launch": ("launch",), "imports": ("imports",),
          "process_group": ("store_connect", "process_group", "device_mesh"),
          "model": ("model", "model_meta", "shard", "materialize", "optimizer")}
PARTS = (*GROUPS, "rest", "first_step", "wall")
LOADS: list[float] = []  # the 1-minute load after each measured command: other work skews these
ONE_B = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
             ffn_dim_multiplier=1.5, multiple_of=256, tie_embeddings=True)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ---- workers (run as ``startup.py --worker ...``; they import only what they use) ----

def stock_worker(out: str, micro: str) -> None:
    """The stock sequence, up to its first step, timed like llmtrain's start-up."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from llmtrain.config import load_config
    from llmtrain.model import Transformer
    t0 = time.time()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    t1 = time.time()
    cfg = load_config("debug_cpu", {})
    torch.manual_seed(cfg.training.seed)
    model = Transformer(cfg.model)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    t2 = time.time()
    micro, seq = int(micro), cfg.data.seq_len
    for _ in range(cfg.training.global_batch_size // (micro * world)):
        batch = torch.randint(0, cfg.model.vocab_size, (micro, seq + 1))
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    done = time.time()
    if dist.get_rank() == 0:
        # Process start times are on record in /proc: read them now, as llmtrain's start-up
        # timeline does, so that importing the reader adds nothing to the stock side's times.
        from llmtrain.metrics.goodput import process_start_time
        started, agent = process_start_time(), process_start_time(os.getppid())
        phases = {"launch": started - agent, "imports": t0 - started,
                  "process_group": t1 - t0, "model": t2 - t1}
        Path(out).write_text(json.dumps({"phases": phases, "since_launch_s": done - agent}))
    dist.destroy_process_group()


def construct_worker(out: str, mode: str) -> None:
    """Builds the 1B-class model on every rank of a real gloo world, ``meta`` (llmtrain's
    way) or ``full``; rank 0 writes the slowest time and the largest peak RSS."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from llmtrain.config import ModelConfig, ParallelismConfig
    from llmtrain.distributed.parallelize import parallelize
    from llmtrain.model import Transformer
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = ModelConfig(**ONE_B)
    rss_before = peak_rss_gb()
    start = time.perf_counter()
    if mode == "meta":
        with torch.device("meta"):
            model = Transformer(cfg)
        parallelize(model, mesh, ParallelismConfig(device="cpu", param_dtype="float32"))
        model.to_empty(device="cpu")
        model.init_weights(0)
    else:
        torch.manual_seed(0)
        model = Transformer(cfg)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    seconds = time.perf_counter() - start
    mine = {"s": seconds, "peak_gb": peak_rss_gb(), "before_gb": rss_before}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({k: max(r[k] for r in everyone) for k in mine}))
    dist.destroy_process_group()


def preset_worker(out: str, preset: str, world: int) -> None:
    """Rank 0 of a simulated ``world``: the trainer's model sequence on a preset."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llmtrain.config import load_config
    from llmtrain.distributed.parallelize import parallelize
    from llmtrain.model import Transformer, count_params
    cfg = load_config(preset, {})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rss_before = peak_rss_gb()
    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(cfg.model)
    parallelize(model, mesh, cfg.parallelism)
    sharded = time.perf_counter()
    model.to_empty(device="cpu")
    model.init_weights(0)
    done = time.perf_counter()
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    Path(out).write_text(json.dumps({
        "params": count_params(cfg.model), "full_gb": count_params(cfg.model) * 4 / 2**30,
        "shard_gb": local / 2**30, "meta_shard_s": sharded - start,
        "materialize_s": done - sharded, "peak_gb": peak_rss_gb(), "before_gb": rss_before}))
    dist.destroy_process_group()


# ---- the driver ----

def run(cmd: list[str], timeout: float = 600, env: dict | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **(env or {})},
                          cwd=ROOT, timeout=timeout)
    seconds = time.perf_counter() - start
    LOADS.append(os.getloadavg()[0])
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\nexited {proc.returncode}\n{proc.stderr[-4000:]}")
    return seconds


def worker_cmd(nproc: int, *args: str) -> list[str]:
    return [*TORCHRUN, f"--nproc-per-node={nproc}", __file__, "--worker", *args]


def parts(phases: dict[str, float], since_launch: float, wall: float) -> dict[str, float]:
    grouped = {g: sum(phases.get(n, 0.0) for n in names) for g, names in GROUPS.items()}
    grouped["rest"] = since_launch - sum(grouped.values())
    return {**grouped, "first_step": since_launch, "wall": wall}


def micro_batch(nproc: int) -> int:
    """The preset's micro-batch, or less where the ranks would overfill the global batch."""
    from llmtrain.config import load_config
    t = load_config("debug_cpu", {}).training
    return min(t.micro_batch_size, t.global_batch_size // nproc)


def one_step(nproc: int, run_dir: Path, *extra: str, env: dict | None = None
             ) -> dict[str, float | dict]:
    """One step of ``llmtrain train`` under torchrun in ``run_dir``; the wall time and
    rank 0's last ``startup`` event."""
    from llmtrain.events import read_events
    wall = run([*TORCHRUN, f"--nproc-per-node={nproc}", "-m", "llmtrain", "train",
                "--config", "debug_cpu", "--training.run_dir", str(run_dir),
                "--training.steps", "1", "--training.micro_batch_size", str(micro_batch(nproc)),
                "--checkpoint.enable", "false", "--metrics.prometheus", "false", *extra],
               env=env)
    event = [e for e in read_events(str(run_dir), "startup") if e["rank"] == 0][-1]
    return {"wall": wall, "event": event}


def llmtrain_start(nproc: int, tmp: Path) -> tuple[dict[str, float], dict[str, float]]:
    run_dir = tmp / f"llmtrain-w{nproc}"
    shutil.rmtree(run_dir, ignore_errors=True)
    r = one_step(nproc, run_dir)
    event = r["event"]
    return parts(event["phases"], event["since_launch_s"], r["wall"]), event["phases"]


def compiled_start(nproc: int, run_dir: Path, node_cache: Path, run_dir_cache: bool
                   ) -> dict[str, float]:
    """A start of a compiled run on a node whose local inductor cache is ``node_cache``,
    with llmtrain's run-dir cache or without it; rank 0's parts."""
    r = one_step(nproc, run_dir, "--parallelism.compile", "true",
                 "--parallelism.compile_cache", str(run_dir_cache).lower(),
                 env={"TORCHINDUCTOR_CACHE_DIR": str(node_cache)})
    event = r["event"]
    return parts(event["phases"], event["since_launch_s"], r["wall"])


def node_start(nproc: int, tmp: Path, fresh: bool) -> dict[str, float]:
    """One node's ``llmtrain launch`` of one step: its wall time, rank 0's first step
    after its launch, and the CPU seconds of the launcher and all it started (each
    process is waited for by its parent: the launcher's, the template's, the agent's)."""
    from llmtrain.events import read_events
    run_dir = tmp / f"node-{'fresh' if fresh else 'forked'}-{nproc}"
    shutil.rmtree(run_dir, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = run([sys.executable, "-m", "llmtrain", "launch", "--nnodes", "1",
                "--nproc-per-node", str(nproc), "--rdzv-endpoint", "127.0.0.1:0",
                *(("--no-template", "--no-prepared-workers") if fresh else ()),
                "--config", "debug_cpu", "--training.run_dir", str(run_dir),
                "--training.steps", "1", "--training.micro_batch_size", str(micro_batch(nproc)),
                "--checkpoint.enable", "false", "--metrics.prometheus", "false",
                "--warm.enable", "false"])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    event = [e for e in read_events(str(run_dir), "startup") if e["rank"] == 0][-1]
    return {"wall": wall, "first_step": event["since_launch_s"],
            "cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)}


def node_starts(tmp: Path, nproc: int, repeats: int, figures: dict) -> None:
    """A node's first start with its processes forked from its template, against each
    importing for itself."""
    sides = {"forked": [], "fresh": []}
    for _ in range(repeats):  # alternate, so drift in load hits both sides
        for side, runs in sides.items():
            runs.append(node_start(nproc, tmp, fresh=side == "fresh"))
    best = {side: min(runs, key=lambda r: r["cpu"]) for side, runs in sides.items()}
    print(f"\na node's first start under llmtrain launch, {nproc} ranks, one step "
          f"(s; least CPU of {repeats})")
    print(f"{'side':<10}{'wall':>10}{'first step':>12}{'cpu':>10}")
    for side, r in best.items():
        print(f"{side:<10}{r['wall']:>10.2f}{r['first_step']:>12.2f}{r['cpu']:>10.2f}")
    ratios = {k: best["forked"][k] / best["fresh"][k] for k in ("wall", "first_step", "cpu")}
    print(f"{'ratio':<10}{ratios['wall']:>10.2f}{ratios['first_step']:>12.2f}"
          f"{ratios['cpu']:>10.2f}")
    for k, ratio in ratios.items():
        figures[f"node_start_{k}_forked_over_fresh_r{nproc}"] = round(ratio, 3)
        for side, r in best.items():
            figures[f"node_start_{k}_{side}_r{nproc}"] = round(r[k], 2)


def stock_start(nproc: int, tmp: Path) -> dict[str, float]:
    out = tmp / f"stock-w{nproc}.json"
    wall = run(worker_cmd(nproc, "stock", str(out), str(micro_batch(nproc))))
    result = json.loads(out.read_text())
    return parts(result["phases"], result["since_launch_s"], wall)


def fastest(runs: list[dict[str, float]]) -> dict[str, float]:
    return min(runs, key=lambda r: r["first_step"])


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("MemAvailable")) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--presets", default="llama3_8b:8,llama3_70b:64",
                        help="preset:simulated_world_size, comma-separated")
    parser.add_argument("--skip-construct", action="store_true")
    parser.add_argument("--compile-ranks", type=int, default=2,
                        help="ranks of the compiled starts (0: skip them)")
    parser.add_argument("--node-ranks", type=int, default=2,
                        help="ranks of the node's first start under llmtrain launch (0: skip)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        {"stock": stock_worker, "construct": construct_worker,
         "preset": lambda out, p, w: preset_worker(out, p, int(w))}[kind](*rest)
        return

    load_start = os.getloadavg()[0]
    figures: dict[str, float | str] = {}
    tmp = Path(tempfile.mkdtemp(prefix="llmtrain-bench-startup-"))
    try:
        print(f"\ntime to first step, debug model (s; fastest of {args.repeats})")
        print(f"{'ranks':<6}{'side':<10}" + "".join(f"{p:>14}" for p in PARTS))
        for w in (int(x) for x in args.world_sizes.split(",")):
            ours, stock, raw = [], [], {}
            for _ in range(args.repeats):  # alternate, so drift in load hits both sides
                result, phases = llmtrain_start(w, tmp)
                ours.append(result)
                raw = phases if result is fastest(ours) else raw
                stock.append(stock_start(w, tmp))
            a, b = fastest(ours), fastest(stock)
            for side, r in (("llmtrain", a), ("stock", b)):
                print(f"{w:<6}{side:<10}" + "".join(f"{r[p]:>14.2f}" for p in PARTS))
            print(f"{w:<6}{'ratio':<10}" + "".join(
                f"{a[p] / b[p]:>14.2f}" if b[p] > 0.005 else f"{'-':>14}" for p in PARTS))
            print(f"{'':<6}llmtrain spans: " + ", ".join(f"{k} {v:.2f}" for k, v in raw.items()))
            for p in ("first_step", "wall", "process_group", "model"):
                figures[f"{p}_llmtrain_over_stock_w{w}"] = round(a[p] / b[p], 3)
            figures[f"first_step_s_llmtrain_w{w}"] = round(a["first_step"], 2)
            figures[f"first_step_s_stock_w{w}"] = round(b["first_step"], 2)

        if args.node_ranks:
            node_starts(tmp, args.node_ranks, args.repeats, figures)
        if args.compile_ranks:
            compiled(tmp, args.compile_ranks, args.repeats, figures)
        if not args.skip_construct:
            construct(tmp, figures)
            presets(tmp, args.presets, figures)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures["loadavg_1m_start"] = round(load_start, 2)
    figures["loadavg_1m_max"] = round(max(LOADS), 2)
    print(json.dumps(figures))


def compiled(tmp: Path, nproc: int, repeats: int, figures: dict) -> None:
    """A restart of a compiled run on a node that has not compiled it (where restarts
    mostly land): with the run dir's compile cache, against compiling again; and, for
    reference, a restart on the node that compiled (torch's own local cache)."""
    sides = ("compile again", "run-dir cache", "same node")
    results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for i in range(repeats):
        run_dir = tmp / f"compiled-{i}"
        first = tmp / f"node-first-{i}"
        compiled_start(nproc, run_dir, first, True)  # the job's first start fills both
        for side in sides:  # each on a node cache of its own, the run dir's blob kept
            node = first if side == "same node" else tmp / f"node-{side}-{i}".replace(" ", "-")
            results[side].append(compiled_start(nproc, run_dir, node, side == "run-dir cache"))
    best = {side: fastest(runs) for side, runs in results.items()}
    print(f"\nrestart of a compiled run, debug model, {nproc} ranks (s; fastest of {repeats})")
    print(f"{'side':<16}" + "".join(f"{p:>14}" for p in PARTS))
    for side, r in best.items():
        print(f"{side:<16}" + "".join(f"{r[p]:>14.2f}" for p in PARTS))
    base = best["compile again"]
    for side in ("run-dir cache", "same node"):
        ratio = best[side]["first_step"] / base["first_step"]
        print(f"{side + ' / again':<16}{ratio:>14.3f} of the time to the first step")
        figures[f"compiled_restart_{side.replace(' ', '_').replace('-', '_')}_over_again"] = \
            round(ratio, 3)
    for side, r in best.items():
        figures[f"compiled_first_step_s_{side.replace(' ', '_').replace('-', '_')}"] = \
            round(r["first_step"], 2)


def construct(tmp: Path, figures: dict) -> None:
    # The full side holds the whole model (5 GB) and its shards on every rank at once.
    from llmtrain.config import ModelConfig
    from llmtrain.model import count_params
    full_gb = count_params(ModelConfig(**ONE_B)) * 4 / 2**30
    nproc = 2 if mem_available_gb() > 2 * 1.6 * full_gb + 2 else 1
    results = {}
    for mode in ("meta", "full"):
        out = tmp / f"construct-{mode}.json"
        run(worker_cmd(nproc, "construct", str(out), mode))
        results[mode] = json.loads(out.read_text())
    meta, full = results["meta"], results["full"]
    print(f"\nconstruction, 1B-class shapes ({count_params(ModelConfig(**ONE_B)) / 1e9:.2f}B "
          f"params, {full_gb:.1f} GB fp32), {nproc} gloo rank(s); per rank, worst rank")
    print(f"{'side':<34}{'time s':>10}{'peak RSS GB':>14}{'RSS before GB':>15}")
    for name, r in (("meta + local shards (llmtrain)", meta), ("full, then fully_shard", full)):
        print(f"{name:<34}{r['s']:>10.2f}{r['peak_gb']:>14.2f}{r['before_gb']:>15.2f}")
    print(f"{'ratio meta / full':<34}{meta['s'] / full['s']:>10.3f}"
          f"{meta['peak_gb'] / full['peak_gb']:>14.3f}")
    figures.update(construct_ranks=nproc,
                   construct_time_meta_over_full=round(meta["s"] / full["s"], 3),
                   construct_mem_meta_over_full=round(meta["peak_gb"] / full["peak_gb"], 3),
                   construct_s_meta=round(meta["s"], 2), construct_s_full=round(full["s"], 2),
                   construct_peak_gb_meta=round(meta["peak_gb"], 2),
                   construct_peak_gb_full=round(full["peak_gb"], 2))


def presets(tmp: Path, spec: str, figures: dict) -> None:
    print("\npresets, one rank of a simulated world (fake process group), llmtrain's way")
    print(f"{'preset':<12}{'ranks':>6}{'params':>9}{'whole fp32 GB':>15}{'shard GB':>10}"
          f"{'meta+shard s':>14}{'materialize s':>15}{'peak RSS GB':>13}")
    for item in spec.split(","):
        preset, world = item.split(":")
        out = tmp / f"preset-{preset}.json"
        run([sys.executable, __file__, "--worker", "preset", str(out), preset, world])
        r = json.loads(out.read_text())
        print(f"{preset:<12}{world:>6}{r['params'] / 1e9:>8.1f}B{r['full_gb']:>15.1f}"
              f"{r['shard_gb']:>10.2f}{r['meta_shard_s']:>14.2f}{r['materialize_s']:>15.2f}"
              f"{r['peak_gb']:>13.2f}")
        key = f"{preset}_w{world}"
        figures[f"{key}_peak_gb"] = round(r["peak_gb"], 2)
        figures[f"{key}_peak_over_whole_fp32"] = round(r["peak_gb"] / r["full_gb"], 4)
        figures[f"{key}_construct_s"] = round(r["meta_shard_s"] + r["materialize_s"], 2)


if __name__ == "__main__":
    with reaping():
        main()
