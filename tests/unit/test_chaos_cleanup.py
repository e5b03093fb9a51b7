"""Chaos tools end what they start, whatever way they end (llmtrain/chaos/runner.py,
local_cluster.py, processes.py): a local cluster ends even a process that left its
tree, and a chaos run stopped by SIGTERM or Ctrl-C leaves no process, FUSE mount or
network namespace behind."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, process_state
from needs import unavailable

from llmtrain.chaos.local_cluster import LocalCluster
from llmtrain.chaos.mount import fuse_mounts, fuse_problem


def _alive(pid: int) -> bool:
    try:
        state = process_state(f"/proc/{pid}/stat")
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has ended (its parent has yet to reap it)


def _processes_naming(text: str) -> list[str]:
    """The command lines that mention ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and _alive(int(entry.name)):
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


def _namespaces() -> set[str]:
    if shutil.which("ip") is None:  # (then chaos makes none)
        return set()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _own_namespaces(work: Path) -> str:
    """The prefix of the namespaces a chaos run in ``work`` made ("" on loopback): its
    hub's name in the nodes' hosts file, less ``-hub``. (Comparing every namespace before
    and after failed in CI: another test's run made its own meanwhile.)"""
    hosts = work / "netns" / "hosts"
    names = hosts.read_text().split() if hosts.exists() else []
    return next((n[:-len("hub")] for n in names if n.endswith("-hub")), "")


def test_a_cluster_ends_a_process_that_left_its_tree(tmp_path):
    """A worker whose launcher died first (a session of its own, its parent gone) is
    no longer under any node's tree: ``close`` finds it by the cluster's marker."""
    cluster = LocalCluster(tmp_path, tmp_path / "run", "1:1", ())
    try:
        stray = subprocess.run(
            [sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
             "[sys.executable, '-c', 'import time; time.sleep(300)'], "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, "
             "start_new_session=True).pid)"],
            env=cluster.env, capture_output=True, text=True, check=True)
        pid = int(stray.stdout)
        assert _alive(pid)
    finally:
        cluster.close()
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    assert cluster.store.poll() is not None


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_chaos_run_leaves_nothing_behind(tmp_path, signum):
    problem = fuse_problem()
    if problem:
        unavailable(problem)
    work = tmp_path / "chaos"
    code = ("from llmtrain.chaos.runner import Chaos, ChaosConfig; "
            f"Chaos(ChaosConfig(workdir={str(work)!r}, faults='hang', reference=False))"
            ".execute()")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:  # stopped once its nodes run, with its mount up (and its namespaces, as root)
        deadline = time.time() + 120
        while not (work / "node1.log").exists() and proc.poll() is None:
            assert time.time() < deadline, "chaos started no node within 120 s"
            time.sleep(0.2)
        time.sleep(2)  # the nodes' launchers under way
        assert str(work / "ckpt" / "mnt") in fuse_mounts()
        assert _processes_naming(str(work))
        own = _own_namespaces(work)
        assert not own or {f"{own}hub", f"{own}node1"} <= _namespaces()
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-3000:]
    assert not [m for m in fuse_mounts() if m.startswith(str(work))], out[-3000:]
    assert not own or not [n for n in _namespaces() if n.startswith(own)], out[-3000:]
    deadline = time.time() + 10
    while _processes_naming(str(work)) and time.time() < deadline:
        time.sleep(0.2)
    assert _processes_naming(str(work)) == [], out[-3000:]
