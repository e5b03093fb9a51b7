"""The GPU figures of ``make gpu-check``, on one GPU, each from real ``llmtrain train`` runs
under torchrun (NCCL) and read back from their events:

- **start-up**: the first run's start-up timeline (launch, imports, NCCL group, model...),
  on a "node" whose inductor and Triton caches are empty; then the same job started again
  on another such node, where the run dir's compile cache is all it has: a cold
  restart's time to its first step (goals: restart <= 8 s, first start <= 15 s);
- **restart into a prepared worker**: the same job under ``llmtrain launch
  --prepared-workers``, its rank SIGKILLed after a checkpoint: fault to the first step of
  the restarted rank, which loads the checkpoint (goal <= 8 s), with its parts;
- **bf16 MFU** of FSDP2 on a ~1B Llama (Llama 3.2 1B's shape, vocab 32768) with
  ``torch.compile``: model FLOPs (6N + attention, as torchtitan counts them) per second
  over the GPU's dense bf16 peak, the median of the steps after the first ``--warmup``;
- **FP8 / bf16**: tokens/s of torchao's tensorwise and rowwise FP8 against bf16 on a ~3B
  Llama (Llama 3.2 3B's shape) with activation checkpointing and compile, and
  their mean loss over the last 20 steps against bf16's (same data, same init);
- **checkpoints** of the 1B run's full state (weights and Adam, fp32): ``blocking_over_sync``,
  what an async save holds the training thread (the save call, plus the next step's
  wait for the staging copy before its update, as benchmarks/checkpoint.py counts it)
  over a sync save's call, medians over the saves before each run's last step (whose
  save waits for its write); apart from it, the longest wait of a save for the previous
  save's write (saves come faster than /dev/shm takes 13 GB); the extra time of the step
  the staging copy overlaps, and that copy's bandwidth over a plain device-to-host copy
  into pinned memory.

    python benchmarks/gpu.py [--quick] [--sections startup_mfu,restart,fp8,checkpoint]
                             [--work DIR] [--timeout 240]

``--quick`` uses small models and few steps (a smoke run of every path). Prints a table,
then one JSON line of the figures. Each run's output is kept under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from llmtrain.checkpoint.staging import host_block  # noqa: E402
from llmtrain.distributed.signed_store import SECRET_ENV, new_secret  # noqa: E402
from llmtrain.events import read_events  # noqa: E402
from llmtrain.chaos.local_cluster import LocalCluster  # noqa: E402
from reaper import end_tree, reaping  # noqa: E402
from recovery import wait_for, wait_ready  # noqa: E402

# the job's secret, as a job script gives it: the run dir's compile cache is signed with
# it, and loaded only where it is (the same in every start of the check)
os.environ.setdefault(SECRET_ENV, new_secret())

# every run's options: one rank on this GPU, a line and an event a step
ON_GPU = ("--config", "debug_cpu", "--parallelism.device", "cuda",
          "--parallelism.param_dtype", "bfloat16",
          "--metrics.log_every", "1", "--metrics.progress", "plain",
          "--metrics.address", "127.0.0.1",
          # the first step compiles for minutes; a GPU check may run beside (make gpu-check)
          "--reliability.hang_timeout_s", "900", "--reliability.collective_timeout_s", "1200",
          "--health.stray_processes", "warn")

LLAMA_1B = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=32768,
                ffn_dim_multiplier=1.5, multiple_of=256, max_seq_len=2048)
LLAMA_3B = dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=32768,
                ffn_dim_multiplier=1.0, multiple_of=256, max_seq_len=2048)
SMALL = dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=32768,
             ffn_dim_multiplier=1.0, multiple_of=256, max_seq_len=1024)


def model_args(shape: dict) -> list[str]:
    return [a for k, v in shape.items() for a in (f"--model.{k}", str(v))]


def train(work: Path, name: str, args: list[str], timeout: float, *, run: str = "",
          node: str = "") -> dict:
    """One ``llmtrain train`` run on this GPU; its events, or the error that ended it.
    ``run``: start again in that run's dir (kept) instead of a fresh one; ``node``: the
    name of this start's own inductor and Triton caches (empty ones, as on a node that
    has compiled nothing), else the machine's."""
    run_dir = work / (run or name)
    if not run:
        shutil.rmtree(run_dir, ignore_errors=True)
    caches = {}
    if node:
        caches = {"TORCHINDUCTOR_CACHE_DIR": str(work / f"node-{node}" / "inductor"),
                  "TRITON_CACHE_DIR": str(work / f"node-{node}" / "triton")}
        shutil.rmtree(work / f"node-{node}", ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", "-m", "llmtrain", "train", "--training.run_dir", str(run_dir), *ON_GPU, *args]
    started, started_at = time.monotonic(), time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **caches})
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        # torchrun's workers live in sessions of their own: the whole tree goes, so that
        # none holds the GPU through the next run
        end_tree(proc)
        out, err = proc.communicate()
        code = "timeout"
    text = out + err
    (work / f"{name}.log").write_text(text)
    wall = time.monotonic() - started
    print(f"  {name}: exit {code} in {wall:.0f} s", flush=True)
    if code != 0:
        tail = "\n".join(text.strip().splitlines()[-25:])
        print(f"--- {name} failed; the end of its output:\n{tail}\n---", flush=True)
    since = started_at if run else 0.0  # a start again: only its own events
    ev = {k: [e for e in read_events(str(run_dir), k) if e["ts"] >= since]
          if run_dir.exists() else []
          for k in ("step", "startup", "checkpoint_committed", "checkpoint_staged", "run_end",
                    "compile_cache", "span")}
    return {"exit": code, "wall_s": wall, **ev}


