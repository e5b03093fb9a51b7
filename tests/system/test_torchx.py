"""The torchx component (launchers/torchx_llmtrain.py): `torchx run` with the local_cwd
scheduler trains the debug model to completion through `llmtrain launch` (health gate,
torchrun, c10d rendezvous); the AppDef and the Slurm request it makes for nodes plus
spares; torchx's component linter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, events
from llmtrain.chaos.local_cluster import kill_tree
from llmtrain.checkpoint import storage
from llmtrain.distributed.process_group import free_port

COMPONENT = f"{ROOT / 'launchers' / 'torchx_llmtrain.py'}:train"
BIN = Path(sys.executable).parent
TRAIN = ("--checkpoint.interval_steps", "20", "--metrics.log_every", "10",
         "--metrics.address", "127.0.0.1", "--metrics.port", "0")


def torchx_run(tmp_path: Path, *component_args: str, train: tuple[str, ...] = (),
               timeout: float = 240) -> tuple[int, str]:
    """`torchx run -s local_cwd COMPONENT ARGS -- TRAIN` from the repository root, with the
    virtualenv's bin first on PATH (as with an activated venv); the exit code and output.
    The replicas' logs stay under tmp_path/torchx-logs."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [str(BIN / "torchx"), "run", "--scheduler", "local_cwd",
           "--scheduler_args", f"log_dir={tmp_path / 'torchx-logs'}",
           COMPONENT, *component_args, "--", *train]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"torchx run still running after {timeout} s\n{out[-6000:]}")
    return proc.returncode, out


def assert_trained(run: Path, steps: int, out: str) -> None:
    """The run ended at ``steps`` and its final checkpoint is committed and verifies."""
    ends = events(run, "run_end")
    assert ends and ends[-1]["steps"] == steps, out[-4000:]
    final = [c for c in storage.list_checkpoints(str(run / "checkpoints")) if c.committed][-1]
    assert final.step == steps
    assert storage.verify(final.url, checksums=True) == []


@pytest.mark.slow
def test_torchx_local_cwd_trains_the_debug_model_to_completion(tmp_path):
    run = tmp_path / "run"
    rc, out = torchx_run(tmp_path, "--nodes", "1", "--nproc_per_node", "2",
                         "--run_dir", str(run), train=("--training.steps", "40", *TRAIN))
    assert rc == 0, out[-6000:]
    assert "Job finished: SUCCEEDED" in out
    assert_trained(run, 40, out)
    # one node through `llmtrain launch`, under the app id torchx gave the job
    (launch,) = events(run, "node_launch")
    assert launch["nnodes"] == "1:1" and launch["rdzv_id"].startswith("llmtrain-")
    assert [e["exit_code"] for e in events(run, "node_exit")] == [0]
    assert [e["world_size"] for e in events(run, "attempt_start")] == [2]
    # one node cannot recover warm: its launcher says so once and its workers go cold
    assert out.count("warm recovery is off: the job has one node") == 1, out[-4000:]
    (off,) = events(run, "warm_path_off")
    assert off["rank"] is None and off["host"] == launch["host"]


@pytest.mark.slow
def test_torchx_runs_a_loop_of_the_users_own(tmp_path):
    """``--script``: examples/cnn_sgd.py (a plain loop on the public API), not llmtrain's
    trainer, runs under the component and ends with its final checkpoint committed."""
    run = tmp_path / "run"
    rc, out = torchx_run(tmp_path, "--nodes", "1", "--nproc_per_node", "2",
                         "--script", "examples/cnn_sgd.py", "--run_dir", str(run),
                         train=("--training.steps", "30", *TRAIN))
    assert rc == 0, out[-6000:]
    assert_trained(run, 30, out)
    (start,) = events(run, "run_start")
    assert start["world_size"] == 2, start
    assert "llmtrain: FSDPSequential model" in out, out[-4000:]  # the example's, not a Llama


@pytest.mark.slow
def test_torchx_two_nodes_and_a_spare_finish_cleanly(tmp_path):
    """Three replicas on this machine, each its own node, and the store role; two train,
    the spare waits warm (the default: the store role is outside every node), and every
    replica exits 0, the store once the launchers have ended."""
    run = tmp_path / "run"
    rc, out = torchx_run(tmp_path, "--nodes", "2", "--spares", "1", "--host", "node{replica_id}",
                         "--rdzv_port", str(free_port()), "--rdzv_bind", "127.0.0.1",
                         "--run_dir", str(run), train=("--training.steps", "20", *TRAIN))
    # the training itself is right whatever the spare does
    assert_trained(run, 20, out)
    assert [e["world_size"] for e in events(run, "attempt_start")] == [2]
    launches = {e["host"]: e.get("spare") for e in events(run, "node_launch")}
    assert launches == {"node0": None, "node1": None, "node2": "warm"}, launches
    assert not events(run, "warm_path_off")
    exits = {e["host"]: e["exit_code"] for e in events(run, "node_exit")}
    assert exits == {"node0": 0, "node1": 0, "node2": 0}, (exits, out[-6000:])
    assert rc == 0 and "all 3 launcher(s) ended; exiting" in out, out[-6000:]


