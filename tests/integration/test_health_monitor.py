"""A scripted GPU that goes bad under a running 2-rank gloo job takes its rank out."""

import socket
import time

from conftest import events, llmtrain_start, wait_for_event
from nvml_states import healthy_gpu, write_script

from llmtrain.checkpoint import storage
from llmtrain.exit_codes import ExitCode
from llmtrain.reliability.health.exclusion import excluded_hosts


def test_gpu_turning_bad_mid_run_stops_its_rank_with_exclude(tmp_path):
    run = tmp_path / "run"
    script = tmp_path / "gpus.json"
    gpus = [healthy_gpu(0), healthy_gpu(1)]
    write_script(script, {"gpus": gpus})
    proc = llmtrain_start(run, "--training.steps", "400", "--checkpoint.interval_steps", "1000",
                          "--health.script", str(script), "--health.interval_s", "0.3",
                          "--metrics.log_every", "5", nproc=2)
    try:
        wait_for_event(run, "step", proc, where=lambda e: e["step"] >= 20)
        gpus[1]["ecc"]["volatile"]["dram"] = 2  # rank 1's GPU (local rank 1) fails
        turned_bad = time.time()
        write_script(script, {"gpus": gpus})
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode != 0
    # torchrun names each worker's exit code: the failed GPU's rank asks for exclusion,
    # the healthy rank stops for a restart elsewhere
    assert f"exitcode  : {int(ExitCode.EXCLUDE_NODE)}" in err, err[-4000:]
    assert "ecc_volatile" in err and "GPU 1" in err

    (fatal,) = [e for e in events(run, "health") if e["severity"] == "fatal"]
    assert fatal["check"] == "ecc_volatile" and fatal["gpu"] == 1 and fatal["rank"] == 1
    assert "2 uncorrectable ECC error(s)" in fatal["message"]
    assert fatal["ts"] - turned_bad < 10  # seen within a few monitor intervals

    (excluded,) = events(run, "node_excluded")
    assert excluded["rank"] == 1 and excluded["source"] == "monitor"
    record = excluded_hosts(str(run))[socket.gethostname()]
    assert "ecc_volatile" in record["reason"] and record["rank"] == 1

    # the checkpoint policy had its chance: the stop step was saved and committed
    stop_step = events(run, "stop_vote")[0]["step"]
    assert 20 <= stop_step < 400
    assert stop_step in [c.step for c in storage.list_checkpoints(str(run / "checkpoints"))
                         if c.committed]
    assert not storage.verify(storage.step_dir(str(run / "checkpoints"), stop_step), checksums=True)
