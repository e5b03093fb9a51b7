"""A node's template process (llmtrain.launch.template), with real processes: a forked
child is what ``python ARGV`` started with the same environment, folder, descriptors and
session would be; it shares no state with its template's other children; its exit code or
the signal that killed it comes back as Popen gives them; a command the template cannot
run, or a template that is gone, starts a fresh process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmtrain.launch.template import Forked, Template, TemplateConfig

CHILD = """
import json, os, random, signal, sys
import numpy, torch
import llmtrain
state = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
         "tag": os.environ.get("TAG"), "stray": os.environ.get("STRAY"),
         "sid": os.getsid(0) == os.getpid(), "stdin": sys.stdin.readline().strip(),
         "numpy": float(numpy.random.rand()), "random": random.random(),
         "torch_seed": torch.initial_seed(), "left": getattr(llmtrain, "left_by_a_sibling", None),
         "threads": torch.get_num_threads(),
         "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(bytes(1)).decode(),
         "comm": open("/proc/self/comm").read().strip(),
         "sighup": str(signal.getsignal(signal.SIGHUP)),
         "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
         "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))}
os.write(int(os.environ["OUT_FD"]), json.dumps(state).encode())
llmtrain.left_by_a_sibling = True  # what one child changes, the next never sees
torch.manual_seed(1234)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def template():
    """A template started as under ``nohup``: SIGHUP ignored."""
    hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        t = Template(TemplateConfig())
    finally:
        signal.signal(signal.SIGHUP, hup)
    yield t
    t.close()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    p = tmp_path / "sub" / "child.py"
    p.parent.mkdir()
    p.write_text(CHILD)
    return p


