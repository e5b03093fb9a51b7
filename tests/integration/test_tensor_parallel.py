"""Tensor parallelism with FSDP (``parallelism.tp``) on 4 gloo ranks: the same training as
data parallelism, resumes that end bitwise equal, checkpoints that load at other layouts,
and warm recovery with a tp group on each of 2 "nodes". One reference run (tp 2, each tp
group an HSDP replica of its own) serves every test."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, check, events, llmtrain, step_losses, wait_for_event
from llmtrain.checkpoint import storage
from llmtrain.checkpoint.shard_read import ShardReader
from llmtrain.config import load_config
from llmtrain.exit_codes import ExitCode
from ranks import spawn
from test_checkpoint import assert_bitwise_equal, final_weights
from test_hf import transformers_agree

pytestmark = pytest.mark.slow

STEPS = 50
# global batch 16: tp 2 x dp 2 takes two micro-batches of 4 per step, dp 4 one
BATCH = ("--training.micro_batch_size", "4", "--metrics.log_every", "1")
# each tp group a replica (HSDP): a node lost whole drops a replica, the other goes on
TP2 = ("--parallelism.tp", "2", "--parallelism.deterministic", "true",
       "--parallelism.dp_replicate", "-1", "--parallelism.dp_shard", "1")
CKPT = ("--checkpoint.interval_steps", "10", "--checkpoint.keep_every", "10",
        "--warm.snapshot_every", "10")
# a run cut short of STEPS on the reference's LR schedule: its steps are the reference's
SHORT = ("--optim.decay_steps", str(STEPS))


def train(run: Path, *args: str, steps: int = STEPS, **kwargs) -> str:
    return check(llmtrain(run, "--training.steps", str(steps), *BATCH, *args, nproc=4,
                          **kwargs)).stdout


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> tuple[Path, str]:
    """tp 2 x 2 replicas, 50 steps, every loss logged, a checkpoint every 10 steps, all
    kept."""
    run = tmp_path_factory.mktemp("tp") / "tp2"
    return run, train(run, *TP2, *CKPT)


def test_tp2_dp2_trains_as_dp4(tmp_path, tp_run):
    """Same global batch, same samples: tensor parallelism splits each matmul's sums over
    two ranks, so the losses differ from data parallelism's only by float32 reduction
    order. Tolerance: the one the one- and two-rank runs of test_train.py share (rel 2e-4;
    the two layouts differed by at most 5e-6 over these 50 steps on a 2-core Xeon)."""
    run, stdout = tp_run
    assert "4 rank(s) (mesh dp_replicate 2 x dp_shard 1 x tp 2) on cpu (gloo)" in stdout
    train(tmp_path / "dp4", "--checkpoint.enable", "false")
    dp, tp = step_losses(tmp_path / "dp4"), step_losses(run)
    assert sorted(tp) == sorted(dp) == list(range(1, STEPS + 1))
    for step in tp:
        assert tp[step] == pytest.approx(dp[step], rel=2e-4), step
    assert tp[STEPS] < tp[1] - 2.0  # and they did train
    # the blocks really are split over the tp ranks: the row-wise wo's pieces in the
    # checkpoint are cut along its columns (FSDP alone cuts rows only)
    md = ShardReader(storage.step_dir(str(run / "checkpoints"), 10)).read_metadata()
    chunks = md.state_dict_metadata["model.layers.0.attention.wo.weight"].chunks
    assert sorted({c.offsets[1] for c in chunks}) == [0, 64]
    assert sorted({c.offsets[0] for c in chunks}) == [0]  # (one shard per replica)


def test_a_tp_run_resumed_after_a_kill_ends_bitwise_equal(tmp_path, tp_run):
    """Rank 3 killed at step 14: torchrun restarts the job, which resumes from checkpoint
    10 with the same layout and, at step 20, holds the uninterrupted run's weights of step
    20, bit for bit."""
    run = tmp_path / "killed"
    train(run, *TP2, *CKPT, *SHORT, "--reliability.faults",
          "kill@step:rank=3,step=14,restart=0", max_restarts=1,
          steps=20)
    assert [e["step"] for e in events(run, "checkpoint_loaded")] == [10]
    assert_bitwise_equal(final_weights(tp_run[0], 20), final_weights(run, 20))


@pytest.fixture(scope="module")
def fp8_dcp_run(tmp_path_factory) -> Path:
    """tp 2 x 2 replicas with FP8 linears, 10 steps, the replicas' states fingerprinted
    every 5; its checkpoint of step 10 in torch's stock DCP format."""
    run = tmp_path_factory.mktemp("tp") / "fp8_dcp"
    train(run, *TP2, *CKPT, "--checkpoint.format", "dcp", "--parallelism.fp8", "tensorwise",
          "--integrity.sdc_every", "5", steps=10)
    return run


