"""llmtrain's training step vs a bare hand-written PyTorch loop, same model, same batch.

Both loops run in this process on the same process group, alternating in segments so
that drift in machine speed hits both alike. The bare loop is what a person would write:
the same FSDP2-sharded model, AdamW, cross-entropy, gradient clipping, one fixed batch.
llmtrain's loop adds its data pipeline, LR schedule, gradient accumulation, the periodic
loss all-reduce, console, event log and the integrity checks (each step judged on the
device, the state fingerprinted every 10 steps here). The same trainer with integrity off
is the baseline for what those checks cost (the goal: <= 1.01), measured two ways: the
median ratio of back-to-back segments, and the checks' own time, timed where they run. The
same trainer taking in-memory snapshots (the warm path's; on two ranks each replicates to
the other, as to a buddy on another node) shows what snapshots cost (the goal: <= 1.03),
at the interval ``warm.snapshot_budget`` sets (``--warm.snapshot_budget 0`` for every
``warm.snapshot_every`` steps whatever they cost). A second baseline without FSDP2 shows
what sharding itself costs on one rank.

    python benchmarks/step_overhead.py                       # one rank
    torchrun --nproc-per-node 2 benchmarks/step_overhead.py  # two ranks
    ... [--segments 6] [--steps 20] [--section.field VALUE ...]

Prints a table, then one JSON line: {"llmtrain_over_bare": ..., "integrity_overhead": ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.checkpoint.snapshots import Schedule, Snapshots, shares_cores
from llmtrain.config import load_config, parse_overrides
from llmtrain.distributed.parallelize import parallelize
from llmtrain.model import Transformer
from llmtrain.trainer import Trainer


def bare_loop(model: torch.nn.Module, cfg, device: torch.device):
    """A closure running ``n`` plain steps on one fixed batch; returns seconds per step."""
    o, t = cfg.optim, cfg.training
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                            weight_decay=o.weight_decay)
    accum = cfg.accumulation_steps(dist.get_world_size())
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, cfg.data.seq_len + 1),
                           device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            for _ in range(accum):
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
                (loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss.item()
        return (time.perf_counter() - start) / n
    return run


class Timed:
    """Wraps a method of an object, adding up the seconds spent in it and its calls."""

    def __init__(self, obj, name: str):
        self.seconds, self.calls, inner = 0.0, 0, getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        setattr(obj, name, timed)


def llmtrain_loop(trainer: Trainer, integrity: bool, snapshots: Snapshots | None = None):
    def run(n: int) -> float:
        trainer.cfg.integrity.enable = integrity
        trainer.snapshots = snapshots
        trainer.cfg.training.steps = trainer.step + n
        start = time.perf_counter()
        trainer.run()
        return (time.perf_counter() - start) / n
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug_cpu")
    parser.add_argument("--segments", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="steps per segment")
    args, rest = parser.parse_known_args()
    cfg = load_config(args.config, parse_overrides(
        ["--training.run_dir", "runs/bench_step_overhead", "--metrics.progress", "plain",
         "--training.steps", str(10**6), "--metrics.log_every", "10", "--checkpoint.enable", "false",
         "--integrity.sdc_every", "10", *rest]))
    trainer = Trainer(cfg)
    torch.manual_seed(0)
    sharded = parallelize(Transformer(cfg.model), trainer.mesh, cfg.parallelism)
    plain = Transformer(cfg.model).to(trainer.device)
    world, rank = trainer.world.world_size, trainer.world.rank
    other = (rank + 1) % world if world > 1 else None
    w = cfg.warm
    snapshots = Snapshots(Schedule(w.snapshot_every, w.snapshot_budget, w.snapshot_max_every),
                          rank, buddy=other, ward=other, events=trainer.events,
                          shares_cores=shares_cores(trainer.device, world))
    snapshots.start(dist.new_group(backend="gloo"), trainer.control_group(), trainer.step)
    loops = {"llmtrain": llmtrain_loop(trainer, integrity=True),
             "no integrity": llmtrain_loop(trainer, integrity=False),
             "snapshots": llmtrain_loop(trainer, integrity=True, snapshots=snapshots),
             "bare (FSDP2)": bare_loop(sharded, cfg, trainer.device),
             "bare (no FSDP)": bare_loop(plain, cfg, trainer.device)}
    if dist.get_world_size() > 1:
        del loops["bare (no FSDP)"]  # unsharded replicas would need DDP, another baseline
    for run in loops.values():
        run(3)  # warm-up: allocator, first-call paths
    # What the checks take, timed where they run (the loop ratio is blurred by noise).
    checks = [Timed(trainer.integrity, name) for name in ("judge", "read", "check_state")]
    taking, skipped = Timed(snapshots, "take"), snapshots.skipped
    judged = trainer.integrity.judged
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.segments):
        for name, run in loops.items():
            times[name].append(run(args.steps))
    judged = trainer.integrity.judged - judged
    skipped = snapshots.skipped - skipped
    taken = taking.calls - skipped
    every = args.segments * args.steps / taking.calls  # steps per snapshot
    snapshot_bytes = snapshots.bytes_held()
    params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                 for p in trainer.model.parameters())
    snapshots.stop(30)
    trainer.close()
    if trainer.world.rank != 0:
        return

    median = {name: statistics.median(ts) for name, ts in times.items()}
    base = median["bare (FSDP2)"]
    print(f"\nstep time, median of {args.segments} segments x {args.steps} steps, "
          f"{trainer.world.world_size} rank(s), {cfg.model.name} model")
    print(f"{'loop':<16}{'ms/step':>10}{'min':>10}{'max':>10}{'vs bare':>10}")
    for name, ts in times.items():
        print(f"{name:<16}{median[name] * 1e3:>10.1f}{min(ts) * 1e3:>10.1f}"
              f"{max(ts) * 1e3:>10.1f}{median[name] / base:>10.3f}")
    # Segments run back to back, so each pair's ratio cancels the machine's drift.
    paired = statistics.median(a / b for a, b in zip(times["llmtrain"], times["no integrity"]))
    checks_ms = sum(c.seconds for c in checks) / judged * 1e3
    print(f"integrity checks: {checks_ms:.3f} ms/step timed in place "
          f"({checks_ms / (median['no integrity'] * 1e3):.2%} of a step); loop with / "
          f"without them, median of paired segments: {paired:.3f}")
    snap_paired = statistics.median(a / b for a, b in zip(times["snapshots"], times["llmtrain"]))
    print(f"snapshots: one every {every:.1f} steps (the last interval agreed: "
          f"{snapshots.schedule.interval}; each one's cost, median of the last 5: "
          f"{snapshots.schedule.costs.median() * 1e3:.1f} ms); "
          f"{taking.seconds / taken * 1e3:.3f} ms per copy on the training thread, "
          f"{skipped} of {taken + skipped} skipped (the previous one "
          f"still being sent); {snapshot_bytes / params:.1f} bytes per parameter held "
          f"(own and buddy's, two each); loop with / without them: {snap_paired:.3f}")
    figures = {"llmtrain_over_bare": round(median["llmtrain"] / base, 4),
               "snapshot_overhead": round(snap_paired, 4),
               "snapshot_copy_ms": round(taking.seconds / taken * 1e3, 3),
               "snapshots_skipped": skipped,
               "snapshot_bytes_per_param": round(snapshot_bytes / params, 1),
               "steps_per_snapshot": round(every, 2),
               "snapshot_cost_ms": round(snapshots.schedule.costs.median() * 1e3, 2),
               "snapshot_budget": w.snapshot_budget,
               "llmtrain_ms": round(median["llmtrain"] * 1e3, 2),
               "bare_ms": round(base * 1e3, 2),
               "integrity_overhead": round(paired, 4),
               "integrity_checks_ms": round(checks_ms, 3),
               "integrity_checks_fraction": round(checks_ms / (median["no integrity"] * 1e3), 5),
               "world_size": trainer.world.world_size}
    if "bare (no FSDP)" in median:
        figures["fsdp_over_plain"] = round(base / median["bare (no FSDP)"], 4)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
