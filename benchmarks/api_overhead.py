"""What llmtrain's public API costs a loop that uses it: the step time of
examples/hf_causal_lm.py's loop with the API on (``run.step()``, ``run.optimizer_step``:
the watchdog's beats, the integrity verdict, the ranks' vote, snapshots and the async
checkpoints at the defaults) over the same loop without it (``clip_grad_norm_``, then
``optimizer.step()``), in the same processes, on the same model, mesh and data.

The API loop clips as the example does, with ``run.optimizer_step(loss, max_norm=1.0)``:
the global norm rides in the verdict's own all-reduce and the clip runs on the local
shards. A third loop, ``api_own_clip``, keeps the plain loop's ``clip_grad_norm_`` and
passes its norm (``run.optimizer_step(loss, norm)``): what the API costs a loop that
clips on its own (the verdict's all-reduce on top of the clip's).

Two one-rank nodes under ``llmtrain launch`` with a rendezvous store of their own, so the
warm path is on (snapshots replicated to the other node) as in a real job.
The loops alternate in blocks of ``--block`` steps (the API's on the session's model, the
plain one on its own, both built by the example's ``build``), so drift in the machine's
speed falls on all alike; an API block ends once the work it left behind (a checkpoint's
write, a snapshot's replication) is done, so that its cost is the API's. The figures are
the ratios of the median step times.

Goal: API / plain <= 1.03.

    python benchmarks/api_overhead.py [--blocks 8] [--block 40] [--warm.enable false ...]

(settings overrides after the options: what each component costs, by switching it off).

Prints a table, then one JSON line of the figures (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from reaper import reaping

ROOT = Path(__file__).resolve().parent.parent
GOAL = 1.03


def launch(blocks: int, block: int, overrides: list[str]) -> int:
    """Runs this file as the job's workers: two one-rank "nodes" (``LocalCluster``: an
    ``llmtrain launch`` each and a rendezvous store of their own), so that the warm path
    is on and its snapshots are part of the API's cost. Prints rank 0's figures."""
    from llmtrain.chaos.local_cluster import LocalCluster
    with tempfile.TemporaryDirectory(prefix="llmtrain-api-overhead-") as d:
        work = Path(d)
        cluster = LocalCluster(work, work / "run", "2:2", (
            "--script", __file__, "--training.steps", str(2 * (blocks + 1) * block + 1),
            "--metrics.port", "0", "--metrics.log_every", "1000000", *overrides),
            env={"API_OVERHEAD_BLOCKS": f"{blocks},{block}"})
        try:
            cluster.start("node1")
            cluster.start("node2")
            codes = [cluster.wait(name, timeout=900) for name in ("node1", "node2")]
        finally:
            cluster.close()
        logs = [(work / f"{name}.log").read_text() for name in ("node1", "node2")]
    said = [line for log in logs for line in log.splitlines()
            if line.startswith(("loop ", "api ", "api_own_clip ", "plain ", "(ms",
                                '{"api_step_ms"'))]
    print("\n".join(said) if said else logs[0][-3000:])
    return max(codes) or (0 if said else 1)


def drain(run) -> None:
    """Waits, inside an API block's time, for the work the session left running behind it
    (a checkpoint's write, a snapshot's replication to the other node): on these two
    cores it would otherwise slow the next block, the plain loop's, and count there."""
    run.checkpoints.wait()
    snapshots = getattr(run.recovery, "snapshots", None)  # the warm path's, when on
    if snapshots is not None:
        snapshots.wait_idle()


def api_step(run, own_clip: bool) -> None:
    """The example's step through the session: clipped by llmtrain (``max_norm``), or by
    the loop's own ``clip_grad_norm_`` with its norm passed on."""
    import torch
    with run.step():
        model, optimizer = run.parts.model, run.parts.optimizer
        tokens = run.parts.state["data"].next().to(run.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if own_clip:
            run.optimizer_step(loss, torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        else:
            run.optimizer_step(loss, max_norm=1.0)
        run.parts.state["schedule"].step()
        optimizer.zero_grad()
    loss.item()


def plain_step(parts, loader, device, run) -> None:
    """The example's step without llmtrain, but for a heartbeat (a few microseconds): a
    rank silent for a block looks hung to the session's watchdog, whose diagnosis (the
    flight recorder dumped, with the GIL) would slow the plain loop, not the API's."""
    run.beat("plain")
    model, optimizer = parts.model, parts.optimizer
    tokens = loader.next().to(device)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    import torch
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    parts.state["schedule"].step()
    optimizer.zero_grad()
    loss.item()  # as the API's loop, which reads nothing: both wait for the step's end


def worker() -> None:
    import llmtrain
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_causal_lm as example

    blocks, block = map(int, os.environ["API_OVERHEAD_BLOCKS"].split(","))
    settings = llmtrain.Settings.from_args(sys.argv[1:])
    with llmtrain.start(settings, example.build) as run:
        w = run.world
        plain = example.build(llmtrain.World(w.rank, w.world_size, w.local_rank, w.host,
                                             run.device, run.mesh, first=False,
                                             timed=run.timed))
        loops = {"api": lambda: api_step(run, own_clip=False),
                 "api_own_clip": lambda: api_step(run, own_clip=True),
                 "plain": lambda: plain_step(plain, plain.state["data"], run.device, run)}
        times = {name: [] for name in loops}
        for b in range(blocks + 1):  # the first block of each warms up, untimed
            for name, loop in loops.items():
                started = time.perf_counter()
                for _ in range(block):
                    loop()
                if name != "plain":
                    drain(run)
                if b:
                    times[name].append((time.perf_counter() - started) / block)
        while run.running:  # the last step: the run ends complete, saved
            with run.step():
                pass
    if w.rank != 0:
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'loop':<13}" + "".join(f"{f'block {i + 1}':>10}" for i in range(blocks))
          + f"{'median':>10}")
    for k, v in times.items():
        print(f"{k:<13}" + "".join(f"{x * 1e3:>10.2f}" for x in v) + f"{med[k] * 1e3:>10.2f}")
    print("(ms per step)")
    print(json.dumps({"api_step_ms": round(med["api"] * 1e3, 3),
                      "api_own_clip_step_ms": round(med["api_own_clip"] * 1e3, 3),
                      "plain_step_ms": round(med["plain"] * 1e3, 3),
                      "api_over_plain": round(med["api"] / med["plain"], 4),
                      "api_own_clip_over_plain": round(med["api_own_clip"] / med["plain"], 4),
                      "goal_api_over_plain": GOAL, "ranks": w.world_size,
                      "steps_per_block": block, "blocks": blocks}))


if __name__ == "__main__":
    if "API_OVERHEAD_BLOCKS" in os.environ:
        worker()
    else:
        ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        ap.add_argument("--blocks", type=int, default=8)
        ap.add_argument("--block", type=int, default=40)
        args, overrides = ap.parse_known_args()
        with reaping():
            code = launch(args.blocks, args.block, overrides)
        sys.exit(code)
