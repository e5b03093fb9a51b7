"""Checkpointing cost against the machine's own limits, all on one training state.

One trainer (the debug_cpu preset, grown to ``--state-mb`` of model + AdamW state) takes a
few steps so AdamW's moments exist; then, without training in between, the same state is
saved and loaded repeatedly and compared with baselines measured in the same run, on the
same bytes, in the same directory (the run's checkpoint directory, so the raw file tests
hit the filesystem the checkpoints do). Repetitions of the things compared alternate,
so drift in machine speed hits both sides alike; each figure is a ratio of medians.

- ``blocking_over_sync``: wall time a save holds the training thread in ``async_thread``
  mode / wall time of ``CheckpointManager.save`` in ``sync`` mode (stage, plan, hash,
  write, fsync, commit). The first is the save call plus the wait of the next training
  step's update for the staging copy, which runs beside that step's forward and backward
  (it slows them where they share the CPU: ``step_time_with_saves_over_without`` says
  by how much), each save called right after a training step, as in training (after
  the raw write's bytes had gone through the caches, the call took 17-19.5 ms at 2 ranks
  here, against 4.4-14.5 ms after a save). Goal <= 0.03. At 2 ranks on 2 cores its
  samples spread widely (time slices, the other rank's Python; the JSON's
  ``blocking_range_s``): medians of 3 gave 0.024-0.044 for the same code, hence 7
  repetitions by default.
- ``staging_over_memcpy``: staging bandwidth (model + optimizer state bytes / time of the
  staging copy on its thread, nothing else running) / bandwidth of a plain copy of the
  same tensors into preallocated host buffers (pinned on GPU). Goal >= 0.8.
- ``write_over_raw``: background write bandwidth (checkpoint bytes / time from the staging
  copy's end until the save has committed) / raw write bandwidth: the same number of
  bytes written with Python in 64 MiB chunks, then fsync, into the same directory
  (each rank its share, at once), into a new file kept until the end, as each save's
  files are. Both are the best of ``--reps``, not the median: a virtual disk can take the
  same fsynced write at very different speeds by what its host is doing (this machine's
  took 286 MB from 2 ranks in 0.17-0.21 s or in 0.53-0.58 s, checkpoints and raw writes
  alike, in no order seen from inside), and the best of each compares the disk's fast
  mode with itself. Goal >= 0.9.
- ``load_over_raw``: load bandwidth (checkpoint bytes / time of ``TrainState.load``, which
  reads each shard into the live model and optimizer, planned by DCP where it reshards)
  / raw sequential read of the same files in 64 MiB chunks (each rank a share of them, at
  once), the faster of: into one reused buffer, or into preallocated memory of the files'
  size; both with a warm page cache (the files were just written and read), medians of
  ``--warm-reps`` (each takes tens of ms; at 3 the ratio ran from 0.61 to 0.71 for the
  same code in four runs, at 15 from 0.77 to 0.99 in two, at 45 from 0.85 to 0.89 in
  three). Goal >= 0.9.
  ``load_over_raw_cold`` is the same with each file's pages dropped first
  (posix_fadvise DONTNEED), where the OS honours it. Goal >= 0.9. At several ranks
  both are aggregate bandwidths (all ranks' bytes / the slowest rank's time). The table
  also shows a whole resume's read side, warm: ``CheckpointManager.resume`` (sizes and
  the index files checked by shares, then the load, which checks each item's sum as it
  reads it), and ``load_beyond_raw_ms``: the warm load's time beyond the raw read. Where
  the load reads in place, its reads are also timed alone, as its plan lays them out
  (``load_reads_over_raw``, no goal: the raw read / those reads), and the rest is the
  Python that maps each of ``tensors_per_rank`` live tensors to its stored bytes and
  decodes the small items (``load_python_ms``), a cost per tensor, not per byte. The
  same reads, alternating with it, also go into memory shaped like the live tensors:
  one block mapped for them now, as the raw read's memory is and as a GPU load's pinned
  scratch is (``reads_block_over_raw``), and tensors torch allocates now, as the live
  ones were (``reads_torch_over_raw``). At 2 ranks here the block took them at 0.96 of
  the raw read and torch's tensors at 0.885, as the live ones (0.875): the copy is
  slower into the memory the process's allocator hands out (heap pages reused from
  earlier allocations) than into pages freshly mapped, whatever the read's pattern.
- ``save_cpu_s`` (no goal): CPU time, user and system, of all the process's threads over
  one async save with nothing training beside it (median, the slowest rank's): what a
  save takes from a training that keeps every core busy, without the step-time figure's
  noise. Local block filesystems are written direct (``checkpoint.direct_io``), with no
  page-cache work; ``--checkpoint.direct_io off`` shows a save with it.
- ``step_time_with_saves_over_without``: training steps through the trainer's own
  ``save_or_stop(step)`` path with a save (async_thread) every ``--interval`` steps, each
  step timed: each of ``--saves`` saves costs the time of the steps it touched (from the
  one that called it to the first that began after it committed, and one more) beyond
  as many steps untouched by saves within ``--interval`` of it; the figure is 1 + that
  cost / (``--interval`` x the untouched step time), medians over the saves. Every
  save's copy and write overlap training and are paid in full, as in a long run, and
  each is measured against its own neighbours: segments of steps with saves against
  segments without, which this replaced, gave 1.03 to 1.18 at 2 ranks in three runs of
  the same code here and 0.98 and 1.13 at 1 rank, its segments' step times wandering
  from 1.84 to 2.91 s within one run. The same cost taken of a window as long half an
  interval later, where nothing was saved (``no_save_cost_ms``, the table's "no save"
  row), is what the method finds in this run without a save: the figure's noise.
  Goal <= 1.05. ``--saves 0`` leaves it out (the I/O figures take about a minute).
- ``bytes_per_param``: committed checkpoint bytes (manifest) / model parameters; AdamW
  with fp32 master weights needs 12 (weights + m + v), a little more with metadata.

    python benchmarks/checkpoint.py                       # one rank
    torchrun --nproc-per-node 2 benchmarks/checkpoint.py  # two ranks (rank 0 prints)
    ... [--state-mb 300] [--dir runs/bench_checkpoint] [--reps 7] [--warm-reps 45] [--interval 10]
        [--saves 6] [--through local|fuse|nfs]
        [--section.field VALUE ...]

``--dir`` must be a local path (raw bandwidth needs os.fsync); its checkpoints and event
log are removed at start (the tokenized data there is kept). With the defaults (300 MB,
about 24M parameters) it takes about 6 minutes on 2 CPU cores, most of it the 60-odd
training steps of the step-time figure. ``--through fuse`` or ``nfs`` puts the checkpoint
directory, and so the raw baselines' files, on a mount made for the run under ``--dir``:
a bindfs FUSE mount, or an NFS export of nfs-ganesha on loopback through
``llmtrain.chaos.nfsfuse`` (``llmtrain.chaos.nfs`` says what they need). Prints a table,
then one JSON line: {"blocking_over_sync": ..., ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from llmtrain.chaos.mount import BindfsMount, unmount, wait_mounted
from llmtrain.chaos.nfs import NfsMount
from llmtrain.checkpoint import storage
from llmtrain.checkpoint.in_place import read_in_place
from llmtrain.checkpoint.manager import CheckpointManager
from llmtrain.checkpoint.staging import host_block
from llmtrain.config import ModelConfig, load_config, parse_overrides
from llmtrain.distributed.process_group import global_mean
from llmtrain.events import read_events
from llmtrain.model import count_params
from llmtrain.trainer import Trainer
from reaper import reaping

CHUNK = 64 << 20
MB = 1e6
BENCH_STEP = 10_000_000  # step numbers of the measurement saves, apart from training's
DIR = "runs/bench_checkpoint"


# -- sizing -----------------------------------------------------------------------------

def model_overrides(state_mb: float) -> list[str]:
    """Model shape whose fp32 weights + AdamW moments (12 B/param) come closest to
    ``state_mb``: up to 8 layers, 64-wide heads, half as many KV heads."""
    target = state_mb * MB / 12
    best = None
    for layers in (8, 6, 4, 2, 1):
        for dim in range(128, 8193, 64):
            heads = dim // 64
            kv = heads // 2 if heads % 2 == 0 else heads
            m = ModelConfig(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                            vocab_size=256)
            err = abs(math.log(count_params(m) / target))
            if best is None or err < best[0] - 0.05:  # prefer more layers unless clearly worse
                best = (err, m)
    m = best[1]
    return ["--model.dim", str(m.dim), "--model.n_layers", str(m.n_layers),
            "--model.n_heads", str(m.n_heads), "--model.n_kv_heads", str(m.n_kv_heads),
            "--model.vocab_size", "256", "--model.name", "bench"]


# -- helpers ----------------------------------------------------------------------------

class Ranks:
    """Barrier and max/sum over ranks on a gloo group of the benchmark's own."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def reduce(self, value: float, op=dist.ReduceOp.MAX) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return t.item()

    def timed(self, fn) -> float:
        """Wall time of ``fn`` started together on every rank; the slowest rank's."""
        self.barrier()
        start = time.perf_counter()
        fn()
        return self.reduce(time.perf_counter() - start)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_tensors(trainer: Trainer) -> list[torch.Tensor]:
    """This rank's model + optimizer tensors, as DCP gets them (local shards)."""
    out = []

    def walk(x):
        if isinstance(x, DTensor):
            out.append(x.to_local())
        elif isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(get_state_dict(trainer.model, trainer.optimizer))
    return out