@pytest.mark.parametrize("fmt, layout", [("raw", (4, 1)), ("raw", (2, 2)), ("dcp", (4, 1))],
                         ids=["raw-tp1_dp4", "raw-tp2_dp1", "dcp-tp1_dp4"])
def test_a_tp2_dp2_checkpoint_loads_at_another_layout_with_equal_values(
        layout, fmt, tp_run, fp8_dcp_run, tmp_path):
    """Loaded into the model sharded at tp 1 x dp 4 or tp 2 x dp 1 (as a resume loads it),
    every weight, gathered whole, equals the checkpoint's value read with no process
    group: DCP reshards the tp 2 x dp 2 pieces onto the new ones."""
    nproc, tp = layout
    root = (tp_run[0] if fmt == "raw" else fp8_dcp_run) / "checkpoints"
    url = storage.step_dir(str(root), 10)
    spawn(load_at_layout, args=(nproc, str(tmp_path / "store"), url,
                                ["--parallelism.tp", str(tp), "--training.micro_batch_size", "1"]),
          nprocs=nproc)


def load_at_layout(rank: int, world: int, store: str, url: str, overrides: list[str]) -> None:
    """One rank of :func:`test_a_tp2_dp2_checkpoint_loads_at_another_layout_with_equal_values`:
    loads the checkpoint at ``url`` into llmtrain's model sharded at this layout (the world
    size and the ``--parallelism.tp`` in ``overrides``), as a resume does; rank 0 then
    checks that every weight, gathered whole, equals the checkpoint's value read with no
    process group. Every rank fails when rank 0 names a weight that differs."""
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from llmtrain import sharded_model
    from llmtrain.checkpoint.shard_read import load_unsharded
    from llmtrain.config import parse_overrides
    from llmtrain.distributed.process_group import build_mesh

    torch.set_num_threads(1)
    cfg = load_config("debug_cpu", parse_overrides(overrides))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    cpu = torch.device("cpu")
    mesh = build_mesh(cpu, cfg.mesh_shape(world), 60.0, cfg.parallelism.tp)
    model = sharded_model.build(cfg, mesh, cpu, lambda part: contextlib.nullcontext()).model
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=ShardReader(url))
    whole = {name: value.full_tensor() if isinstance(value, DTensor) else value
             for name, value in state["model"].items()}
    differ: list[str] = []
    if rank == 0:
        saved = load_unsharded(url)["model"]
        differ = sorted(name for name in saved.keys() | whole.keys() if name not in whole
                        or name not in saved or not torch.equal(saved[name], whole[name]))
    # every rank leaves with rank 0's verdict, and none before rank 0 has given it: a peer
    # that tore down its gloo connections while rank 0 still compared made another abort
    verdict = torch.tensor([len(differ)])
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    assert differ == [] and verdict.item() == 0, f"mesh {tuple(mesh.shape)}: differ {differ}"


