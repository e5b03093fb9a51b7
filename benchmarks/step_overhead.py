"""llmtrain's training step vs the best plain FSDP2 loop, same model, config and data.

All loops run in this process on the same process group, in segments, every loop once a
round, in an order shuffled afresh each round (the same on every rank), so that drift in
machine speed and whatever a loop leaves running (a read-ahead, a snapshot still being
sent) hit every loop alike. The bare loop is what a careful person would write with
PyTorch alone, doing what llmtrain's step does and no more: the same FSDP2-sharded model
(``parallelize``, the same weights), the same data read ``data.prefetch`` steps ahead by
a background thread (pinned where a GPU takes it), the same micro-batches per step,
cross-entropy, gradient clipping when ``optim.max_grad_norm`` is set (the norm summed over
the local shards, one all-reduce), fused AdamW (no weight decay on norms), the same LR
schedule, the loss read only at log steps (``metrics.log_every``), no other host sync,
denormals flushed on CPU. llmtrain's loop adds its sampler, the watchdog's heartbeats,
console, event log, goodput ledger, each ``run()``'s start and end, and the integrity
checks (each step judged on the device, the state fingerprinted every 10 steps here).

The baselines run bare: before each of their segments llmtrain's threads end (the
watchdog, the health monitor, rank 0's stop-request look-out, the metrics exporter; a
snapshot still being sent is waited for), and they start again after it, outside the
timed steps; the JSON's ``bare_threads`` names the threads alive during a baseline
segment (llmtrain's data reader stays, idle on its full queue). The watchdog is first
told that no heartbeats will come (a long phase, ended by the trainer's next step), so
that its first tick after the segment does not take the silence for a hang, and its
peers' silence counts from its restart. (With the watchdog running through an
undeclared baseline segment, it found the rank quiet and dumped the collective flight
recorder four times a second, ~40 ms of CPU each, with the GIL, which made the baseline,
not llmtrain, pay for it: llmtrain_over_bare 0.66-0.96 on 2 CPU ranks.) The naive loop (one fixed batch, the default AdamW, which on CPU loops over the
parameters with every op dispatched through DTensor, clip_grad_norm_ on the DTensors, a
constant LR; the first baseline of this benchmark) is kept for comparison.

The same trainer with integrity off is the baseline for what those checks cost (the goal:
<= 1.01), measured two ways: the median ratio of the same round's segments, and the
checks' own time, timed where they run. The same trainer taking in-memory snapshots (the
warm path's; on two ranks each replicates to the other, as to a buddy on another node)
shows what snapshots cost (the goal: <= 1.03), at the interval ``warm.snapshot_budget``
sets (``--warm.snapshot_budget 0`` for every ``warm.snapshot_every`` steps whatever they
cost). A second baseline without FSDP2 shows what sharding itself costs on one rank.

    python benchmarks/step_overhead.py                       # one rank
    torchrun --nproc-per-node 2 benchmarks/step_overhead.py  # two ranks
    ... [--segments 10] [--steps 20] [--section.field VALUE ...]

Prints a table, then one JSON line: {"llmtrain_over_bare": ..., "integrity_overhead": ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from llmtrain.checkpoint.snapshots import Schedule, Snapshots, shares_cores
from llmtrain.config import load_config, parse_overrides
from llmtrain.data import TokenDataset, shard_urls
from llmtrain.distributed.parallelize import parallelize
from llmtrain.metrics.prometheus import Exporter
from llmtrain.model import Transformer
from llmtrain.recovery.interface import NoWarmRecovery
from llmtrain.recovery.registry_snapshots import take_snapshot
from llmtrain.reliability.health.monitor import start_monitor
from llmtrain.stop_request import StopRequestWatch
from llmtrain.trainer import Trainer
from reaper import reaping


class ReadAhead:
    """This rank's micro-batches, step by step, read ``ahead`` steps in advance by one
    background thread (as llmtrain's BatchIterator does), in a seeded shuffled order."""

    def __init__(self, dataset: TokenDataset, cfg, rank: int, world: int, pin: bool):
        t = cfg.training
        self.dataset, self.pin, self.ahead = dataset, pin, cfg.data.prefetch
        self.micro, self.global_batch = t.micro_batch_size, t.global_batch_size
        self.local = t.global_batch_size // world
        self.offset = rank * self.local
        self.rng = np.random.default_rng(cfg.data.seed)
        self.order = np.empty(0, dtype=np.int64)  # the sample order from the next step on
        self.pending: deque[Future] = deque()
        self.reader = ThreadPoolExecutor(1, "bare-data") if self.ahead else None

    def _next_indices(self) -> list[int]:
        while len(self.order) < self.global_batch:
            self.order = np.concatenate([self.order, self.rng.permutation(len(self.dataset))])
        indices = self.order[self.offset:self.offset + self.local].tolist()
        self.order = self.order[self.global_batch:]
        return indices

    def _read(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        samples = torch.stack([self.dataset[i] for i in indices])
        pairs = [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
                 for mb in samples.split(self.micro)]
        if self.pin:
            pairs = [(inputs.pin_memory(), targets.pin_memory()) for inputs, targets in pairs]
        return pairs

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.reader is None:
            return self._read(self._next_indices())
        while len(self.pending) < self.ahead + 1:
            self.pending.append(self.reader.submit(self._read, self._next_indices()))
        return self.pending.popleft().result()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.shutdown(wait=True, cancel_futures=True)


def clip_grads(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clips the gradients to a global norm of ``max_norm``, with no host sync: the norm
    from the local shards (one all-reduce of the squared sum per sharded mesh dim), the
    scaling on them too, where DTensor would dispatch each of these ops per parameter."""
    grads = [p.grad for p in params if p.grad is not None]
    first = grads[0]
    if isinstance(first, DTensor):
        mesh, placements = first.device_mesh, first.placements
        if not all(isinstance(g, DTensor) and g.device_mesh == mesh
                   and g.placements == placements for g in grads) \
                or any(p.is_partial() for p in placements):
            norm = torch.nn.utils.get_total_norm(grads).full_tensor()  # the general way
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            return norm
        grads = [g.to_local() for g in grads]
        square = torch.stack(torch._foreach_norm(grads)).float().square().sum()
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(square, group=mesh.get_group(dim))
        norm = square.sqrt()
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def lr_factor(warmup: int, total: int, min_ratio: float):
    """Linear warmup, then cosine decay to ``min_ratio`` of the peak (llmtrain's schedule)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def bare_loop(cfg, device: torch.device, mesh, data: ReadAhead, sharded: bool = True):
    """A closure running ``n`` steps of the best plain loop; returns seconds per step.
    The model is built as llmtrain builds it (on meta, sharded, then drawn from the seed):
    the same weights."""
    o, t = cfg.optim, cfg.training
    torch.manual_seed(t.seed)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if sharded:
        model = parallelize(model, mesh, cfg.parallelism)
    model.to_empty(device=device)
    model.init_weights(t.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(
        o.warmup_steps, o.decay_steps or t.steps, o.min_lr_ratio))
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # as llmtrain does (the trainer has set it already)
    log_every, world = cfg.metrics.log_every, dist.get_world_size()
    done = 0
    losses: list[float] = []

    def run(n: int) -> float:
        nonlocal done
        start = time.perf_counter()
        for _ in range(n):
            micro_batches = data.next_step()
            loss_sum = torch.zeros((), device=device)
            for inputs, targets in micro_batches:
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
                (loss / len(micro_batches)).backward()
                loss_sum += loss.detach()
            if o.max_grad_norm:
                clip_grads(params, o.max_grad_norm)
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            if done % log_every == 0:  # the only host sync: the mean loss over the ranks
                loss = loss_sum / len(micro_batches)
                if world > 1:
                    dist.all_reduce(loss)
                losses.append(loss.item() / world)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / n
    run.losses = losses
    return run


def naive_loop(cfg, device: torch.device, mesh):
    """The benchmark's first baseline: one fixed batch, the default AdamW (on CPU a loop
    over the parameters, each op dispatched through DTensor), clip_grad_norm_ on the
    DTensors, a constant LR."""
    o, t = cfg.optim, cfg.training
    torch.manual_seed(0)
    model = parallelize(Transformer(cfg.model), mesh, cfg.parallelism)
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


class SnapshotsOnly(NoWarmRecovery):
    """The warm path's snapshots (the same ``take_snapshot`` of the state registry, the
    same replication) without its agreement, which needs a store outside the workers."""

    def __init__(self, snapshots: Snapshots, trainer: Trainer):
        super().__init__("")
        self.snapshots, self.trainer = snapshots, trainer

    def maybe_snapshot(self, step: int) -> None:
        if self.snapshots.due(step):
            take_snapshot(self.snapshots, step, self.trainer.session.registry)


def llmtrain_loop(trainer: Trainer, integrity: bool, snapshots: Snapshots | None = None):
    recovery = trainer.session.recovery if snapshots is None else SnapshotsOnly(snapshots, trainer)

    def run(n: int) -> float:
        trainer.cfg.integrity.enable = integrity
        trainer.session.recovery = recovery
        trainer.session.settings.steps = trainer.step + n
        start = time.perf_counter()
        trainer.run()
        return (time.perf_counter() - start) / n
    return run


def baseline(trainer: Trainer, snapshots: Snapshots, run, seen: set[str]):
    """``run`` with llmtrain's threads stopped for the segment (see the module's
    docstring); the names of the threads alive during it are added to ``seen``."""
    s = trainer.session

    def bare(n: int) -> float:
        snapshots.wait_idle()
        s.watchdog.beat(trainer.step, "baseline", long=True)
        s.watchdog.close()
        s.health.close()
        if s.control.requests is not None:
            s.control.requests.close()
        exporter = s.reporter.exporter
        if isinstance(exporter, Exporter):
            exporter.close()
        try:
            seen.update(t.name for t in threading.enumerate())
            dist.barrier()  # every rank's threads stopped: the segment starts together
            return run(n)
        finally:
            s.health = s.control.health = start_monitor(
                s.settings.health, s.device, host=s.world.host, local_rank=s.world.local_rank,
                events=s.events, on_pass=s.reporter.health_pass)
            if s.control.requests is not None:
                s.control.requests = StopRequestWatch(s.settings.run_dir).start()
            if isinstance(exporter, Exporter):
                exporter.start()
            s.watchdog.new_generation()
            s.watchdog.start()
            dist.barrier()  # and the next loop's segment too, whoever restarted faster
    return bare


def paired(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of ``a``'s time over ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug_cpu")
    parser.add_argument("--segments", type=int, default=10,
                        help="rounds; each runs every loop for one segment, in a shuffled order")
    parser.add_argument("--steps", type=int, default=20, help="steps per segment")
    args, rest = parser.parse_known_args()
    cfg = load_config(args.config, parse_overrides(
        ["--training.run_dir", "runs/bench_step_overhead", "--metrics.progress", "plain",
         "--training.steps", str(10**6), "--metrics.log_every", "10", "--checkpoint.enable", "false",
         "--integrity.sdc_every", "10", *rest]))
    trainer = Trainer(cfg)
    world, rank, device = trainer.session.world.world_size, trainer.session.world.rank, trainer.device
    dataset = TokenDataset(shard_urls(cfg.data, cfg.training.run_dir), cfg.data.seq_len)
    pin = device.type == "cuda"
    readers = [ReadAhead(dataset, cfg, rank, world, pin) for _ in range(2)]
    other = (rank + 1) % world if world > 1 else None
    w = cfg.warm
    snapshots = Snapshots(Schedule(w.snapshot_every, w.snapshot_budget, w.snapshot_max_every),
                          rank, buddy=other, ward=other, events=trainer.session.events,
                          shares_cores=shares_cores(device, world))
    snapshots.start(dist.new_group(backend="gloo"), trainer.session.control_group, trainer.step)
    bare_threads: set[str] = set()
    loops = {"llmtrain": llmtrain_loop(trainer, integrity=True),
             "no integrity": llmtrain_loop(trainer, integrity=False),
             "snapshots": llmtrain_loop(trainer, integrity=True, snapshots=snapshots),
             "bare (FSDP2)": baseline(trainer, snapshots, bare_loop(
                 cfg, device, trainer.session.mesh, readers[0]), bare_threads),
             "naive (FSDP2)": baseline(trainer, snapshots, naive_loop(
                 cfg, device, trainer.session.mesh), bare_threads)}
    if world == 1:  # unsharded replicas on 2+ ranks would need DDP, another baseline
        loops["bare (no FSDP)"] = baseline(trainer, snapshots, bare_loop(
            cfg, device, trainer.session.mesh, readers[1], sharded=False), bare_threads)
    for run in loops.values():
        run(3)  # warm-up: allocator, first-call paths
    # What the checks take, timed where they run (the loop ratio is blurred by noise).
    checks = [Timed(trainer.session.integrity, name) for name in ("judge", "read", "check_state")]
    taking, skipped = Timed(snapshots, "take"), snapshots.skipped
    judged = trainer.session.integrity.judged
    times: dict[str, list[float]] = {name: [] for name in loops}
    for k in range(args.segments):
        order = list(loops)
        random.Random(k).shuffle(order)  # the same order on every rank
        for name in order:
            times[name].append(loops[name](args.steps))
    judged = trainer.session.integrity.judged - judged
    skipped = snapshots.skipped - skipped
    taken = taking.calls - skipped
    every = args.segments * args.steps / taking.calls  # steps per snapshot
    snapshot_bytes = snapshots.bytes_held()
    params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                 for p in trainer.model.parameters())
    snapshots.stop(30)
    for reader in readers:
        reader.close()
    trainer.close()
    if rank != 0:
        return

    median = {name: statistics.median(ts) for name, ts in times.items()}
    base = median["bare (FSDP2)"]
    print(f"\nstep time, median of {args.segments} segments x {args.steps} steps (loops in "
          f"shuffled order), {world} rank(s), {cfg.model.name} model")
    print(f"{'loop':<16}{'ms/step':>10}{'min':>10}{'max':>10}{'vs bare':>10}{'paired':>10}")
    for name, ts in times.items():
        print(f"{name:<16}{median[name] * 1e3:>10.1f}{min(ts) * 1e3:>10.1f}"
              f"{max(ts) * 1e3:>10.1f}{median[name] / base:>10.3f}"
              f"{paired(times, name, 'bare (FSDP2)'):>10.3f}")
    print("vs bare: the ratio of the medians; paired: the median of each round's ratio")
    # Segments of a round run back to back, so each pair's ratio cancels the machine's drift.
    integrity_paired = paired(times, "llmtrain", "no integrity")
    checks_ms = sum(c.seconds for c in checks) / judged * 1e3
    print(f"integrity checks: {checks_ms:.3f} ms/step timed in place "
          f"({checks_ms / (median['no integrity'] * 1e3):.2%} of a step); loop with / "
          f"without them, median of paired segments: {integrity_paired:.3f}")
    snap_paired = paired(times, "snapshots", "llmtrain")
    print(f"snapshots: one every {every:.1f} steps (the last interval agreed: "
          f"{snapshots.schedule.interval}; each one's cost, median of the last 5: "
          f"{snapshots.schedule.costs.median() * 1e3:.1f} ms); "
          f"{taking.seconds / taken * 1e3:.3f} ms per copy on the training thread, "
          f"{skipped} of {taken + skipped} skipped (the previous one "
          f"still being sent); {snapshot_bytes / params:.1f} bytes per parameter held "
          f"(own and buddy's, two each); loop with / without them: {snap_paired:.3f}")
    figures = {"llmtrain_over_bare": round(median["llmtrain"] / base, 4),
               "llmtrain_over_bare_paired": round(paired(times, "llmtrain", "bare (FSDP2)"), 4),
               "no_integrity_over_bare": round(median["no integrity"] / base, 4),
               "naive_over_bare": round(median["naive (FSDP2)"] / base, 4),
               "snapshot_overhead": round(snap_paired, 4),
               "snapshot_copy_ms": round(taking.seconds / taken * 1e3, 3),
               "snapshots_skipped": skipped,
               "snapshot_bytes_per_param": round(snapshot_bytes / params, 1),
               "steps_per_snapshot": round(every, 2),
               "snapshot_cost_ms": round(snapshots.schedule.costs.median() * 1e3, 2),
               "snapshot_budget": w.snapshot_budget,
               "llmtrain_ms": round(median["llmtrain"] * 1e3, 2),
               "bare_ms": round(base * 1e3, 2),
               "naive_ms": round(median["naive (FSDP2)"] * 1e3, 2),
               "integrity_overhead": round(integrity_paired, 4),
               "integrity_checks_ms": round(checks_ms, 3),
               "integrity_checks_fraction": round(checks_ms / (median["no integrity"] * 1e3), 5),
               "bare_threads": sorted(bare_threads),
               "segments": args.segments, "steps_per_segment": args.steps,
               "world_size": world}
    if "bare (no FSDP)" in median:
        figures["fsdp_over_plain"] = round(base / median["bare (no FSDP)"], 4)
    print(json.dumps(figures))


if __name__ == "__main__":
    with reaping():
        main()
