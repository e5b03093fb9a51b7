"""The CUDA, NCCL, NVML and FP8 paths on a real GPU (one is enough): ``make gpu-check``.

Each test prints what it measured or found (``-s`` shows it); ``benchmarks/gpu.py`` does
the throughput, MFU, FP8 and checkpoint figures.
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, check, events, llmtrain, signed_store
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


# The GPU checks whose NVML queries a healthy GPU answers: "unknown" from one of them means
# the real pynvml path failed (a renamed call, a wrong constant, an error read as "not
# supported"), which the scripted backend cannot show. Any NVIDIA GPU with a driver of the
# last years (535+; an H200 needs 550+) reports its temperature, clock event reasons, PCIe
# link and compute processes; the data-center GPUs (HBM: A100 on) also their ECC counts
# (ECC is on as shipped: a training node with it off is itself misconfigured) and their
# row remapping (Ampere on). Left out, as a healthy H100/H200 may fairly say "unknown":
#   recovery_action: NVML_FI_DEV_GET_GPU_RECOVERY_ACTION is a field of recent drivers
#     only; an older driver answers NOT_SUPPORTED for it.
#   stray_processes, when NVML names a process of another PID namespace (in a container
#     it reports the host's PIDs): the query answered; whose the memory is cannot be told.
#   nvlink never says unknown (a GPU without links is ok). The node-level xid finding
#     (gpu None) is the kernel log's (dmesg restricted to root): not NVML's.
ANSWERED = ("xid", "pcie_link", "throttle", "temperature", "stray_processes")
ANSWERED_BY_DATACENTER_GPUS = ("ecc_volatile", "ecc_aggregate", "row_remap")
DATACENTER_GPU = re.compile(r"\b(A100|A800|H100|H800|H20|H200|GH200|B100|B200|GB200)\b")


def test_health_json_against_the_driver():
    """Every check runs against the real driver: none crashes, each GPU check is ok or
    unknown, and the checks a healthy GPU's NVML answers (``ANSWERED``) are not unknown,
    with real readings (temperature, power, PCIe width, ECC counts). First in this file:
    later tests hold GPU memory, which the stray-process check would rightly name. Node
    checks may warn about the machine (a VM without NTP)."""
    out = subprocess.run([sys.executable, "-m", "llmtrain", "health", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    report = json.loads(out.stdout)
    findings = report["findings"]
    print("\n" + "\n".join(f"{f['severity']:8} {f['check']:18} gpu={f.get('gpu')} "
                           f"{f['message'][:150]}" for f in findings))
    assert report["backend"] == "nvml", report["backend"]  # not CPU mode: NVML loaded
    assert {f["check"] for f in findings} >= {"gpu_count", "ecc_volatile", "xid", "pcie_link",
                                              "temperature", "stray_processes"}
    bad = [f for f in findings if f["gpu"] is not None and f["severity"] not in ("ok", "unknown")]
    assert not bad, bad
    gpus = sorted({f["gpu"] for f in findings if f["gpu"] is not None})
    assert gpus
    datacenter = DATACENTER_GPU.search(torch.cuda.get_device_name(0)) is not None
    must = ANSWERED + (ANSWERED_BY_DATACENTER_GPUS if datacenter else ())
    unanswered = [f for f in findings if f["gpu"] is not None and f["check"] in must
                  and f["severity"] == "unknown"
                  and not (f["check"] == "stray_processes" and "PID namespace" in f["message"])]
    assert not unanswered, unanswered
    for gpu in gpus:
        assert {f["check"] for f in findings if f["gpu"] == gpu} >= set(must), gpu
        values = report["readings"][str(gpu)]  # a field NVML did not answer is left out
        assert 5 <= values["temperature_c"] <= 110 and 5 < values["power_w"] < 2000, values
        assert 1 <= values["pcie_width"] <= values["pcie_width_max"] <= 32, values
        assert isinstance(values["throttle"], dict) and "hw_slowdown" in values["throttle"]
        if datacenter:
            assert values["ecc_volatile"] >= 0 and values["ecc_aggregate"] >= 0, values


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
    from llmtrain.distributed.flight_recorder import flight_recorder
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
    assert len(passes) >= seconds / 2
    # each pass read the GPU's values through NVML (a field it did not answer is left out)
    assert {"temperature_c", "power_w", "pcie_width", "throttle"} <= set(passes[-1][gpu]), \
        passes[-1]


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


# -- FP8 through llmtrain's own build: meta, parallelize (FP8, FSDP2), materialize -------

BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


@pytest.fixture(scope="module")
def mesh(nccl):
    """The one-rank NCCL group's FSDP mesh, made as a run makes it."""
    from llmtrain.distributed.process_group import build_mesh
    return build_mesh(nccl, (1, 1), collective_timeout_s=120)