def test_a_tp_checkpoint_resumes_a_data_parallel_run(tmp_path, tp_run):
    """llmtrain's own resume of the tp 2 x dp 2 checkpoint of step 10 at tp 1 x dp 4
    (planned: the layouts differ): its losses to step 20 follow the tp run's."""
    other = tmp_path / "dp4"
    shutil.copytree(tp_run[0] / "checkpoints", other / "checkpoints")
    for step in range(20, STEPS + 1, 10):
        storage.remove(storage.step_dir(str(other / "checkpoints"), step))
    train(other, "--checkpoint.enable", "true", *SHORT, steps=20)
    loaded = events(other, "checkpoint_loaded")
    assert [(e["step"], e["planned_ranks"]) for e in loaded] == [(10, [0, 1, 2, 3])]
    ref, got = step_losses(tp_run[0]), step_losses(other)
    assert sorted(got) == list(range(11, 21))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=2e-4), step


def test_fp8_with_hsdp_and_tensor_parallel_trains(fp8_dcp_run, tp_run):
    """torchao float8 (tensorwise) linears split by the TP plan, on a 3-D mesh (two HSDP
    replicas of a tp 2 group): on gloo, which has no float8 dtype, with torch's column-
    and row-wise styles (FP8 matmuls, collectives in float32; a GPU's take torchao's FP8
    styles). It trains, and not as fp32 does: its losses are its own; the replicas'
    states, fingerprinted every 5 steps, agree."""
    run = fp8_dcp_run
    assert events(run, "state_check_failed") == []
    fp8, fp32 = step_losses(run), step_losses(tp_run[0])
    assert sorted(fp8) == list(range(1, 11))
    assert fp8[10] < fp8[1] - 1.0
    assert any(fp8[step] != fp32[step] for step in fp8)


def test_a_tp_checkpoint_exports_to_hf(tmp_path, tp_run):
    """``ckpt export --to hf`` of the tp 2 x dp 2 checkpoint: transformers' Llama gives
    our model's logits from it."""
    ckpt = storage.step_dir(str(tp_run[0] / "checkpoints"), 10)
    out = tmp_path / "hf"
    check(subprocess.run([sys.executable, "-m", "llmtrain", "ckpt", "export", ckpt,
                          "--to", "hf", str(out)], capture_output=True, text=True, cwd=ROOT))
    transformers_agree(ckpt, out, load_config("debug_cpu").model)


def test_compiled_tensor_parallel_blocks_give_eager_gradients(tmp_path, tp_run):
    """torch.compile with TP compiles each block's attention and MLP (selectively
    checkpointed inside), not the sequence-parallel norms: compiled whole, a block gave
    a first grad norm of 4.13 where eager TP gives 4.80. Here tp 2 on 2 ranks (two
    micro-batches of 8, the same 16 sequences a step) follows the eager tp 2 x dp 2 run's
    losses and grad norms (the first 3 steps: the learning rate warms up over 20 steps
    whatever the run's length). (An inductor cache of its own: a cache other runs had written
    once served artifacts that gave wrong gradients.)"""
    run = tmp_path / "compiled"
    check(llmtrain(run, "--training.steps", "3", "--parallelism.tp", "2",
                   "--parallelism.compile", "true", "--parallelism.activation_checkpoint",
                   "selective", "--training.micro_batch_size", "8", "--metrics.log_every",
                   "1", "--checkpoint.enable", "false", nproc=2, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}))
    eager = {e["step"]: e for e in events(tp_run[0], "step")}
    got = {e["step"]: e for e in events(run, "step")}
    assert sorted(got) == [1, 2, 3]
    for step, e in got.items():
        assert e["loss"] == pytest.approx(eager[step]["loss"], rel=2e-4), step
        assert e["grad_norm"] == pytest.approx(eager[step]["grad_norm"], rel=2e-4), step