def memcpy(tensors: list[torch.Tensor], device: torch.device, dst: list | None) -> None:
    """Copies every tensor into host memory: into ``dst`` or into fresh buffers."""
    cuda = device.type == "cuda"
    for i, t in enumerate(tensors):
        out = dst[i] if dst is not None else torch.empty(
            t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
        out.copy_(t, non_blocking=cuda)
    sync_device(device)


def raw_write(path: str, nbytes: int, block: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[:min(left, CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(paths: list[str], buf: memoryview) -> int:
    """Reads ``paths`` in 64 MiB chunks into ``buf``: one chunk reused, or, when ``buf``
    holds all of them, each chunk where it belongs (as a load places every byte)."""
    total = 0
    reused = len(buf) == CHUNK
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf[0 if reused else total:][:CHUNK]):
                total += n
    return total


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def save_costs(steps: list[tuple[int, float, float]], committed: list[dict],
               interval: int) -> tuple[list[float], list[float], float]:
    """(training time each save took, the same for a window without a save, the median
    step time untouched by saves) of the saves among ``steps`` ((step, start, end): each
    step's training and save_or_stop). A save touches the steps from the one that called
    it to the first that began after it committed (the staging copy's wait, the
    background write beside training), and the step after that one; it costs their time
    beyond as many steps of the untouched ones within ``interval`` steps of it (see the
    module's docstring). Each save's control is the window of as many untouched steps
    half an interval later, costed the same way against its own neighbours: what the
    method finds where nothing was saved, the figure's noise in this run."""
    took = {step: end - start for step, start, end in steps}
    began = {step: start for step, start, _ in steps}
    done = {e["step"]: e["ts"] for e in committed}
    touched = {}
    for save in (step for step in took if step in done):
        after = save + 1
        while after in began and began[after] < done[save]:
            after += 1
        touched[save] = [t for t in range(save, after + 2) if t in took]
    untouched = set(took) - {t for window in touched.values() for t in window}

    def cost(window: list[int]) -> tuple[float, float]:
        near = [took[t] for t in untouched - set(window) if abs(t - window[0]) < interval]
        if not near:
            raise SystemExit(f"every step within {interval} of step {window[0]} was touched "
                             f"by a save: take a longer --interval")
        base = statistics.median(near)
        return sum(took[t] for t in window) - len(window) * base, base

    costs, controls, bases = [], [], []
    for save, window in touched.items():
        c, base = cost(window)
        costs.append(c)
        bases.append(base)
        control = [t + interval // 2 for t in window]
        if untouched.issuperset(control):
            controls.append(cost(control)[0])
    return costs, controls, statistics.median(bases)


def ckpt_files(url: str) -> list[str]:
    d = storage.read_manifest(url) or {}
    return [os.path.join(url, name) for name in d.get("files", {})]


# -- the benchmark ----------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug_cpu")
    parser.add_argument("--state-mb", type=float, default=300,
                        help="model + AdamW state to aim for, MB (1e6 bytes)")
    parser.add_argument("--dir", default=DIR,
                        help="run dir: checkpoints and raw-bandwidth files go under it")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each I/O measurement")
    parser.add_argument("--warm-reps", type=int, default=45,
                        help="repetitions of the warm loads and reads (each tens of ms)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--interval", type=int, default=10, help="steps between saves")
    parser.add_argument("--saves", type=int, default=6,
                        help="saves timed against the steps around them; 0: no step-time "
                             "figure")
    args, rest = parser.parse_known_args()
    cfg = load_config(args.config, parse_overrides(
        [*model_overrides(args.state_mb), "--training.run_dir", args.dir,
         "--metrics.progress", "plain", "--training.steps", str(10**9),
         "--checkpoint.enable", "true", "--checkpoint.resume", "false",
         "--checkpoint.mode", "async_thread", "--checkpoint.interval_steps", "0",
         "--checkpoint.interval_seconds", "0", *rest]))
    if cfg.checkpoint.mode == "sync":
        parser.error("--checkpoint.mode must be an async mode (sync is the baseline)")
    ckpt_dir = cfg.checkpoint_url
    if "://" in ckpt_dir and not ckpt_dir.startswith("file://"):
        parser.error(f"the checkpoint directory {ckpt_dir!r} must be local (raw I/O needs fsync)")
    ckpt_dir = ckpt_dir.removeprefix("file://")

    # Fresh saves and logs on every run; the data is kept. Each rank removes its own log
    # before it opens a new one; the checkpoints go once every rank is past the trainer's
    # check that the directory takes files (removed under it, that check failed on NFS).
    events_dir = os.path.join(cfg.training.run_dir, "events")
    for old in glob.glob(os.path.join(events_dir, f"rank-{os.environ.get('RANK', 0)}.*")):
        os.remove(old)
    trainer = Trainer(cfg)
    rank, world = trainer.session.world.rank, trainer.session.world.world_size
    dist.barrier()
    if rank == 0:
        for old in glob.glob(os.path.join(ckpt_dir, "*")):
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
        with contextlib.suppress(FileNotFoundError):  # an older version's single log
            os.remove(os.path.join(cfg.training.run_dir, "events.jsonl"))
    dist.barrier()
    device = trainer.device
    ranks = Ranks()
    mgr = trainer.session.checkpoints
    keep_last = cfg.checkpoint.keep_last
    cfg.checkpoint.keep_last = 10**6  # no retention work inside the timed saves
    sync_mgr = CheckpointManager(dataclasses.replace(cfg.checkpoint, mode="sync"), mgr.url,
                                 manifest_base=mgr.manifest_base, events=trainer.session.events,
                                 device=device, control_group=trainer.session.control_group)
    say = print if rank == 0 else (lambda *a, **k: None)
    params = count_params(cfg.model)
    say(f"checkpoint benchmark: {cfg.model.name} ({cfg.model.dim} dim x {cfg.model.n_layers} "
        f"layers, {params / 1e6:.1f}M params), {world} rank(s) on {device.type}, "
        f"checkpoints in {ckpt_dir}", flush=True)

    def train(n: int) -> None:
        loss = None
        for _ in range(n):
            loss = trainer.train_step(trainer.data.next_step())
            trainer.session._step += 1
        if loss is not None:
            global_mean(loss)  # host sync

    train(max(1, args.warmup_steps))  # AdamW's moments exist from the first step on

    # -- saves, raw writes, memcpy: the same state throughout --------------------------
    tensors = local_tensors(trainer)
    state_bytes = ranks.reduce(sum(t.numel() * t.element_size() for t in tensors),
                               dist.ReduceOp.SUM)
    cuda = device.type == "cuda"
    dst = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda) for t in tensors]
    memcpy(tensors, device, dst)  # fault the destination pages in once
    save_id = [BENCH_STEP]
    saved: list[str] = []
    async_steps: set[int] = set()

    def next_step() -> int:
        save_id[0] += 1
        saved.append(storage.step_dir(mgr.url, save_id[0]))
        return save_id[0]

    def save_sync() -> float:
        return ranks.timed(lambda: sync_mgr.save(next_step(), trainer.session.state))

    def save_async() -> tuple[float, float, float, float]:
        """Staging and writing alone, no training meanwhile: (call s, staging copy s,
        background write s, CPU s of all the process's threads), the slowest rank's each.
        That CPU is what a save takes from a training that keeps every core busy."""
        ranks.barrier()
        cpu = sum(os.times()[:2])
        start = time.perf_counter()
        async_steps.add(next_step())
        mgr.save(save_id[0], trainer.session.state)
        returned = time.perf_counter()
        mgr.wait_staged()
        staged = time.perf_counter()
        mgr.wait()
        done = time.perf_counter()
        return (ranks.reduce(returned - start), ranks.reduce(mgr.stager.copy_s),
                ranks.reduce(done - staged), ranks.reduce(sum(os.times()[:2]) - cpu))

    def save_then_step() -> float:
        """What a save costs the training thread in a real step: the save call, then
        the next step's wait for the staging copy before its update (the slowest rank's),
        called after a step, as in training."""
        train(1)
        ranks.barrier()
        start = time.perf_counter()
        mgr.save(next_step(), trainer.session.state)
        called = time.perf_counter() - start
        train(1)
        mgr.wait()
        return ranks.reduce(called + mgr.staging_wait_s)

    first_blocking, first_copy, _, _ = save_async()  # allocates the staging buffers
    first_sync = save_sync()
    manifest = storage.read_manifest(saved[-1]) or {}
    ckpt_bytes = manifest.get("bytes", 0)
    raw_paths: list[str] = []
    raw_share = ckpt_bytes // world + (1 if rank < ckpt_bytes % world else 0)

    block = memoryview(torch.randint(0, 256, (CHUNK,), dtype=torch.uint8).numpy().tobytes())

    def raw_write_new() -> float:
        """Into a new file, kept like a save's."""
        raw_paths.append(os.path.join(ckpt_dir, f"raw-write-bench.rank{rank}.{len(raw_paths)}"))
        return ranks.timed(lambda: raw_write(raw_paths[-1], raw_share, block))

    sync_s, call_s, copy_s, background_s, save_cpu_s, write_s = [], [], [], [], [], []
    memcpy_s, memcpy_fresh_s = [], []
    for r in range(args.reps):
        order = ["sync", "async", "overlap", "raw", "memcpy"]
        for what in (order if r % 2 == 0 else order[::-1]):
            if what == "sync":
                sync_s.append(save_sync())
            elif what == "async":
                _, c, bg, cpu = save_async()
                copy_s.append(c)
                background_s.append(bg)
                save_cpu_s.append(cpu)
            elif what == "overlap":
                call_s.append(save_then_step())
            elif what == "raw":
                write_s.append(raw_write_new())
            else:
                memcpy_s.append(ranks.timed(lambda: memcpy(tensors, device, dst)))
                memcpy_fresh_s.append(ranks.timed(lambda: memcpy(tensors, device, None)))
    dst.clear()  # frees the buffers

    # -- loads and raw reads of one of those checkpoints -------------------------------
    # Loading replaces AdamW's state tensors (load_state_dict copies), which drops the
    # stager's buffers: so every save above came first, and loads go last.
    url = saved[-1]
    files = ckpt_files(url)
    mine = files[rank::world]
    buf = memoryview(bytearray(CHUNK))
    whole = memoryview(bytearray(sum(os.path.getsize(p) for p in mine)))  # pages faulted in
    raw_reads = (lambda: raw_read(mine, buf), lambda: raw_read(mine, whole))

    def load() -> None:
        trainer.session.state.load(url, threads=cfg.checkpoint.reader_threads)
        sync_device(device)

    def resume() -> None:  # the newest checkpoint, checked and loaded as a restart does it
        assert mgr.resume(trainer.session.state) == save_id[0]
        sync_device(device)

    # The load's own reads alone, into the live tensors, as its plan lays them out (none
    # where DCP plans the load): what of the load's time beyond the raw read is reading,
    # and what is the Python around it. The same reads into other memory shaped like the
    # live tensors: one block mapped for them (as the raw read's memory is), and tensors
    # torch allocates now (as the live ones were): what the destination costs.
    reader = trainer.session.state._reader(url)
    plan = trainer.session.state._in_place(reader, trainer.session.state._objects(reader))
    elsewhere: dict = {}
    if plan is not None and plan.layout.on_cpu:
        live = plan.layout.targets
        elsewhere = {"block": host_block(live, pin=False)[1],
                     "torch": [torch.empty_like(t) for t in live]}
        for views in elsewhere.values():
            for view in views:
                view.zero_()  # its pages faulted in

    def load_reads(into: list | None = None) -> None:
        read_in_place(reader, plan if into is None else
                      plan._replace(layout=plan.layout._replace(targets=into)))
        sync_device(device)

    # The raw read baseline is the faster of two ways: one 64 MiB buffer reused, or the
    # bytes read where they belong in memory the size of the checkpoint. Which one wins
    # changes from process to process here (31 against 38 ms in one, 105 against 40 in
    # another, for the same 286 MB).
    raw_read(files, buf)  # warm the page cache (the files were just written anyway)
    load_s, reused_s, whole_s, resume_s, reads_s = [], [], [], [], []
    reads_into = {kind: [] for kind in elsewhere}
    for r in range(args.warm_reps):
        runs = [(load_s, load), (reused_s, raw_reads[0]), (whole_s, raw_reads[1]),
                (resume_s, resume), *([(reads_s, load_reads)] if plan is not None else []),
                *((reads_into[kind], functools.partial(load_reads, views))
                  for kind, views in elsewhere.items())]
        for times, fn in (runs if r % 2 == 0 else runs[::-1]):
            times.append(ranks.timed(fn))
    load_cold_s, reused_cold_s, whole_cold_s = [], [], []
    for r in range(args.reps):
        runs = [(load_cold_s, load), (reused_cold_s, raw_reads[0]), (whole_cold_s, raw_reads[1])]
        for times, fn in (runs if r % 2 == 0 else runs[::-1]):
            drop_cache(files)
            times.append(ranks.timed(fn))
    whole.release()
    elsewhere.clear()

    ranks.barrier()
    if rank == 0:
        for u in saved:
            storage.remove(u)
    for path in raw_paths:
        os.remove(path)
    ranks.barrier()

    # -- step time with saves, against the steps around them, through save_or_stop ------
    cfg.checkpoint.keep_last = keep_last
    n = args.interval
    log_every = cfg.metrics.log_every
    steps: list[tuple[int, float, float]] = []  # (step, start, end), each timed

    def run(count: int) -> None:  # Trainer.run's loop, less the console
        loss = None
        for _ in range(count):
            start = time.time()
            step = trainer.step + 1
            loss = trainer.train_step(trainer.data.next_step())
            trainer.session._step = step
            if step % log_every == 0:
                global_mean(loss)
            trainer.session._save_or_stop(step)
            steps.append((step, start, time.time()))
        global_mean(loss)
        mgr.wait()  # the last write is in the figures

    warm_step = trainer.step  # the saves before it are the I/O figures'
    if args.saves:  # align so the first timed step saves; re-warm the staging buffers
        train((n - 1 - trainer.step) % n)
        mgr.save(trainer.step, trainer.session.state, final=True)
        warm_step = trainer.step
        cfg.checkpoint.interval_steps = n
        ranks.barrier()
        run(n * args.saves)
    trainer.close()
    if rank != 0:
        return

    # -- report -------------------------------------------------------------------------
    med = statistics.median
    committed = read_events(cfg.training.run_dir, "checkpoint_committed")
    waits = [e for e in read_events(cfg.training.run_dir, "checkpoint_wait")
             if warm_step < e["step"] < BENCH_STEP]
    step_saves = [e for e in committed if warm_step < e["step"] < BENCH_STEP]
    ev_bg = [e["total_s"] - e["blocking_s"] for e in committed
             if e["step"] in async_steps and e["step"] != BENCH_STEP + 1]
    bw = lambda nbytes, s: nbytes / s / MB  # noqa: E731
    m = {k: med(v) for k, v in dict(
        sync=sync_s, blocking=call_s, copy=copy_s, background=background_s,
        save_cpu=save_cpu_s, write=write_s,

        memcpy=memcpy_s, memcpy_fresh=memcpy_fresh_s, load=load_s, read_reused=reused_s,
        read_whole=whole_s, load_reads=reads_s, reads_block=reads_into.get("block"),
        reads_torch=reads_into.get("torch"), load_cold=load_cold_s,
        read_reused_cold=reused_cold_s, read_whole_cold=whole_cold_s, resume=resume_s).items()
        if v}
    m["read"] = min(m["read_reused"], m["read_whole"])
    m["read_cold"] = min(m["read_reused_cold"], m["read_whole_cold"])
    figures = {
        "blocking_over_sync": m["blocking"] / m["sync"],
        "staging_over_memcpy": bw(state_bytes, m["copy"]) / bw(state_bytes, m["memcpy"]),
        "write_over_raw": min(write_s) / min(background_s),  # see the docstring
        "load_over_raw": bw(ckpt_bytes, m["load"]) / bw(ckpt_bytes, m["read"]),
        "load_over_raw_cold": bw(ckpt_bytes, m["load_cold"]) / bw(ckpt_bytes, m["read_cold"]),
        "bytes_per_param": ckpt_bytes / params,
    }
    if args.saves:
        costs, controls, step_s = save_costs(steps, committed, n)
        cost = statistics.median(costs)
        control = statistics.median(controls) if controls else None
        m["without"], m["with_"] = step_s, step_s + cost / n
        figures["step_time_with_saves_over_without"] = m["with_"] / m["without"]
    goals = {"blocking_over_sync": ("<=", 0.03), "staging_over_memcpy": (">=", 0.8),
             "write_over_raw": (">=", 0.9), "load_over_raw": (">=", 0.9),
             "load_over_raw_cold": (">=", 0.9),
             "step_time_with_saves_over_without": ("<=", 1.05)}

    print(f"\nmedians of {args.reps} repetitions ({args.warm_reps} of the warm loads and "
          f"reads; step time: of {args.saves} saves, each against the steps around it); "
          f"times are the slowest rank's")
    print(f"{'measurement':<44}{'s':>10}{'MB':>10}{'MB/s':>10}")

    def row(name, s, nbytes=None):
        mbs = f"{bw(nbytes, s):>10.0f}" if nbytes else f"{'':>10}"
        size = f"{nbytes / MB:>10.1f}" if nbytes else f"{'':>10}"
        print(f"{name:<44}{s:>10.3f}{size}{mbs}")
    row("memcpy to host, preallocated buffers", m["memcpy"], state_bytes)
    row("memcpy to host, fresh buffers", m["memcpy_fresh"], state_bytes)
    row("async save: staging copy, on its thread", m["copy"], state_bytes)
    row("async save: staging copy, first save", first_copy, state_bytes)
    row(f"async save: training thread blocked ({min(call_s) * 1e3:.1f}-"
        f"{max(call_s) * 1e3:.1f} ms)", m["blocking"], state_bytes)
    row("async save: call, first save", first_blocking, state_bytes)
    row("async save: background write to commit", m["background"], ckpt_bytes)
    if ev_bg:
        row("  copy + write, from checkpoint_committed", med(ev_bg), ckpt_bytes)
    row("async save: CPU of all its threads", m["save_cpu"])
    row("sync save: total", m["sync"], ckpt_bytes)
    row("sync save: total, first save", first_sync, ckpt_bytes)
    row("raw write + fsync, same dir, new files", m["write"], ckpt_bytes)
    row("async save: background write, best", min(background_s), ckpt_bytes)
    row("raw write + fsync, best", min(write_s), ckpt_bytes)
    row("load (TrainState.load), warm cache", m["load"], ckpt_bytes)
    row("raw read, warm cache, a 64 MiB buffer reused", m["read_reused"], ckpt_bytes)
    row("raw read, warm cache, into checkpoint-sized memory", m["read_whole"], ckpt_bytes)
    row("resume (CheckpointManager.resume: checked load), warm", m["resume"], ckpt_bytes)
    if reads_s:
        row("  the load's reads alone, into the live state", m["load_reads"], ckpt_bytes)
    if "reads_block" in m:
        row("  the same reads, into one block mapped now", m["reads_block"], ckpt_bytes)
        row("  the same reads, into tensors torch made now", m["reads_torch"], ckpt_bytes)
    row("load (TrainState.load), cold cache", m["load_cold"], ckpt_bytes)
    row("raw read, cold cache (fadvise DONTNEED), reused", m["read_reused_cold"], ckpt_bytes)
    row("raw read, cold cache, into checkpoint-sized", m["read_whole_cold"], ckpt_bytes)
    if args.saves:
        row("step, untouched by a save", m["without"])
        row(f"step, a save every {n} steps", m["with_"])
        row(f"training time a save takes ({min(costs):.2f}-{max(costs):.2f})", cost)
        if controls:
            row(f"  the same, no save ({min(controls):.2f}-{max(controls):.2f})", control)
    beyond = m["load"] - m["read"]
    print(f"load beyond the raw read, warm: {beyond * 1e3:.1f} ms for {len(tensors)} tensors "
          f"a rank ({beyond / len(tensors) * 1e6:.1f} us each)" + (
              f"; its reads alone {(m['load_reads'] - m['read']) * 1e3:.1f} ms beyond it, "
              f"the rest of the load {(m['load'] - m['load_reads']) * 1e3:.1f} ms"
              if reads_s else ""))
    print(f"state {state_bytes / MB:.1f} MB (model + AdamW, all ranks); checkpoint "
          f"{ckpt_bytes / MB:.1f} MB in {len(files)} files; {params / 1e6:.2f}M params; "
          f"{len(step_saves)} saves while stepping, {len(waits)} waited for the previous one")
    print(f"\n{'figure':<36}{'value':>10}  goal")
    notes = {"load_over_raw": "  (warm page cache)", "load_over_raw_cold": "  (cold page cache)",
             "bytes_per_param": "  (AdamW, fp32: 12-14)"}
    for name, value in figures.items():
        goal = goals.get(name)
        if goal:
            ok = value <= goal[1] if goal[0] == "<=" else value >= goal[1]
            mark = f"{goal[0]} {goal[1]:g}" + ("" if ok else " MISSED")
        else:
            mark = ""
        print(f"{name:<36}{value:>10.4f}  {mark}{notes.get(name, '')}")
    out = {k: round(v, 4) for k, v in figures.items()}
    out.update(state_mb=round(state_bytes / MB, 1), checkpoint_mb=round(ckpt_bytes / MB, 1),
               params=params, blocking_s=round(m["blocking"], 4),
               blocking_range_s=[round(min(call_s), 4), round(max(call_s), 4)],
               sync_save_s=round(m["sync"], 4),
               memcpy_mb_s=round(bw(state_bytes, m["memcpy"])),
               write_mb_s=round(bw(ckpt_bytes, m["background"])),
               raw_write_mb_s=round(bw(ckpt_bytes, m["write"])),
               load_mb_s=round(bw(ckpt_bytes, m["load"])),
               raw_read_mb_s=round(bw(ckpt_bytes, m["read"])),
               resume_mb_s=round(bw(ckpt_bytes, m["resume"])),
               load_cold_mb_s=round(bw(ckpt_bytes, m["load_cold"])),
               raw_read_cold_mb_s=round(bw(ckpt_bytes, m["read_cold"])),
               save_cpu_s=round(m["save_cpu"], 3),
               load_beyond_raw_ms=round(beyond * 1e3, 2), tensors_per_rank=len(tensors),
               world_size=world)
    if reads_s:
        out.update(load_reads_over_raw=round(m["read"] / m["load_reads"], 4),
                   load_python_ms=round((m["load"] - m["load_reads"]) * 1e3, 2))
    if "reads_block" in m:
        out.update(reads_block_over_raw=round(m["read"] / m["reads_block"], 4),
                   reads_torch_over_raw=round(m["read"] / m["reads_torch"], 4))
    if args.saves:
        out.update(step_ms=round(m["without"] * 1e3, 2), interval=n,
                   step_with_saves_ms=round(m["with_"] * 1e3, 2),
                   save_cost_ms=round(cost * 1e3, 1),
                   no_save_cost_ms=round(control * 1e3, 1) if controls else None)
    print(json.dumps(out))


@contextlib.contextmanager
def through_mount():
    """Takes ``--through`` off the command line; for ``fuse`` or ``nfs``, local rank 0
    mounts ``<--dir>/through-<kind>/mnt`` (the other ranks wait for it), the checkpoint
    URL goes there, and the mount is taken down at the end."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--through", choices=["local", "fuse", "nfs"], default="local")
    pre.add_argument("--dir", default=DIR)
    known, rest = pre.parse_known_args(sys.argv[1:])
    if known.through == "local":
        sys.argv[1:] = ["--dir", known.dir, *rest]
        yield
        return
    mount = {"fuse": BindfsMount, "nfs": NfsMount}[known.through](
        Path(known.dir).resolve() / f"through-{known.through}")
    sys.argv[1:] = ["--dir", known.dir, *rest,
                    "--checkpoint.url", str(mount.mount / "checkpoints")]
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        wait_mounted(mount.mount)
        yield
        return
    unmount(mount.mount)  # left by a run that was killed
    mount.start()
    try:
        yield
    finally:
        mount.stop()


if __name__ == "__main__":
    with reaping(), through_mount():  # the mount comes down first
        main()