def gpu_config(**parallelism: str):
    from llmtrain.config import load_config
    return load_config("debug_cpu", [("parallelism.device", "cuda"),
                                     ("parallelism.param_dtype", "bfloat16"),
                                     *((f"parallelism.{k}", v) for k, v in parallelism.items())])


def built(mesh, **parallelism: str):
    """The debug model as ``llmtrain train`` builds it on this GPU (sharded_model.build)."""
    import contextlib

    from llmtrain.sharded_model import build
    return build(gpu_config(**parallelism), mesh, torch.device("cuda", torch.cuda.current_device()),
                 lambda name: contextlib.nullcontext())


def train_step(sharded, seed: int) -> float:
    """One step as the trainer takes it: forward, loss, backward, optimizer step, and the
    FP8 weights' scales precomputed when they are all-gathered in FP8; its loss."""
    import torch.nn.functional as F

    from llmtrain.distributed.parallelize import precompute_fp8_scales
    tokens = torch.randint(0, 256, (4, 65), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(seed))
    logits = sharded.model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    sharded.optimizer.step()
    sharded.optimizer.zero_grad(set_to_none=True)
    if sharded.fp8_scales:
        precompute_fp8_scales(sharded.model)
    return loss.item()


def float8_linears(model) -> dict:
    from torchao.float8.float8_linear import Float8Linear
    return {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_through_llmtrains_build(mesh, recipe):
    """``parallelism.fp8`` through llmtrain's own build on the GPU (FSDP2 on one rank):
    every block projection is a torchao Float8Linear and the head is not; steps train
    with finite losses that differ from bf16's from the same weights (FP8 computes), but
    not by much. On one rank nothing is all-gathered, so the weights are not gathered in
    FP8 (``fp8_all_gather``; the next test takes that path)."""
    from torch import nn
    fp8, bf16 = built(mesh, fp8=recipe), built(mesh)
    n_layers = len(fp8.model.layers)
    assert set(float8_linears(fp8.model)) == {f"layers.{i}.{linear}" for i in range(n_layers)
                                              for linear in BLOCK_LINEARS}
    assert isinstance(fp8.model.output, nn.Linear) and "output" not in float8_linears(fp8.model)
    assert not float8_linears(bf16.model) and not fp8.fp8_scales
    losses = {name: [train_step(s, seed) for seed in (1, 2, 3)]
              for name, s in (("fp8", fp8), ("bf16", bf16))}
    print(f"\n{recipe}: FP8 losses {losses['fp8']}, bf16 {losses['bf16']}")
    assert all(math.isfinite(loss) for loss in losses["fp8"]), losses
    assert losses["fp8"] != losses["bf16"], losses  # the same numbers: FP8 did nothing
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=0.05), losses


