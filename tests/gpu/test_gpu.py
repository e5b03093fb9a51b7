"""The CUDA, NCCL, NVML and FP8 paths on a real GPU (one is enough): ``make gpu-check``.

Each test prints what it measured or found (``-s`` shows it); ``benchmarks/gpu.py`` does
the throughput, MFU, FP8 and checkpoint figures.
"""

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, check, events, llmtrain
from llmtrain.checkpoint import shard_read, storage
from llmtrain.config import HealthConfig, ParallelismConfig, ReliabilityConfig
from llmtrain.distributed.process_group import WorldInfo, free_port, init_process_group
from llmtrain.reliability.health.checks import HealthChecker, open_backend
from llmtrain.reliability.health.monitor import HealthMonitor, rank_gpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (make gpu-check on a GPU node)")

# stray processes only warn: the monitor check or the benchmark may share the GPU
GPU = ("--parallelism.device", "cuda", "--parallelism.param_dtype", "bfloat16",
       "--health.stray_processes", "warn")


def test_health_json_against_the_driver():
    """Every check runs against the real driver: none crashes, and each GPU check is ok or
    unknown. First in this file: later tests hold GPU memory, which the stray-process check
    would rightly name. Node checks may warn about the machine (a VM without NTP)."""
    out = subprocess.run([sys.executable, "-m", "llmtrain", "health", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    report = json.loads(out.stdout)
    findings = report["findings"]
    print("\n" + "\n".join(f"{f['severity']:8} {f['check']:18} gpu={f.get('gpu')} "
                           f"{f['message'][:150]}" for f in findings))
    assert {f["check"] for f in findings} >= {"gpu_count", "ecc_volatile", "xid", "pcie_link",
                                              "temperature", "stray_processes"}
    bad = [f for f in findings if f["gpu"] is not None and f["severity"] not in ("ok", "unknown")]
    assert not bad, bad


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    """A one-rank NCCL group made by llmtrain's own start-up, the flight recorder on."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # started/completed per entry
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True,
                          timeout=timedelta(seconds=60))
    started = time.perf_counter()
    device = init_process_group(ParallelismConfig(device="cuda"), ReliabilityConfig(),
                                WorldInfo(rank=0, world_size=1, local_rank=0, host="gpu"), store)
    print(f"\nNCCL group (eager, bound to {device}) in {time.perf_counter() - started:.2f} s")
    yield device
    dist.destroy_process_group()


def test_nccl_group_reduces_on_the_gpu(nccl):
    assert dist.get_backend() == "nccl" and nccl.type == "cuda"
    x = torch.arange(1 << 20, device=nccl, dtype=torch.float32)
    dist.all_reduce(x)
    out = torch.empty(1 << 20, device=nccl)
    dist.all_gather_into_tensor(out, x)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.arange(1 << 20, dtype=torch.float32))


def test_a_queued_nccl_collective_is_named_by_analyze(nccl, tmp_path):
    """NCCL's own recorder reaches llmtrain's dump: an all_reduce queued behind a long
    kernel (not started when the dump is taken) is the collective ``analyze`` names."""
    from llmtrain.reliability.watchdog import flight_recorder
    x = torch.ones(4096, device=nccl)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles ahead of the collective
    work = dist.all_reduce(x, async_op=True)
    dump = {"rank": 0, **flight_recorder()}
    work.wait()
    torch.cuda.synchronize()
    nccl_entries = [e for e in dump["entries"] if "nccl:" in e.get("profiling_name", "")]
    print(f"\n{len(dump['entries'])} recorder entries, {len(nccl_entries)} NCCL; newest: "
          f"{json.dumps(nccl_entries[-1:], default=str)[:600]}")
    assert nccl_entries and nccl_entries[-1]["profiling_name"] == "nccl:all_reduce"
    assert nccl_entries[-1]["state"] == "scheduled"
    (tmp_path / "rank-00000.json").write_text(json.dumps(dump))
    out = subprocess.run([sys.executable, "-m", "llmtrain", "analyze", str(tmp_path),
                          "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    print(f"analyze: {report['verdict']}; collective {report['collective']}; "
          f"groups {report['groups']}")
    assert report["collective"]["op"] == "nccl:all_reduce" and report["stuck"] == [0]


def test_nvml_monitor_runs_its_event_loop_while_the_gpu_works():
    """The in-training monitor for ``LLMTRAIN_GPU_MONITOR_S`` (60) seconds at a 1 s
    interval, with XID events registered, while a matmul loop keeps the GPU busy (or,
    with ``LLMTRAIN_GPU_MONITOR_LOAD=0``, while the GPU benchmark runs beside it)."""
    seconds = float(os.environ.get("LLMTRAIN_GPU_MONITOR_S", 60))
    load = os.environ.get("LLMTRAIN_GPU_MONITOR_LOAD", "1") == "1"
    checker = HealthChecker(HealthConfig(), open_backend(HealthConfig(backend="nvml")))
    recorded, passes = [], []

    class Events:
        def emit(self, event, **fields):
            recorded.append({"event": event, **fields})
    gpu = rank_gpu(checker.backend, torch.device("cuda", 0))
    monitor = HealthMonitor(checker, [gpu], interval_s=1.0, node_checks=True, events=Events(),
                            on_pass=lambda findings, values: passes.append(values))
    monitor.start()
    print(f"\nXID events registered: {checker.event_set is not None}")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for _ in range(50 if load else 0):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            time.sleep(0 if load else 0.5)
    finally:
        monitor.close()
    print(f"{len(passes)} passes; last readings {passes[-1] if passes else None}; "
          f"events {recorded}")
    assert monitor.fatal_finding() is None, monitor.fatal_finding()
    assert len(passes) >= seconds / 2 and passes[-1].get(gpu)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_tracks_bf16(recipe):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 4096, bias=False),
                              torch.nn.Linear(4096, 1024, bias=False)).cuda().bfloat16()
    fp8 = convert_to_float8_training(
        __import__("copy").deepcopy(ref), config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    y_ref, y = ref(x), fp8(x)
    y_ref.float().square().mean().backward()
    y.float().square().mean().backward()
    rel = ((y - y_ref).float().norm() / y_ref.float().norm()).item()
    grad = ((fp8[0].weight.grad - ref[0].weight.grad).float().norm()
            / ref[0].weight.grad.float().norm()).item()
    print(f"\n{recipe}: output off by {rel:.4f}, weight grad by {grad:.4f} (relative)")
    assert rel < 0.1 and grad < 0.2


def test_pinned_prefetch_and_pinned_staging():
    from llmtrain.checkpoint.staging import ReusedBufferStager
    stager = ReusedBufferStager(cuda=True, share_memory=False)
    state = {"w": torch.randn(1024, 1024, device="cuda"), "step": 3}
    done = stager.stage(state)
    stager.start()
    staged = done.result()
    assert staged["w"].is_pinned() and torch.equal(staged["w"], state["w"].cpu())
    stager.close()


# deterministic kernels, so that a resumed run can match an uninterrupted one bit for bit
RESUME = (*GPU, "--parallelism.deterministic", "true", "--training.steps", "16",
          "--checkpoint.interval_steps", "8", "--metrics.log_every", "1")


def _weights(run_dir, step):
    return shard_read.load_unsharded(storage.step_dir(str(run_dir / "checkpoints"), step))["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference for the resume tests: 16 steps on the GPU, never interrupted."""
    run = tmp_path_factory.mktemp("resume") / "ref"
    check(llmtrain(run, *RESUME, nproc=1))
    return _weights(run, 16)


@pytest.mark.parametrize("fmt", ["raw", "dcp"])
def test_resume_on_the_gpu_is_bitwise_equal(tmp_path, uninterrupted, fmt):
    """A run killed right after its step-8 checkpoint commits (in the writer's retention
    pass: a kill at a fixed step raced the background write, and on a GPU's 10 ms steps
    lost) and resumed from it ends with the same weights, bit for bit, as one never
    interrupted; in either checkpoint format."""
    faulty = tmp_path / "faulty"
    check(llmtrain(faulty, *RESUME, "--checkpoint.format", fmt, "--reliability.faults",
                   "kill@retention:rank=0,step=8,restart=0", nproc=1,
                   torchrun_args=("--max-restarts", "1")))
    assert [e["step"] for e in events(faulty, "checkpoint_loaded")] == [8]
    got = _weights(faulty, 16)
    differ = [name for name in uninterrupted if not torch.equal(uninterrupted[name], got[name])]
    print(f"\nresumed run ({fmt}): {len(differ)} of {len(got)} tensors differ")
    assert not differ, differ


def _abort_and_rejoin(out: str) -> None:
    """One rank on NCCL with the warm path's settings: a collective queued behind a
    kernel that spins is never finished; the generation's failure key wakes the rank's
    FailureWatch, which aborts the communicators; the next collective raises into the
    recovery; the rank leaves the group, forms a new one on the same device, restores its
    snapshot of step 3 (pinned host memory) and trains steps 4-5 again."""
    from llmtrain.checkpoint.snapshots import Schedule, Snapshots
    from llmtrain.state_registry import state_tensors
    from llmtrain.distributed.failure import (FailureWatch, abandon, broke_a_collective,
                                              nccl_problems)
    from llmtrain.distributed.nccl_env import warm_worker_env
    warm_worker_env(os.environ)  # as llmtrain launch does, before the first communicator
    result = {"problems": nccl_problems()}
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True, use_libuv=True,
                           timeout=timedelta(seconds=60))
    world = WorldInfo(rank=0, world_size=1, local_rank=0, host="gpu")
    slow = ReliabilityConfig(collective_timeout_s=120)  # NCCL's own watchdog stays out

    def form(gen: int):
        return init_process_group(ParallelismConfig(device="cuda"), slow, world,
                                  dist.PrefixStore(f"g{gen}", server))
    device = form(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [torch.randn(32, 256, generator=torch.Generator().manual_seed(s)).to(device)
            for s in range(6)]

    def step(k: int) -> None:
        loss = model(data[k]).square().mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    snaps = Snapshots(Schedule(1), 0, buddy=None, ward=None, events=None)
    for k in range(3):
        step(k)
    snaps.take(3, state_tensors(model, optimizer, []), {})
    result["pinned"] = snaps.own.at(3).buffer.is_pinned()
    for k in (3, 4):
        step(k)
    reference = [p.detach().cpu().clone() for p in model.parameters()]

    watch = FailureWatch(lambda: dist.TCPStore("127.0.0.1", port, is_master=False,
                                                use_libuv=True), "g0/failed")
    torch.cuda._sleep(int(3e9))  # a few seconds of spinning, ahead of the collective
    stuck = dist.all_reduce(torch.ones(1, device=device), async_op=True)
    began = time.monotonic()
    server.set("g0/failed", "1")  # a peer's report, as the warm path's first reporter sets it
    error = None
    while error is None and time.monotonic() - began < 60:
        try:
            dist.all_reduce(torch.ones(1, device=device), async_op=True)
            time.sleep(0.05)
        except Exception as e:  # the aborted communicator refuses the next collective
            error = e
    result["woke"] = watch.woke.is_set()
    result["raised_s"] = time.monotonic() - began
    result["error"] = f"{type(error).__name__}: {error}"[:300]
    result["collective_failure"] = error is not None and broke_a_collective(error)
    result["stuck_completed"] = stuck.is_completed()
    abandon()
    torch.cuda.synchronize()  # the spin ends; the aborted collective's kernel returns
    began = time.monotonic()
    form(1)
    result["new_group_s"] = time.monotonic() - began
    snap = snaps.own.at(3)
    snap.verify()
    snap.restore_into(state_tensors(model, optimizer, []))
    for k in (3, 4):
        step(k)
    result["bitwise_equal"] = all(torch.equal(a, p.detach().cpu())
                                  for a, p in zip(reference, model.parameters()))
    with open(out, "w") as f:
        json.dump(result, f)
    abandon()


def test_a_stuck_nccl_collective_is_aborted_and_the_rank_steps_on_in_a_new_group(tmp_path):
    """The warm path's failure layer on one GPU (``_abort_and_rejoin``). What needs two or
    more GPUs (a peer that dies, the abort waking a rank blocked behind a healthy peer,
    the agreement across ranks) is covered by the gloo tests of the same code paths."""
    import multiprocessing
    out = str(tmp_path / "result.json")
    proc = multiprocessing.get_context("spawn").Process(target=_abort_and_rejoin, args=(out,))
    proc.start()
    proc.join(timeout=240)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the rank did not come back within 240 s: the abort did not free it")
    result = json.load(open(out))
    print(f"\nwarm path on NCCL {torch.cuda.nccl.version()}: {json.dumps(result)}")
    assert proc.exitcode == 0
    assert result["problems"] == [] and result["pinned"]
    assert result["woke"] and result["collective_failure"], result
    assert result["raised_s"] < 10, result  # the watch, not NCCL's 120 s timeout
    assert result["bitwise_equal"], result