def run_child(template: Template, script: Path, code: int, **env) -> tuple[dict, object]:
    read, write = os.pipe()
    proc = template.spawn([sys.executable, str(script), str(code)],
                          env={**os.environ, "OUT_FD": str(write), "OMP_NUM_THREADS": "1",
                               **env},
                          stdin=subprocess.PIPE, text=True, pass_fds=(write,),
                          start_new_session=True)
    os.close(write)
    proc.stdin.write("hello\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == code
    with os.fdopen(read) as f:
        return json.loads(f.read()), proc


def test_a_forked_child_is_what_python_would_have_started(template, script, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("STRAY", "in the launcher only")
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "STRAY"}
    read, write = os.pipe()
    started = time.monotonic()
    proc = template.spawn([sys.executable, str(script), "3"],
                          env={**env, "OUT_FD": str(write), "TAG": "one",
                               "OMP_NUM_THREADS": "1"},
                          stdin=subprocess.PIPE, text=True, pass_fds=(write,),
                          start_new_session=True)
    os.close(write)
    assert isinstance(proc, Forked), "the template did not fork it"
    proc.stdin.write("hello\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 3 and proc.poll() == 3
    with os.fdopen(read) as f:
        got = json.loads(f.read())
    assert got["argv"] == [str(script), "3"] and got["cwd"] == str(tmp_path)
    assert got["path0"] == str(script.parent)  # the script's folder, as python makes it
    assert got["tag"] == "one" and got["stray"] is None  # its env, not the template's
    assert got["sid"] and got["stdin"] == "hello" and got["threads"] == 1
    # what ps and pgrep -f show: its own command, not its template's
    assert got["cmdline"].split() == [sys.executable, str(script), "3"], got["cmdline"]
    assert got["comm"] == Path(sys.executable).name[:15]
    # python's own SIGINT handler, an inherited ignore kept (nohup), nothing left blocked
    assert got["sigint"] and got["sighup"] == str(signal.SIG_IGN) and got["blocked"] == []
    assert time.monotonic() - started < 30


def test_children_share_nothing_made_by_a_sibling_and_draw_their_own_seeds(template, script):
    first, _ = run_child(template, script, 0)
    second, _ = run_child(template, script, 0)
    assert second["left"] is None  # the first's module attribute, and its manual seed:
    assert first["torch_seed"] != second["torch_seed"] != 1234  # each draws its own
    assert first["numpy"] != second["numpy"] and first["random"] != second["random"]


def test_a_signal_sent_as_soon_as_a_child_is_forked_is_not_lost(template, tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    for _ in range(3):
        proc = template.spawn([sys.executable, str(sleeper)], env=dict(os.environ))
        proc.terminate()  # before the child could have run a line of its own
        assert proc.wait(timeout=30) == -signal.SIGTERM


def test_a_signal_that_kills_a_child_comes_back_as_popen_gives_it(template, tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    proc = template.spawn([sys.executable, str(sleeper)], env=dict(os.environ))
    assert isinstance(proc, Forked)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.kill()  # once ended, a no-op (never a process that took its pid)


def test_a_module_runs_with_the_working_folder_first_on_its_path(template, tmp_path,
                                                                  monkeypatch):
    (tmp_path / "mymod.py").write_text(
        "import sys\nsys.exit(0 if sys.path[0] == %r else 9)\n" % str(tmp_path))
    monkeypatch.chdir(tmp_path)
    proc = template.spawn([sys.executable, "-m", "mymod"], env=dict(os.environ))
    assert isinstance(proc, Forked) and proc.wait(timeout=60) == 0


def test_what_the_template_cannot_run_starts_afresh(template):
    proc = template.spawn(["/bin/sh", "-c", "exit 4"], env=dict(os.environ))
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=30) == 4
    proc = template.spawn([sys.executable, "-c", "import sys; sys.exit(5)"],
                          env=dict(os.environ))
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=30) == 5


def test_a_template_killed_under_its_children_loses_no_child_and_is_not_used_again(tmp_path):
    t = Template(TemplateConfig())
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import sys, time\ntime.sleep(float(sys.argv[1]))\n")
    child = t.spawn([sys.executable, str(sleeper), "1.5"], env=dict(os.environ))
    assert isinstance(child, Forked)
    t.proc.kill()
    t.proc.wait()
    assert child.poll() is None  # it lives on; its end is still seen
    assert child.wait(timeout=30) == -signal.SIGKILL  # its own code was the template's
    after = t.spawn([sys.executable, str(sleeper), "0"], env=dict(os.environ))
    assert isinstance(after, subprocess.Popen) and after.wait(timeout=60) == 0
    t.close()


def test_a_fork_answered_after_its_request_gave_up_is_killed(tmp_path, caplog):
    """A template stopped (SIGSTOP, a paused node) past the fork timeout: the request
    starts a fresh process, and the child the template forks once it runs again is
    killed, so that no process runs twice."""
    t = Template(TemplateConfig(fork_timeout_s=1.0))
    sleeper = tmp_path / "late_sleeper.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    try:
        assert t.spawn([sys.executable, str(sleeper)], env=dict(os.environ)).kill() is None
        os.kill(t.proc.pid, signal.SIGSTOP)
        proc = t.spawn([sys.executable, str(sleeper)], env=dict(os.environ))
        assert isinstance(proc, subprocess.Popen)
        os.kill(t.proc.pid, signal.SIGCONT)
        # the next request gets its own child, never the late one
        other = tmp_path / "other.py"
        other.write_text("import time\ntime.sleep(60)\n")
        mine = t.spawn([sys.executable, str(other)], env=dict(os.environ))
        assert isinstance(mine, Forked)
        deadline = time.monotonic() + 30
        while _running(str(other)) != [mine.pid]:  # once it has taken its title
            assert time.monotonic() < deadline, (_running(str(other)), mine.pid)
            time.sleep(0.05)
        mine.kill()
        while "too late; killed" not in caplog.text:
            assert time.monotonic() < deadline, "the late fork was never answered"
            time.sleep(0.05)
        while set(_running(str(sleeper))) != {proc.pid}:
            assert time.monotonic() < deadline, _running(str(sleeper))
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    finally:
        os.kill(t.proc.pid, signal.SIGCONT)
        t.close()


def _running(text: str) -> list[int]:
    """The live (not zombie) processes whose command line names ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes()
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