def test_fp8_weights_all_gathered_in_fp8_with_precomputed_scales(mesh):
    """Tensorwise FP8 over 2+ shards: FSDP2 all-gathers the weights in FP8 (torchao's
    pre/post all-gather hooks), their scales precomputed in one pass after each optimizer
    step. ``parallelize`` takes that path only when the mesh has 2+ shards, which one GPU
    cannot give: here llmtrain's ``apply_fp8`` is told a 2-way shard dim (what parallelize
    passes it on 2+ GPUs), then ``parallelize`` (FP8 already applied) shards the model on
    the one-rank mesh. FSDP2 runs the same hooks at one rank (a copy in place of the
    collective). The weights reach the matmuls as FP8 tensors; the precomputed scales are
    those of the weights as stepped; the losses are finite and FP8's on one shard."""
    from dataclasses import replace

    from torchao.float8.float8_training_tensor import Float8TrainingTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from llmtrain.distributed.parallelize import apply_fp8, fp8_all_gather, parallelize
    from llmtrain.model import Transformer
    from llmtrain.optim import build_optimizer, lr_schedule
    from llmtrain.sharded_model import ShardedModel
    cfg = gpu_config(fp8="tensorwise")
    p = cfg.parallelism
    assert fp8_all_gather(p, "cuda", 2) and not fp8_all_gather(p, "cuda", mesh.shape[-1])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    apply_fp8(model, p, "cuda", 2)
    model = parallelize(model, mesh, replace(p, fp8="none"))
    model.to_empty(device=torch.device("cuda", torch.cuda.current_device()))
    model.init_weights(cfg.training.seed)
    optimizer = build_optimizer(model, cfg.optim)
    gathered = ShardedModel(model, optimizer, lr_schedule(optimizer, cfg.optim, 10), True)
    linears = float8_linears(model)
    assert len(linears) == len(model.layers) * len(BLOCK_LINEARS)
    # (the DTensor's own local tensor: to_local() with grad on gives a view, a new wrapper)
    assert all(isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
               for m in linears.values())
    seen = []  # what each projection's forward gets as its weight: FSDP's gathered one
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append(m.weight))
             for m in linears.values()]
    losses = [train_step(gathered, 1)]
    for hook in hooks:
        hook.remove()
    assert len(seen) == len(linears)
    assert all(isinstance(w, Float8TrainingTensor) and w._data.dtype == torch.float8_e4m3fn
               for w in seen), {type(w).__name__ for w in seen}
    for name, m in linears.items():  # precomputed after the step, from the stepped weights
        scale = m.weight._local_tensor._precomputed_scale
        amax = m.weight._local_tensor.abs().max().double()
        assert scale is not None, name
        torch.testing.assert_close(scale, (torch.finfo(torch.float8_e4m3fn).max / amax).float(),
                                   rtol=1e-6, atol=0)
    losses += [train_step(gathered, seed) for seed in (2, 3)]  # with those scales
    one_shard = built(mesh, fp8="tensorwise")
    reference = [train_step(one_shard, seed) for seed in (1, 2, 3)]
    print(f"\nFP8 all-gathered: losses {losses}; FP8 on one shard {reference}")
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses == pytest.approx(reference, rel=0.02), (losses, reference)


def test_the_tp_plan_at_tp_1_with_torchaos_fp8_styles(mesh):
    """The tensor-parallel path on the one GPU: a mesh whose ``tp`` dim has one rank, the
    tensorwise FP8 projections split by torchao's ``Float8ColwiseParallel`` and
    ``Float8RowwiseParallel`` (the styles a TP job takes on GPUs, which gloo cannot run),
    FSDP2 over ``dp_shard``, the loss under ``loss_parallel`` as the trainer takes it. Three
    steps train with finite losses close to FP8's without TP from the same weights (one
    rank's split is the whole: FP8's scales and the sums' order aside, the same numbers).
    What one GPU cannot show: TP's collectives across GPUs (NCCL), which have never run."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel,
                                                       Float8RowwiseParallel)

    from llmtrain.distributed.parallelize import _tp_styles
    tp_mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    tp = built(tp_mesh, fp8="tensorwise")
    block = next(iter(tp.model.layers.values()))
    wq = block.attention.wq
    assert _tp_styles(wq, "tensorwise", "cuda") == (Float8ColwiseParallel, Float8RowwiseParallel)
    assert wq.weight.device_mesh.mesh_dim_names == ("dp_shard", "tp")
    losses = []
    for seed in (1, 2, 3):
        tokens = torch.randint(0, 256, (4, 65), device="cuda",
                               generator=torch.Generator("cuda").manual_seed(seed))
        with loss_parallel():
            loss = F.cross_entropy(tp.model(tokens[:, :-1]).flatten(0, 1).float(),
                                   tokens[:, 1:].flatten())
            loss.backward()
        tp.optimizer.step()
        tp.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.full_tensor().item())
    no_tp = built(mesh, fp8="tensorwise")
    reference = [train_step(no_tp, seed) for seed in (1, 2, 3)]
    print(f"\nTP at tp 1, torchao's FP8 styles: losses {losses}; without TP {reference}")
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses == pytest.approx(reference, rel=0.02), (losses, reference)


# A warm spare's rehearsal of a step (llmtrain.spare_rehearsal), in a process of its own
# as a spare is (this module's NCCL group would make it stand down): FP8 and tp 2 as rank 1
# of a fake world of 4, on this GPU. What it prints is the GPU memory it left behind.
REHEARSAL = """
import json, torch, torch.distributed as dist
from llmtrain.config import load_config
from llmtrain.spare_rehearsal import rehearse
cfg = load_config("debug_cpu", [("parallelism.device", "cuda"), ("parallelism.fp8", "tensorwise"),
                                ("parallelism.param_dtype", "bfloat16"), ("parallelism.tp", "2")])
