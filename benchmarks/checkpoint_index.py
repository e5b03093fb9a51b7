"""What each rank of a restart reads to find its own checkpoint items, at 1K-16K ranks of
the 405B config, simulated: no tensors, only the planner's inputs and the index files.

For each world size: every rank's save-plan keys (its chunk of every parameter and of
both AdamW moments, FSDP2 sharding dim 0; its RNG item; the replicated items), the
indexes written by llmtrain's own commit code (``write_index`` for INDEX2.bin,
``items_json`` for ITEMS.json), then, for the first, middle and last rank, what a restart
at the saved world size reads and parses to find that rank's items:

- **index**: its table entry and its sections of INDEX2.bin (``ShardReader.own_section``:
  tensor chunks in columns, as a load matches them);
- **all items** (the baseline, measured in the same run): ITEMS.json, every rank's items,
  as a rank read it before the index (DCP's ``.metadata`` lists the same).

Both are timed in a fresh process, as a restarting rank is one (not in the one that held
every rank's plan to write the files).

Layouts: ``hsdp``, 256-way sharding and world/256 replicas (405B's fp32 weights and AdamW
state over 256 GPUs, about 25 GB each), at 1K-16K ranks; ``fsdp``, plain FSDP over every
rank, where ITEMS.json grows with world x items (1.4 GB at 4K ranks), at 1K-2K by
default. Files are on the local disk with a warm page cache: the times are parsing, not
I/O. Beside: the coordinator's costs, making the index layout from all plans (O(world x
items), as DCP's planning is; once while the plans stay the same) and writing INDEX2.bin
(every save; O(distinct items), as ITEMS.json).

    python benchmarks/checkpoint_index.py [--worlds 1024,...] [--fsdp-worlds 1024,2048]

Prints a table, then one JSON line: per-rank bytes and seconds of each way, and the growth
exponent of each over the world sizes (the log-log slope; 0 is flat, 1 linear).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from llmtrain.checkpoint import index  # noqa: E402
from llmtrain.checkpoint.index import RAW, StoredItem  # noqa: E402
from llmtrain.checkpoint.shard_read import ShardReader  # noqa: E402
from llmtrain.config import load_config  # noqa: E402
from llmtrain.model import Transformer  # noqa: E402
from reaper import reaping  # noqa: E402

REPLICATED = ["trainer", *(f"optim.param_groups.{g}.{k}" for g in range(2) for k in (
    "lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
    "differentiable", "fused", "decoupled_weight_decay", "initial_lr"))]


def tensors_405b() -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint FQN, global shape) of every tensor a rank saves: parameters and both
    AdamW moments."""
    with torch.device("meta"):
        model = Transformer(load_config("llama3_405b").model)
    return [(fqn, tuple(p.shape)) for name, p in model.named_parameters()
            for fqn in (f"model.{name}", f"optim.state.{name}.exp_avg",
                        f"optim.state.{name}.exp_avg_sq")]


def plans(tensors, world: int, shard: int):
    """(stored items, each rank's keys): rank r holds shard position r % ``shard`` of
    every tensor (FSDP2's dim-0 chunk), its own RNG item and the replicated ones; the
    keys of one shard position are the same objects for every replica, as a coordinator
    holding all plans would have them."""
    items: dict = {}
    by_position = []
    fake_sum = "xxh3_128=" + "0" * 32
    for s in range(shard):
        keys = []
        for fqn, shape in tensors:
            chunk = math.ceil(shape[0] / shard)
            start = min(s * chunk, shape[0])
            sizes = (min(chunk, shape[0] - start), *shape[1:])
            key = (fqn, (start, *(0,) * (len(shape) - 1)))
            items[key] = StoredItem(f"__{s}_0.distcp", 0, 4 * math.prod(sizes),
                                    [RAW, fake_sum], sizes, torch.float32)
            keys.append(key)
        by_position.append(keys)
    shared = [(name, None) for name in REPLICATED]
    for i, key in enumerate(shared):
        items[key] = StoredItem(f"__{i % world}_0.distcp", 0, 1261, [], None, None)
    needs = []
    for r in range(world):
        own = (f"rng.{r}", None)
        items[own] = StoredItem(f"__{r}_0.distcp", 0, 5000, [], None, None)
        needs.append([*by_position[r % shard], own, *shared])
    return items, needs


# A restarting rank: a fresh process that reads its own items (its sections of INDEX2.bin)
# or, the way before, every rank's (ITEMS.json); timed inside it, from the reader's making.
READER = """
import json, statistics, sys, time
from llmtrain.checkpoint.shard_read import ShardReader
root, world, ranks, reps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
def timed(make):
    started = time.perf_counter()
    make()
    return time.perf_counter() - started
own = [timed(lambda: ShardReader(root, rank=r, world=world).own_section())
       for _ in range(reps) for r in ranks]
every = timed(lambda: ShardReader(root).stored_items())
print(json.dumps({"own_s": statistics.median(own), "all_s": every}))
"""


