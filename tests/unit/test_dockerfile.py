"""docker/Dockerfile, checked without a Docker engine: its instructions are parsed and held
to the rules of the cluster image, and its entry script is run with a stand-in
`llmtrain`."""

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

import needs
from conftest import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
CUDA_PYTORCH = ("pytorch/pytorch", "docker.io/pytorch/pytorch", "nvcr.io/nvidia/pytorch")


def instructions() -> list[tuple[str, str, int]]:
    """(INSTRUCTION, arguments, line) for each instruction of the Dockerfile: continuation
    lines joined, comment lines (also those inside a continuation) dropped."""
    out, buf, start = [], "", 0
    for n, line in enumerate(DOCKERFILE.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        keyword, _, args = (buf + stripped).partition(" ")
        out.append((keyword.upper(), args.strip(), start))
        buf = ""
    assert not buf, f"{DOCKERFILE}: a line continuation runs off the end of the file"
    return out


def of(kind: str) -> list[tuple[str, str, int]]:
    return [i for i in instructions() if i[0] == kind]


def test_from_pins_an_official_cuda_pytorch_image_matching_pyproject():
    froms = of("FROM")
    assert len(froms) == 1, "one stage keeps the image simple"
    assert instructions()[0][0] == "FROM"
    image = froms[0][1].split()[0]
    assert "$" not in image, "the base image is written out, not an ARG"
    name, sep, tag = image.partition("@")[0].rpartition(":")
    assert sep and name and "/" not in tag, f"{image}: pin a tag"
    assert tag != "latest"
    assert name in CUDA_PYTORCH, f"{name} is not an official CUDA PyTorch image"
    if "pytorch/pytorch" in name:
        assert re.search(r"-cuda\d+\.\d+-", tag), f"{tag} is not a CUDA build"
        # the base image's torch must satisfy pyproject's, or pip would replace it
        deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        (req,) = [d for d in deps if re.match(r"torch\s*>=", d)]
        lo = tuple(map(int, re.search(r">=\s*(\d+)\.(\d+)", req).groups()))
        below = re.search(r"<\s*(\d+)\.(\d+)", req)
        have = tuple(int(x) for x in tag.split("-")[0].split(".")[:2])
        assert have >= lo, f"{tag} is older than pyproject's {req}"
        assert below is None or have < tuple(map(int, below.groups())), \
            f"{tag} is newer than pyproject's {req}"


def test_a_non_root_user_runs_the_image_after_the_installs():
    ins = instructions()
    users = [(i, args) for i, (kind, args, _) in enumerate(ins) if kind == "USER"]
    assert users, "no USER: the image would run as root"
    last, user = users[-1]
    assert user.split(":")[0] not in ("root", "0")
    installs = [i for i, (kind, args, _) in enumerate(ins)
                if kind == "RUN" and re.search(r"pip install|apt-get|useradd|chown|chmod", args)]
    assert installs and max(installs) < last, "installs must run before switching users"
    assert [k for k, _, _ in ins[last:]].count("RUN") == 0
    name = user.split(":")[0]
    assert any(k == "RUN" and re.search(rf"useradd\b.*\b{name}\b", a) for k, a, _ in ins), \
        f"user {name} is never created"
    workdir = [a for k, a, _ in ins[last:] if k == "WORKDIR"]
    assert workdir, "a work dir after USER"
    assert any(k == "RUN" and f"chown {name}" in a and workdir[-1] in a for k, a, _ in ins), \
        f"{workdir[-1]} must belong to {name}"


def test_a_c_compiler_for_tritons_kernel_launchers():
    """torch.compile on GPUs (Triton) compiles a C launcher per kernel at run time."""
    installs = [a for k, a, _ in instructions() if k == "RUN" and "apt-get install" in a]
    assert any(re.search(r"\b(gcc|build-essential|clang)\b", a) for a in installs), \
        "no C compiler is installed: torch.compile fails on GPUs"
    for args in installs:  # the package lists stay out of the image
        assert "rm -rf /var/lib/apt/lists" in args and "apt-get update" in args


def test_entrypoint_is_the_gate_script_and_runs_the_gate_before_exec():
    (entry,) = of("ENTRYPOINT")
    argv = json.loads(entry[1])  # exec form: signals reach the script, which execs
    script_path = argv[0]
    copied = [args.split() for kind, args, _ in instructions() if kind == "COPY"]
    assert [a for a in copied if a[-1] == script_path and a[-2] == "docker/entrypoint.sh"], \
        f"{script_path} is not docker/entrypoint.sh"
    lines = [line.strip() for line in ENTRYPOINT.read_text().splitlines()
             if line.strip() and not line.strip().startswith("#")]
    gate = [i for i, line in enumerate(lines) if "llmtrain health --gate" in line]
    run = [i for i, line in enumerate(lines) if line.startswith('exec "$@"')]
    assert gate and run and gate[0] < run[0]
    assert os.access(ENTRYPOINT, os.X_OK), "docker/entrypoint.sh must be executable"
    (cmd,) = of("CMD")
    assert json.loads(cmd[1])[0] == "llmtrain"


def test_every_copy_source_exists_and_is_not_ignored():
    ignored = [line.strip() for line in
               (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    copies = of("COPY")
    assert copies
    sources = []
    for _, args, line in copies:
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        assert "--from" not in args, "one stage: every COPY is from the build context"
        for src in words[:-1]:
            assert (ROOT / src).exists(), f"line {line}: COPY source {src} does not exist"
            assert src.split("/")[0] not in ignored, f"line {line}: {src} is dockerignored"
            sources.append(src.rstrip("/"))
    # what `pip install .` needs: pyproject, its readme, the package
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert {"pyproject.toml", readme, "llmtrain"} <= set(sources)


def test_no_pip_cache_no_remote_add_and_a_stated_healthcheck():
    runs = [(args, line) for kind, args, line in instructions() if kind == "RUN"]
    for args, line in runs:
        for cmd in re.split(r"&&|;|\|\|", args):
            if re.search(r"\bpip3?\s+install\b", cmd):
                assert "--no-cache-dir" in cmd, f"line {line}: pip install without --no-cache-dir"
    for _, args, line in of("ADD"):
        assert not re.search(r"\b(https?|git)://|git@", args), f"line {line}: ADD of a URL"
    health = of("HEALTHCHECK")
    assert len(health) == 1
    if health[0][1].upper() == "NONE":
        # a reason, in the comment just above it
        above = DOCKERFILE.read_text().splitlines()[:health[0][2] - 1]
        assert above[-1].startswith("#") and "HEALTHCHECK" in "".join(above[-6:]), \
            "HEALTHCHECK NONE needs the reason in a comment above it"
    else:
        assert "CMD" in health[0][1]


def test_entry_script_passes_bash_n_and_shellcheck():
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    needs.tool("shellcheck", "Debian/Ubuntu: apt-get install shellcheck")
    out = subprocess.run(["shellcheck", str(ENTRYPOINT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.fixture
def entry(tmp_path):
    """Runs the entry script with a stand-in `llmtrain` that logs its arguments and exits
    with $GATE_EXIT for `health`; returns (exit code, logged calls, stdout)."""
    log = tmp_path / "calls"
    fake = tmp_path / "bin" / "llmtrain"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                    "sys.exit(int(os.environ.get('GATE_EXIT', 0)) if sys.argv[1] == 'health' else 0)\n")
    fake.chmod(0o755)

    def run(*argv: str, **env: str):
        log.write_text("")
        proc = subprocess.run([str(ENTRYPOINT), *argv], capture_output=True, text=True,
                              env={**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}",
                                   **env}, timeout=30)
        return proc.returncode, [json.loads(x) for x in log.read_text().splitlines()], proc.stdout
    return run


def test_entry_script_gates_then_execs(entry):
    rc, calls, _ = entry("llmtrain", "train", "--config", "debug_cpu",
                         LLMTRAIN_GATE_ARGS="--config llama3_8b --training.run_dir /r")
    assert rc == 0
    assert calls == [["health", "--gate", "--config", "llama3_8b", "--training.run_dir", "/r"],
                     ["train", "--config", "debug_cpu"]]
    rc, calls, out = entry("echo", "hello")
    assert (rc, calls, out) == (0, [["health", "--gate"]], "hello\n")


def test_a_node_failing_the_gate_exits_76_and_never_runs_the_command(entry):
    rc, calls, out = entry("echo", "hello", GATE_EXIT="76")
    assert (rc, calls, out) == (76, [["health", "--gate"]], "")


def test_the_gate_can_be_skipped_and_launch_gates_itself(entry):
    assert entry("echo", "x", LLMTRAIN_GATE="0")[1:] == ([], "x\n")
    rc, calls, _ = entry("llmtrain", "launch", "--nnodes", "2", GATE_EXIT="76")
    assert (rc, calls) == (0, [["launch", "--nnodes", "2"]])