def test_warm_recovery_with_a_tp_group_on_each_node(cluster, tp_run):
    """The reference job on 2 "nodes" of 2 ranks (a tp group, a replica, each) and a
    standby node of 2 warm spares, one per device. One worker of node2 is killed at step
    12: its place goes to a spare, which takes that rank's pieces of the snapshot of step
    10 from its buddy's replica; checkpoint 20 is bit for bit the reference's. Then node2
    dies whole: its other rank goes to the standby node's second spare, on the other
    device, and that node holds a whole tp group. A few steps later node1 dies and no
    spare is left (the new generation snapshots at its first step):
    its replica is dropped and the other tp group goes on from its own memory (nothing
    sent, nothing read from storage), every later step's loss the reference's but for
    float32 reduction order (2 micro-batches a rank instead of 1)."""
    end = 40  # (the reference's schedule; steps after the shrink left to compare)
    c = cluster("1:2", ("--training.steps", str(end), *SHORT, *BATCH, *TP2, *CKPT,
                        "--metrics.address", "127.0.0.1", "--metrics.port", "0"))
    for name in ("node1", "node2"):
        c.start(name, "--nproc-per-node", "2")
    c.start("spare1", "--nproc-per-node", "2", spare=True)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 12,
                   timeout=180)
    victim, other = [e for e in events(c.run, "startup") if e["host"] == "node2"]
    os.kill(victim["pid"], signal.SIGKILL)
    spare = wait_for_event(c.run, "warm_recovery", c.nodes["node1"], timeout=120)
    assert (spare["kind"], spare["lost"], spare["joined"], spare["hosts_joined"]) == (
        "spare", [victim["rank"]], [victim["rank"]], {str(victim["rank"]): "spare1"}), spare
    wait_for_event(c.run, "checkpoint_committed", c.nodes["node2"],
                   where=lambda e: e["step"] >= 20, timeout=120)
    c.kill("node2")
    second = wait_for_event(c.run, "warm_recovery", c.nodes["node1"], timeout=120,
                            where=lambda e: e["gen"] == 2)
    assert (second["kind"], second["lost"], second["hosts_joined"]) == (
        "spare", [other["rank"]], {str(other["rank"]): "spare1"}), second
    wait_for_event(c.run, "startup", c.nodes["spare1"],
                   where=lambda e: e["host"] == "spare1" and e["rank"] == other["rank"])
    # one device each: the standby node's spares are bound to its local ranks
    assert sorted(e["local_rank"] for e in events(c.run, "startup")
                  if e["host"] == "spare1") == [0, 1]
    # a few steps for the snapshot of step 21, the new generation's first, to reach the
    # buddies (without it, the next snapshot is 30's, and the shrink below went cold)
    wait_for_event(c.run, "step", c.nodes["node1"], where=lambda e: e["step"] >= 25,
                   timeout=120)
    c.kill("node1")
    shrink = wait_for_event(c.run, "warm_recovery", c.nodes["spare1"], timeout=120,
                            where=lambda e: e["gen"] == 3)
    assert (shrink["kind"], shrink["world_size"], set(shrink["hosts_lost"].values())) == (
        "shrink", 2, {"node1"}), shrink
    assert c.wait("spare1") == ExitCode.CLEAN, c.log("spare1")
    # each spare rehearsed a step of the TP model while it waited (llmtrain.spare_rehearsal)
    said = (c.workdir / "spare1.log").read_text()
    assert said.count("warm spare: rehearsed a step as rank") == 2, said[:4000]
    assert len(events(c.run, "attempt_start")) == 1 and not events(c.run, "checkpoint_loaded")
    assert_bitwise_equal(final_weights(tp_run[0], 20), final_weights(c.run, 20))
    ref, got = step_losses(tp_run[0]), step_losses(c.run)
    assert sorted(got) == list(range(1, end + 1)) and shrink["step"] < end - 5, shrink
    for step in range(shrink["step"] + 1, end + 1):
        assert got[step] == pytest.approx(ref[step], rel=2e-4), step
    assert storage.verify(storage.step_dir(str(c.run / "checkpoints"), end),
                          checksums=True) == []
