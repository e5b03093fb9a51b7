"""Compile once per job: the second start of a compiled run, on a "node" whose own inductor
cache is empty, loads what rank 0 compiled at the first start from the run dir (its record
signed with the job's secret), compiles nothing, and trains bitwise as the first did; both
starts compile into and load into the job's own inductor cache, not the node's."""

import os
import shutil

import pytest

from conftest import check, events, llmtrain

pytestmark = pytest.mark.slow

ARGS = ("--parallelism.compile", "true", "--training.steps", "2", "--metrics.log_every", "1",
        "--checkpoint.enable", "false")


def start(run, node_cache, compiler) -> tuple[list[dict], dict[int, float]]:
    """One start on a node whose local inductor cache is ``node_cache``, its host compiler
    ``compiler``: its ``compile_cache`` events, rank by rank, and its losses."""
    before = len(events(run, "compile_cache")) if (run / "events").exists() else 0
    check(llmtrain(run, *ARGS, nproc=2, env={"TORCHINDUCTOR_CACHE_DIR": str(node_cache),
                                             "CXX": str(compiler)}))
    began = events(run, "run_start")[-1]["ts"]
    losses = {e["step"]: e["loss"] for e in events(run, "step") if e["ts"] >= began}
    return sorted(events(run, "compile_cache")[before:], key=lambda e: e["rank"]), losses


def builds(log, node) -> list[str]:
    """What the host compiler's calls built into ``node``'s inductor cache (the model's
    kernels and inductor's probes of the CPU's vector ISA), relative to it: each call's
    ``-o``, whether it built or failed (``--version`` and other queries build nothing)."""
    calls = log.read_text().splitlines() if log.exists() else []
    outputs = [args[args.index("-o") + 1] for args in map(str.split, calls) if "-o" in args]
    return [os.path.relpath(out, node) for out in outputs if out.startswith(f"{node}/")]


def test_a_restart_on_a_fresh_node_loads_the_runs_compile_cache(tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "cxx.log"  # every call of the host compiler, on both "nodes"
    compiler = tmp_path / "g++"
    compiler.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {shutil.which("g++")} "$@"\n')
    compiler.chmod(0o755)
    first, first_losses = start(run, tmp_path / "node-a", compiler)
    assert builds(log, tmp_path / "node-a")  # what the check below would see
    assert [e["loaded"] for e in first] == [0, 0]
    assert all(e["graph_misses"] > 0 for e in first)  # compiled, nothing to hit
    assert [e["saved"] for e in first] == [True, False]  # rank 0 keeps it

    second, second_losses = start(run, tmp_path / "node-b", compiler)
    for e in second:  # every rank loaded rank 0's blob and compiled nothing anew
        assert e["loaded"] > 0 and e["ignored"] is None, e
        assert e["graph_misses"] == e["autograd_misses"] == 0 and e["graph_hits"] > 0, e
    # the C++ kernels too (torch's blob holds no CPU kernels): rank 0's bundle put them
    # on node b, ISA probes included, and the host compiler built none there; it only
    # tried again the probes it failed to build on node a too (an ISA it does not know)
    assert sum(e["kernels"] for e in second) > 0
    again = builds(log, tmp_path / "node-b")
    assert not [out for out in again if (tmp_path / "node-a" / out).exists()], again
    # all of it in the job's own inductor cache, none in the node's that other jobs load from
    assert all(out.startswith("llmtrain-job-") for out in builds(log, tmp_path / "node-a") + again)
    assert not list((tmp_path / "node-b").glob("??/*.so"))
    assert not second[0]["saved"]  # nothing new to keep
    assert second_losses == first_losses and len(first_losses) == 2