def dryrun(scheduler: str, *component_args: str, cfg: dict | None = None):
    from torchx.runner import get_runner
    with get_runner() as runner:
        return runner.dryrun_component(COMPONENT, list(component_args), scheduler, cfg=cfg)


def test_dryrun_two_nodes_and_a_spare(tmp_path):
    info = dryrun("local_cwd", "--nodes", "2", "--spares", "1", "--max_restarts", "5",
                  "--max_retries", "2", "--host", "node{replica_id}", "--run_dir", "/shared/r",
                  "--", "--training.steps", "7", cfg={"log_dir": str(tmp_path)})
    store, role = info._app.roles
    assert (role.num_replicas, role.min_replicas, role.max_retries) == (3, 2, 2)
    assert (store.name, store.num_replicas, store.resource.gpu) == ("store", 1, 0)
    assert store.args[1] == "exec llmtrain rdzv-store --bind 0.0.0.0 --port 29500 " \
                            "--exit-when-unused"
    replicas = info.request.role_params[role.name]
    assert len(replicas) == 3

    # Each replica's command, run by bash with a stand-in `llmtrain` that prints its
    # arguments: the shell words come out as `llmtrain launch` must see them.
    fake = tmp_path / "bin" / "llmtrain"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    for i, replica in enumerate(replicas):
        assert replica.args[:2] == ["bash", "-c"]
        env = {**os.environ, **replica.env, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
        argv = json.loads(subprocess.run(replica.args, env=env, capture_output=True, text=True,
                                         check=True).stdout)
        assert ("--standby" in argv) == (i >= 2)  # the third replica is the spare
        assert "--external-store" in argv  # the warm path's condition
        argv = [a for a in argv if a not in ("--standby", "--external-store")]
        opts = dict(zip(argv[1::2], argv[2::2]))
        assert argv[0] == "launch"
        assert opts["--nnodes"] == "2:2" and opts["--nproc-per-node"] == "1"
        assert opts["--max-restarts"] == "5"
        assert opts["--rdzv-endpoint"] == "localhost:29500"  # the store role's host
        assert opts["--rdzv-id"] == info.request.app_id
        assert opts["--host"] == f"node{i}"
        assert opts["--config"] == "debug_cpu" and opts["--training.run_dir"] == "/shared/r"
        assert argv[-2:] == ["--training.steps", "7"]


def test_dryrun_single_node_external_store_and_defaults():
    (role,) = dryrun("local_cwd", "--run_dir", "r")._app.roles
    assert (role.num_replicas, role.min_replicas, role.max_retries) == (1, 1, 0)
    script = role.args[1]
    assert "--rdzv-endpoint localhost:0" in script  # one agent picks a free port
    assert '--host "$HOSTNAME"' in script and "--max-restarts 3" in script
    (role,) = dryrun("local_cwd", "--nodes", "4", "--min_nodes", "3", "--spares", "2",
                     "--rdzv_endpoint", "store.cluster:29400")._app.roles
    assert (role.num_replicas, role.min_replicas) == (6, 3)
    assert "--nnodes 3:4" in role.args[1]
    assert "--rdzv-endpoint store.cluster:29400 --external-store" in role.args[1]


def test_dryrun_slurm_one_het_group_per_replica_with_gpus():
    info = dryrun("slurm", "--nodes", "2", "--spares", "1", "--gpu", "8", "--max_retries", "2",
                  "--config", "llama3_8b", "--run_dir", "/shared/runs/8b")
    script = info.request.materialize()
    assert script.count("#SBATCH hetjob") == 3  # the store's group, then three nodes'
    assert script.count("--gpus-per-task=8") == 3 and "--exit-when-unused" in script
    assert "export TORCHX_MAX_RETRIES=2" in script
    assert script.count("--nproc-per-node 8") == 3  # one rank per GPU
    assert script.count("--metrics.address 0.0.0.0") == 3  # scraped from another host
    assert "${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}:29500" in script
    assert "--rdzv-id '\"$SLURM_JOB_ID\"'" in script


def test_component_passes_the_torchx_linter_and_rejects_bad_sizes():
    from torchx.specs.file_linter import validate
    assert validate(str(ROOT / "launchers" / "torchx_llmtrain.py"), "train") == []
    sys.path.insert(0, str(ROOT / "launchers"))
    try:
        from torchx_llmtrain import train
    finally:
        sys.path.remove(str(ROOT / "launchers"))
    with pytest.raises(ValueError, match="min_nodes"):
        train(nodes=2, min_nodes=3)
    with pytest.raises(ValueError, match="spares"):
        train(nodes=2, spares=-1)