def section_bytes(root: Path, rank: int, world: int) -> int:
    """What a rank reads of INDEX2.bin: its table entry, the footer and its sections."""
    path = root / index.INDEX
    with open(path, "rb") as f:
        f.seek(index.entry_offset(path.stat().st_size, rank, world))
        entry = index.ENTRY.unpack(f.read(index.ENTRY.size))
    return index.ENTRY.size + index.FOOT.size + entry[1] + entry[4]


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y over log x."""
    if len(xs) < 2:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def measure(tensors, layout: str, world: int, shard: int, reps: int, work: Path) -> dict:
    root = work / f"{layout}-{world}"
    root.mkdir()
    items, needs = plans(tensors, world, shard)
    started = time.perf_counter()
    layout_ = index.index_layout(needs)  # a save's planner makes it once per layout
    layout_s = time.perf_counter() - started
    started = time.perf_counter()
    with open(root / index.INDEX, "wb") as f:
        index.write_index(f, items, layout_)
    write_s = time.perf_counter() - started
    (root / index.ITEMS).write_bytes(index.items_json(items))
    ranks = sorted({0, world // 2, world - 1})
    for rank in ranks:  # what each finds is its own state's items, no more
        got = ShardReader(str(root), rank=rank, world=world).own_items()
        assert got == {key: items[key] for key in needs[rank]}, (layout, world, rank)
    del items, needs, layout_, got
    out = subprocess.run([sys.executable, "-c", READER, str(root), str(world), json.dumps(ranks),
                          str(reps)], capture_output=True, text=True, check=True, cwd=ROOT)
    timed = json.loads(out.stdout)
    row = {"layout": layout, "world": world,
           "index_bytes": max(section_bytes(root, rank, world) for rank in ranks),
           "index_s": timed["own_s"], "all_bytes": (root / index.ITEMS).stat().st_size,
           "all_s": timed["all_s"], "index_file_bytes": (root / index.INDEX).stat().st_size,
           "layout_s": layout_s, "index_write_s": write_s}
    for name in (index.INDEX, index.ITEMS):
        (root / name).unlink()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="1024,2048,4096,8192,16384", help="hsdp world sizes")
    ap.add_argument("--fsdp-worlds", default="1024,2048",
                    help="plain-FSDP world sizes (ITEMS.json is 0.35 GB per 1K ranks)")
    ap.add_argument("--shard", type=int, default=256, help="hsdp's sharding degree")
    ap.add_argument("--reps", type=int, default=5, help="reads of each rank's sections")
    a = ap.parse_args()
    tensors = tensors_405b()
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmtrain-index-") as tmp:
        for layout, worlds in (("hsdp", a.worlds), ("fsdp", a.fsdp_worlds)):
            for world in (int(w) for w in worlds.split(",") if w):
                row = measure(tensors, layout, world, a.shard if layout == "hsdp" else world,
                              a.reps, Path(tmp))
                rows.append(row)
                print(f"  {layout} {world}: {row['index_bytes']:,} bytes in "
                      f"{row['index_s'] * 1e3:.1f} ms (all items: {row['all_bytes']:,} bytes "
                      f"in {row['all_s'] * 1e3:.0f} ms)", flush=True)
    print(f"\n405B, {len(tensors)} tensors a rank (parameters and AdamW moments); per rank "
          f"of a restart at the saved world size: the most bytes and the median time of ranks 0, "
          f"world/2 and world-1")
    print(f"{'layout':6} {'world':>6} {'index bytes':>12} {'index ms':>9} {'all bytes':>14} "
          f"{'all ms':>9} {'all/index':>9} {'INDEX2.bin':>14} {'layout s':>8} {'write s':>8}")
    for r in rows:
        print(f"{r['layout']:6} {r['world']:>6} {r['index_bytes']:>12,} {r['index_s'] * 1e3:>9.2f}"
              f" {r['all_bytes']:>14,} {r['all_s'] * 1e3:>9.1f} {r['all_s'] / r['index_s']:>9.0f}"
              f" {r['index_file_bytes']:>14,} {r['layout_s']:>8.2f} {r['index_write_s']:>8.2f}")
    fig: dict = {"tensors_per_rank": len(tensors), "rows": rows}
    for layout in ("hsdp", "fsdp"):
        mine = [r for r in rows if r["layout"] == layout]
        worlds = [r["world"] for r in mine]
        for key in ("index_bytes", "index_s", "all_bytes", "all_s"):
            fig[f"{layout}_{key}_growth"] = (None if len(mine) < 2 else
                                             round(slope(worlds, [r[key] for r in mine]), 3))
    print("growth exponents (log-log slope over world; 0 flat, 1 linear): " + ", ".join(
        f"{k.removesuffix('_growth')} {v}" for k, v in fig.items() if k.endswith("_growth")))
    print(json.dumps(fig))


if __name__ == "__main__":
    with reaping():
        main()
