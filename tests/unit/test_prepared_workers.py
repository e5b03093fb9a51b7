"""The hand-off between torchrun's child and a prepared worker, with real processes: the
attempt's command, environment and stdio reach the worker; its exit code, a signal that
killed it and the signals sent to the hand-off pass through; a hand-off with no prepared
worker runs the command itself; a worker whose hand-off died is killed; each prepared
worker takes one attempt; a waiting worker is no stray on its GPU."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import process_state
from nvml_states import node, write_script
from llmtrain.config import HealthConfig
from llmtrain.process_origin import PREPARED_DIR_ENV, waiting_workers
from llmtrain.reliability.health.checks import Backend, HealthChecker
from llmtrain.reliability.health.nvml_scripted import ScriptedNVML
from llmtrain.launch.template import Template, TemplateConfig
from llmtrain.launch.prepared import (FOLDER_PREFIX, HANDOFF, PreparedConfig, PreparedWorkers,
                                      new_folder)

SCRIPT = """
import os, signal, sys, time
print("pid", os.getpid(), "tag", os.environ.get("TAG"), "args", sys.argv[1:], flush=True)
print("cwd", os.getcwd(), "prepared", os.environ.get("LLMTRAIN_HANDED_OVER_AT") is not None,
      flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(os.environ.get("ON_TERM", 3))))
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "wait":
    open(sys.argv[2], "w").close()  # ready
    while True:
        time.sleep(0.05)
if mode == "raise":
    raise ValueError("boom")
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    p = tmp_path / "job.py"
    p.write_text(SCRIPT)
    return p


@pytest.fixture(scope="module")
def template():
    t = Template(TemplateConfig())
    yield t
    t.close()


@pytest.fixture(params=["fresh", "forked"])
def prepared(request, tmp_path: Path):
    """A node's prepared workers: each a fresh process, or (as ``llmtrain launch`` starts
    them) forked from the node's template."""
    spawn = (request.getfixturevalue("template").spawn if request.param == "forked"
             else subprocess.Popen)
    workers = PreparedWorkers(PreparedConfig(local_ranks=1, import_delay_s=0),
                              str(tmp_path / "prepared"), dict(os.environ), spawn)
    yield workers
    workers.close()


def handoff(folder: str, script: Path, *args: str, cwd: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-I", "-S", HANDOFF, folder, str(script), *args],
                            cwd=cwd, env={**os.environ, "LOCAL_RANK": "0", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def said(proc: subprocess.Popen) -> dict[str, str]:
    out, err = proc.communicate(timeout=120)
    words = out.split()
    return {"pid": int(words[words.index("pid") + 1]), "out": out, "err": err}


def test_the_attempt_runs_in_the_prepared_worker_and_its_exit_code_comes_back(
        prepared, script, tmp_path):
    first = handoff(prepared.folder, script, "exit", "7", cwd=tmp_path, TAG="one")
    got = said(first)
    assert first.returncode == 7, got
    assert "tag one" in got["out"] and f"cwd {tmp_path}" in got["out"], got
    assert "prepared True" in got["out"] and got["pid"] != first.pid
    # the next attempt goes to a successor, never to the same process
    second = handoff(prepared.folder, script, "raise", cwd=tmp_path, TAG="two")
    again = said(second)
    assert second.returncode == 1 and "ValueError: boom" in again["err"], again
    assert "prepared True" in again["out"] and again["pid"] != got["pid"]


def test_a_signal_to_the_hand_off_reaches_the_worker_and_a_kill_is_mirrored(
        prepared, script, tmp_path):
    ready = tmp_path / "ready"
    proc = handoff(prepared.folder, script, "wait", str(ready), cwd=tmp_path, ON_TERM="5")
    _wait_file(ready)
    proc.send_signal(signal.SIGTERM)  # torchrun stopping its workers
    assert said(proc) and proc.returncode == 5
    ready.unlink()
    proc = handoff(prepared.folder, script, "wait", str(ready), cwd=tmp_path)
    _wait_file(ready)
    worker = int((Path(prepared.folder) / f"{proc.pid}.worker").read_text())
    os.kill(worker, signal.SIGKILL)  # the worker dies: its hand-off dies as it did
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_a_worker_whose_hand_off_was_killed_dies_even_when_stopped(prepared, script, tmp_path):
    ready = tmp_path / "ready"
    proc = handoff(prepared.folder, script, "wait", str(ready), cwd=tmp_path)
    _wait_file(ready)
    worker = int((Path(prepared.folder) / f"{proc.pid}.worker").read_text())
    os.kill(worker, signal.SIGSTOP)  # hung: it cannot see its hand-off die
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the stopped worker outlived its hand-off"


def test_with_no_prepared_worker_the_hand_off_runs_the_command_itself(script, tmp_path):
    proc = handoff(str(tmp_path / "nobody"), script, "exit", "4", cwd=tmp_path, TAG="x")
    got = said(proc)
    assert proc.returncode == 4 and "prepared False" in got["out"], got
    assert got["pid"] == proc.pid  # exec'd: the same process


def test_a_waiting_worker_is_the_nodes_own_not_a_stray_on_its_gpu(
        prepared, script, tmp_path, monkeypatch):
    """A prepared worker holds a CUDA context on its GPU while it waits: the health
    checks know it by its file in the node's folder and call only others strays; once it
    takes an attempt the file is gone (the attempt is the checking process itself)."""
    monkeypatch.setenv(PREPARED_DIR_ENV, prepared.folder)
    deadline = time.monotonic() + 120
    while not waiting_workers():
        assert time.monotonic() < deadline, "the prepared worker never said it waits"
        time.sleep(0.02)
    (worker,) = waiting_workers()
    assert worker == prepared._procs[0].pid
    state = node(2)
    state["gpus"][1]["processes"] = [{"pid": worker, "used_memory_mib": 612},
                                     {"pid": os.getppid(), "used_memory_mib": 900}]
    write_script(tmp_path / "gpus.json", state)
    checker = HealthChecker(HealthConfig(), Backend(ScriptedNVML(str(tmp_path / "gpus.json"), "n"),
                                                    "scripted"), host="n")
    (f,) = [f for f in checker.gpus()[0] if f.check == "stray_processes" and f.gpu == 1]
    assert f.severity == "fatal" and f"pid {os.getppid()} (900 MiB)" in f.message, f
    assert f"pid {worker}" not in f.message, f
    got = said(handoff(prepared.folder, script, "exit", "0", cwd=tmp_path))
    assert got["pid"] == worker and worker not in waiting_workers()


def _wait_file(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return process_state(f"/proc/{pid}/stat") != "Z"
    except OSError:
        return False


def test_a_new_folder_removes_those_of_launchers_that_are_gone(tmp_path, monkeypatch):
    """A launcher killed with its node (SIGKILL) leaves its hand-off folder behind; the
    next launcher on the node removes it, but never a live launcher's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{FOLDER_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{FOLDER_PREFIX}{os.getppid()}-def"
    other = tmp_path / f"{FOLDER_PREFIX}notapid"
    for folder in (gone, live, other):
        folder.mkdir()
        (folder / "0.sock").write_text("")
    made = Path(new_folder())
    assert made.parent == tmp_path and made.name.startswith(f"{FOLDER_PREFIX}{os.getpid()}-")
    assert not gone.exists() and live.exists() and other.exists()