def prepared_restart(work: Path, args: list[str], timeout: float,
                     options: tuple[str, ...] = ON_GPU) -> dict:
    """A cold restart on this node as a job has it: one rank under ``llmtrain launch
    --prepared-workers`` (its successor imported, its CUDA context made, before the fault),
    SIGKILLed once a checkpoint of step 10 or later has committed and the successor is
    ready; torchrun restarts the rank in that worker, which loads the newest checkpoint
    and the run dir's compile cache (this node's own caches are warm, as on a restart in
    place). The parts, from the restarted rank's ``recovery`` event."""
    run = work / "restart_prepared"
    shutil.rmtree(run, ignore_errors=True)
    (work / "node1.log").unlink(missing_ok=True)
    cluster = LocalCluster(work, run, "1:1", (*options, *args, "--warm.enable", "false",
                                              "--prepared-workers"))
    try:
        cluster.start("node1")
        wait_for(run, "checkpoint_committed", lambda e: e["step"] >= 10, timeout)
        # the first attempt ran in the first prepared worker: its successor's to be ready
        wait_ready(work / "node1.log", 2, timeout)
        worker = wait_for(run, "startup")
        killed = time.time()
        os.kill(worker["pid"], signal.SIGKILL)
        marks = wait_for(run, "recovery", lambda e: e["ts"] > killed, timeout)["marks"]
        again = wait_for(run, "startup", lambda e: e["ts"] > killed)
        loaded = wait_for(run, "checkpoint_loaded", lambda e: e["ts"] > killed)
    finally:
        cluster.close()
    if not again["prepared"]:
        raise RuntimeError(f"the restarted rank (pid {again['pid']}) ran in no prepared "
                           f"worker: see {work / 'node1.log'}")
    # the load's own parts, as the restarted rank logged them (llmtrain.checkpoint.in_place)
    said = [line for line in (work / "node1.log").read_text().splitlines()
            if "checkpoint load:" in line]
    print(f"  in place: {loaded['checked_in_load']}; {said[-1] if said else 'no load parts'}",
          flush=True)
    phases, detected = again["phases"], marks["failure_detected"] or killed
    return {"fault_to_first_step_s": marks["first_step"] - killed,
            "detect_s": detected - killed,
            "rendezvous_handoff_s": marks["process_start"] - detected,
            "to_process_group_s": marks["process_group_up"] - marks["process_start"],
            "to_checkpoint_loaded_s": marks["checkpoint_loaded"] - marks["process_group_up"],
            # of which: the model's build (meta, sharded, materialized) and the load
            "model_build_s": sum(phases.get(k, 0.0) for k in ("model_meta", "shard",
                                                              "materialize")),
            "load_s": loaded["seconds"],
            "loaded_to_first_step_s": marks["first_step"] - marks["checkpoint_loaded"]}


def steady(run: dict, key: str, warmup: int) -> float | None:
    """The median of ``key`` over the steps after the first ``warmup``."""
    values = [e[key] for e in run["step"] if e["step"] > warmup and e.get(key) is not None]
    return statistics.median(values) if values else None