took = rehearse(cfg, 4, 1, 0)
print(json.dumps({"took": took, "group": dist.is_initialized(),
                  "allocated": torch.cuda.memory_allocated(),
                  "reserved": torch.cuda.memory_reserved()}))
"""


def test_a_spares_rehearsal_trains_its_step_on_the_gpu_and_leaves_no_group():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", REHEARSAL], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nrehearsal on the GPU: {said}")
    assert said["took"] is not None and not said["group"], (said, proc.stderr[-4000:])


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
                   max_restarts=1))
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
    from llmtrain.distributed.failure import (FailureWatch, abandon, abort_groups,
                                              broke_a_collective, nccl_problems)
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

    # the watch reads the job's store as a member does: only a value signed with the job's
    # secret (the tests' own, from conftest) wakes it
    aborting: list[float] = []

    def abort(_store) -> None:  # the watch's own action, timed
        aborting.append(time.monotonic())
        abort_groups()
        aborting.append(time.monotonic())
    watch = FailureWatch(lambda: signed_store(dist.TCPStore("127.0.0.1", port, is_master=False,
                                                             use_libuv=True)), "g0/failed",
                         on_failure=abort)
    # ~5 s of spinning (at an H100/H200's 2 GHz) ahead of the collective, which stays
    # queued behind it: the watch must start the abort long before the spin ends
    spin = time.monotonic()
    torch.cuda._sleep(int(1e10))
    stuck = dist.all_reduce(torch.ones(1, device=device), async_op=True)
    began = time.monotonic()
    # a peer's report, signed, as the warm path's first reporter sets it
    signed_store(server).set("g0/failed", "1")
    error = None
    while error is None and time.monotonic() - began < 60:
        try:
            dist.all_reduce(torch.ones(1, device=device), async_op=True)
            time.sleep(0.05)
        except Exception as e:  # the aborted communicator refuses the next collective
            error = e
    result["woke"] = watch.woke.is_set()
    result["raised_s"] = time.monotonic() - began
    result["abort_began_s"] = aborting[0] - began if aborting else None
    result["abort_call_s"] = aborting[1] - aborting[0] if len(aborting) == 2 else None
    torch.cuda.synchronize()
    result["spin_s"] = time.monotonic() - spin
    result["error"] = f"{type(error).__name__}: {error}"[:300]
    result["collective_failure"] = error is not None and broke_a_collective(error)
    result["stuck_completed"] = stuck.is_completed()
    abandon()
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
    # the watch starts the abort at once (it waits on the store's side, not on the GPU) ...
    assert result["abort_began_s"] is not None and result["abort_began_s"] < 1.0, result
    # ... and NCCL's abort returns once the work queued ahead of the collective has ended:
    # ncclCommAbort synchronizes the communicator's streams, whose kernel waits for the
    # spin (seen on an H200: 5.09 s with a 5.05 s spin; on an H100, 1.55 s with 1.5 s).
    # On a real failure what is queued ahead is the step's own kernels (milliseconds)
    # and the collective's kernel, which the abort flag stops; never NCCL's 120 s timeout
    assert result["raised_s"] < result["spin_s"] + 5, result
    assert result["bitwise_equal"], result


def test_a_process_forked_from_the_template_makes_its_own_cuda_context(tmp_path):
    """``llmtrain launch``'s template imports torch, llmtrain, torchao's float8 and
    torch.compile's stack without initializing the CUDA driver, so that a worker forked
    from it can make its own context and run a kernel."""
    from llmtrain.launch.template import Forked, Template, TemplateConfig
    script = tmp_path / "cuda_child.py"
    script.write_text("import torch\nx = torch.ones(4, device='cuda') * 2\n"
                      "torch.cuda.synchronize()\nprint('ok', x.sum().item(), flush=True)\n")
    template = Template(TemplateConfig(compiled=True, fp8=True))
    try:
        started = time.monotonic()
        proc = template.spawn([sys.executable, str(script)], env=dict(os.environ))
        assert isinstance(proc, Forked), "the template did not fork it"
        assert proc.wait(timeout=300) == 0, "a forked child could not use CUDA"
        print(f"forked CUDA child: {time.monotonic() - started:.1f} s from the request")
    finally:
        template.close()
