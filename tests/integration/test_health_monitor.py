"""A scripted GPU that goes bad under a running 2-rank gloo job takes its rank out."""

import socket
import time

import pytest

from conftest import events, llmtrain_start, wait_for_event
from nvml_states import healthy_gpu, write_script

from llmtrain.checkpoint import storage
from llmtrain.exit_codes import ExitCode
from llmtrain.reliability.health.exclusion import excluded_hosts


@pytest.mark.parametrize("checkpoints", ["on", "off"])
def test_gpu_turning_bad_mid_run_stops_its_rank_with_exclude(tmp_path, checkpoints):
    """The failed GPU's rank votes to stop, and every rank stops at the same step, saved
    there first when checkpoints are on; with them off too (the vote is the run
    control's, not the checkpoints'), and no rank waits for the watchdog."""
    run = tmp_path / "run"
    script = tmp_path / "gpus.json"
    gpus = [healthy_gpu(0), healthy_gpu(1)]
    write_script(script, {"gpus": gpus})
    proc = llmtrain_start(run, "--training.steps", "400", "--checkpoint.interval_steps", "1000",
                          "--health.script", str(script), "--health.interval_s", "0.3",
                          "--metrics.log_every", "5",
                          "--checkpoint.enable", "true" if checkpoints == "on" else "false",
                          nproc=2)
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

    # every rank stopped at the step the vote decided: rank 0 ended its run there
    stop_step = events(run, "stop_vote")[0]["step"]
    assert 20 <= stop_step < 400
    (end,) = events(run, "run_end")
    assert end["rank"] == 0 and end["steps"] == stop_step, (end, stop_step)
    assert not events(run, "hang")
    if checkpoints == "off":
        assert not (run / "checkpoints").exists()
        return
    # the checkpoint policy had its chance: the stop step was saved and committed
    assert stop_step in [c.step for c in storage.list_checkpoints(str(run / "checkpoints"))
                         if c.committed]
    assert not storage.verify(storage.step_dir(str(run / "checkpoints"), stop_step), checksums=True)