def save_stalls(run: dict) -> tuple[list[float], list[float]]:
    """What each save before the run's last step held the training thread: the save's own
    part (its ``checkpoint_staged`` blocking time, plus the next step's wait for the
    staging copy, "staging before step N+1", none for a sync save), and apart from it the
    time the save call first waited for the previous save's write (the "save step N" span
    beyond the save's own part: storage slower than the save interval, not the save)."""
    spans = {e["name"]: e["end"] - e["start"] for e in run["span"]
             if e["category"] == "checkpoint_stall"}
    last = max((e["step"] for e in run["step"]), default=0)
    own, waited = [], []
    for e in run["checkpoint_staged"]:
        n = e["step"]
        if n < last and f"save step {n}" in spans:
            own.append(e["blocking_s"] + spans.get(f"staging before step {n + 1}", 0.0))
            waited.append(max(0.0, spans[f"save step {n}"] - e["blocking_s"]))
    return own, waited


def last_loss(run: dict, n: int = 20) -> float | None:
    losses = [e["loss"] for e in run["step"]][-n:]
    return sum(losses) / len(losses) if losses else None


def d2h_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-host copy bandwidth into memory pinned as the staging buffers are: the
    staging copy's ceiling."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    _, (dst,) = host_block([src], pin=True)  # unpinned when it goes
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del src, dst  # the training runs this process starts next need the memory
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models, few steps (smoke)")
    ap.add_argument("--sections", default="startup_mfu,restart,fp8,checkpoint")
    ap.add_argument("--work", default="", help="run directories and logs (default: a temp dir)")
    ap.add_argument("--ckpt-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else "",
                    help="where checkpoints go (default /dev/shm: the disk is not measured)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per training run")
    ap.add_argument("--fp8-steps", type=int, default=100)
    ap.add_argument("--fp8-batch", type=int, default=8,
                    help="sequences of 2048 per step at 3B; FP8's gain grows with it: 1.17x "
                         "at 4, 1.26x at 8 on an H200")
    ap.add_argument("--fp8-ac", choices=("selective", "full"), default="",
                    help="activation checkpointing at 3B (default: selective on GPUs with "
                         "120 GB or more, else full: selective keeps every matmul's output, "
                         "about 28 GB at 8 x 2048 tokens, which with 3B's 51 GB of fp32 "
                         "weights, gradients and Adam state does not fit in 80 GB)")
    ap.add_argument("--recipes", default="tensorwise,rowwise", help="FP8 recipes to compare")
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU")
    work = Path(a.work or tempfile.mkdtemp(prefix="llmtrain-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt_root = Path(tempfile.mkdtemp(prefix="llmtrain-gpu-ckpt-", dir=a.ckpt_dir or work))
    sections = set(a.sections.split(","))
    one_b, three_b = (SMALL, SMALL) if a.quick else (LLAMA_1B, LLAMA_3B)
    seq = "1024" if a.quick else "2048"
    steps = 12 if a.quick else 30
    fp8_steps = 12 if a.quick else a.fp8_steps
    fp8_batch = a.fp8_batch
    big = torch.cuda.get_device_properties(0).total_memory >= 120e9
    fp8_ac = a.fp8_ac or ("selective" if big else "full")
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}; work dir {work}",
          flush=True)
    fig: dict = {"device": name, "torch": torch.__version__, "quick": a.quick}
    rows: list[tuple[str, str]] = []

    def ckpt(run: str, mode: str, every: int) -> list[str]:
        return ["--checkpoint.url", str(ckpt_root / run), "--checkpoint.mode", mode,
                "--checkpoint.interval_steps", str(every), "--checkpoint.keep_last", "1",
                "--checkpoint.resume", "false"]

    base = ["--data.seq_len", seq, "--training.global_batch_size", "4",
            "--training.micro_batch_size", "4", "--optim.warmup_steps", "10"]
    if sections & {"startup_mfu", "checkpoint"}:
        print("1B bf16, compile, async checkpoints:", flush=True)
        r = train(work, "bf16_1b", [*model_args(one_b), *base, "--training.steps", str(steps),
                                    "--parallelism.compile", "true",
                                    *ckpt("bf16_1b", "async_thread", steps // 3)], a.timeout,
                  node="first")
        fig["bf16_1b_exit"] = r["exit"]
        if r["startup"]:
            phases = r["startup"][0]["phases"]
            fig["startup_s"] = {k: round(v, 3) for k, v in phases.items()}
            fig["first_step_after_launch_s"] = round(r["startup"][0]["since_launch_s"], 2)
            rows.append(("start-up (s)", ", ".join(f"{k} {v:.2f}" for k, v in phases.items())))
            rows.append(("first step after launch (s)", f"{fig['first_step_after_launch_s']}"))
        # the same job started again on a "node" that compiled nothing: what a cold
        # restart pays to its first step with the run dir's compile cache
        again = train(work, "bf16_1b_restart", [*model_args(one_b), *base,
                                                "--training.steps", "2",
                                                "--parallelism.compile", "true",
                                                "--checkpoint.enable", "false"], a.timeout,
                      run="bf16_1b", node="restart")
        if again["startup"]:
            phases = again["startup"][0]["phases"]
            fig["restart_startup_s"] = {k: round(v, 3) for k, v in phases.items()}
            fig["restart_first_step_after_launch_s"] = round(
                again["startup"][0]["since_launch_s"], 2)
            rows.append(("restart, fresh node, start-up (s)",
                         ", ".join(f"{k} {v:.2f}" for k, v in phases.items())))
            rows.append(("restart, fresh node, first step after launch (s)",
                         f"{fig['restart_first_step_after_launch_s']} (goal <= 8; first "
                         f"start goal <= 15)"))
        for label, run in (("first", r), ("restart", again)):
            ours = [e for e in run["compile_cache"] if e["rank"] == 0]
            if ours:
                fig[f"compile_cache_{label}"] = {k: ours[0][k] for k in (
                    "loaded", "graph_hits", "graph_misses", "autograd_hits",
                    "autograd_misses", "saved")}
        mfu = steady(r, "mfu", a.warmup)
        tps = steady(r, "tokens_per_s", a.warmup)
        fig.update(bf16_1b_mfu=mfu and round(mfu, 4), bf16_1b_tokens_per_s=tps and round(tps),
                   bf16_1b_memory_gb=r["step"] and round(r["step"][-1]["memory_gb"], 1))
        rows.append(("1B bf16 MFU (compile)", f"{mfu:.3f}" if mfu else "n/a"))
        rows.append(("1B bf16 tokens/s", f"{tps:,.0f}" if tps else "n/a"))
        async_commits = r["checkpoint_committed"]
        print(f"partial: {json.dumps(fig)}", flush=True)
    if "restart" in sections:
        print("1B bf16, compile: a cold restart into a prepared worker", flush=True)
        try:
            parts = prepared_restart(work, [
                *model_args(one_b), *base, "--training.steps", "100000",
                "--parallelism.compile", "true",
                "--checkpoint.url", str(ckpt_root / "restart"), "--checkpoint.interval_steps",
                "10", "--checkpoint.keep_last", "1"], a.timeout)
        except (RuntimeError, TimeoutError) as e:  # the row says so; the others go on
            print(f"  restart_prepared failed: {e}", flush=True)
            parts = {}
        fig.update({f"restart_prepared_{k}": round(v, 3) for k, v in parts.items()})
        if parts:
            rows.append(("cold restart, prepared worker: fault to first step (s)",
                         f"{parts['fault_to_first_step_s']:.2f} (goal <= 8)"))
            rows.append(("  its parts (s)", ", ".join(
                f"{k.removesuffix('_s')} {v:.2f}" for k, v in parts.items()
                if k != "fault_to_first_step_s")))
        print(f"partial: {json.dumps(fig)}", flush=True)
    if "checkpoint" in sections:
        print("1B bf16, sync checkpoints:", flush=True)
        s = train(work, "sync_1b", [*model_args(one_b), *base, "--training.steps", "18",
                                    *ckpt("sync_1b", "sync", 6)], a.timeout)
        (sync, _), (blocking, waited) = save_stalls(s), save_stalls(r)
        staged = [(e["bytes"], e["staging_s"]) for e in async_commits if e.get("staging_s")]
        ceiling = d2h_gbps()
        # the staging copy overlaps the next step, whose optimizer waits for it
        times = {e["step"]: e["step_time_s"] for e in r["step"]}
        median = statistics.median(times.values()) if times else 0.0
        extra = [times[e["step"] + 1] - median for e in async_commits if e["step"] + 1 in times]
        if extra:  # the first save's is where making the pinned buffers would show
            fig.update(async_first_next_step_extra_s=round(extra[0], 3),
                       async_next_step_extra_s=round(min(extra), 3))
            rows.append(("async save: next step's extra time (s)",
                         f"first {extra[0]:.3f}, least {min(extra):.3f}"))
        if sync and blocking:
            held, whole = statistics.median(blocking), statistics.median(sync)
            fig.update(async_blocking_s=round(held, 3), sync_s=round(whole, 3),
                       blocking_over_sync=round(held / whole, 4))
            rows.append(("async save held (call + copy wait) / sync save",
                         f"{held:.3f} / {whole:.3f} s = {held / whole:.3f}"))
        if waited:  # a save due while the previous one still writes waits for it
            fig.update(async_waited_for_previous_write_s=round(max(waited), 3))
            rows.append(("async save: longest wait for the previous write (s)",
                         f"{max(waited):.3f} (saves every {steps // 3} steps)"))
        if staged:
            gbps = max(b / t for b, t in staged) / 1e9
            fig.update(staging_gbps=round(gbps, 2), d2h_pinned_gbps=round(ceiling, 2),
                       staging_over_d2h=round(gbps / ceiling, 3),
                       checkpoint_gb=round(staged[0][0] / 1e9, 2))
            rows.append(("staging / D2H pinned (GB/s)",
                         f"{gbps:.1f} / {ceiling:.1f} = {gbps / ceiling:.3f}"))
        print(f"partial: {json.dumps(fig)}", flush=True)
    if "fp8" in sections:
        fp8_base = [*model_args(three_b), "--data.seq_len", seq,
                    "--training.global_batch_size", str(fp8_batch),
                    "--training.micro_batch_size", str(fp8_batch),
                    "--training.steps", str(fp8_steps), "--optim.warmup_steps", "20",
                    "--optim.lr", "3e-4", "--parallelism.compile", "true",
                    "--parallelism.activation_checkpoint", fp8_ac,
                    "--checkpoint.enable", "false"]
        fig.update(fp8_batch=fp8_batch, fp8_ac=fp8_ac)
        print(f"3B: {fp8_batch} x {seq} tokens per step, {fp8_ac} activation checkpointing",
              flush=True)
        runs = {}
        recipes = a.recipes.split(",")
        for recipe in ("none", *recipes):
            print(f"3B {recipe if recipe != 'none' else 'bf16'}:", flush=True)
            runs[recipe] = train(work, f"fp8_{recipe}",
                                 [*fp8_base, "--parallelism.fp8", recipe], a.timeout)
        bf16_tps, bf16_loss = steady(runs["none"], "tokens_per_s", a.warmup), \
            last_loss(runs["none"])
        bf16_mfu = steady(runs["none"], "mfu", a.warmup)
        fig.update(bf16_3b_tokens_per_s=bf16_tps and round(bf16_tps),
                   bf16_3b_mfu=bf16_mfu and round(bf16_mfu, 4),
                   bf16_3b_loss=bf16_loss and round(bf16_loss, 4))
        rows.append(("3B bf16 tokens/s (MFU)", f"{bf16_tps:,.0f} ({bf16_mfu:.3f})"
                     if bf16_tps and bf16_mfu else "n/a"))
        for recipe in recipes:
            tps, loss = steady(runs[recipe], "tokens_per_s", a.warmup), last_loss(runs[recipe])
            ratio = tps / bf16_tps if tps and bf16_tps else None
            fig.update({f"fp8_{recipe}_tokens_per_s": tps and round(tps),
                        f"fp8_{recipe}_over_bf16": ratio and round(ratio, 3),
                        f"fp8_{recipe}_loss": loss and round(loss, 4),
                        f"fp8_{recipe}_exit": runs[recipe]["exit"]})
            rows.append((f"3B FP8 {recipe} / bf16 tokens/s", f"{ratio:.3f}" if ratio else "n/a"))
            if loss is not None and bf16_loss is not None:
                rows.append((f"3B FP8 {recipe} loss (last 20) vs bf16",
                             f"{loss:.4f} vs {bf16_loss:.4f} ({loss - bf16_loss:+.4f})"))
    shutil.rmtree(ckpt_root, ignore_errors=True)
    width = max(len(k) for k, _ in rows) if rows else 10
    print(f"\n{'figure':{width}}  value")
    for k, v in rows:
        print(f"{k:{width}}  {v}")
    print(json.dumps(fig))


if __name__ == "__main__":
    with reaping():
        main()
