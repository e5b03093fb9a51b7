"""Real-storage pytest fixtures: a bindfs FUSE mount, the fault-injecting faultfs mount, and a
moto S3 server on loopback.

    bindfs_mount            -> Path: a bindfs (FUSE) mount of a fresh tmp dir
    bindfs_dirs             -> FuseDirs(mount, root): the same, with the backing dir
    faultfs                 -> FaultFS: .mount .root .set_rules() .clear() .fired() .wait_fired()
    s3_server  (session)    -> endpoint URL "http://127.0.0.1:PORT" of a moto S3 server
    s3_url                  -> "s3://<fresh bucket>", with the AWS_* env set for s3fs/fsspec
                               (in this process and any subprocess started from it)

Nothing here is available -> the test is skipped with the reason; with CI=true it fails instead,
so a CI machine that lost fuse3/bindfs/moto does not go green by skipping.
Installed by `.ci/run` (apt: fuse3 bindfs) and the `dev` extra (mfusepy, s3fs, moto[server]).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

__all__ = ["FaultFS", "FuseDirs", "bindfs_dirs", "bindfs_mount", "faultfs", "fuse_mounts",
           "is_mounted", "s3_server", "s3_url", "S3_ENV", "unmount"]

FAULTFS_SCRIPT = Path(__file__).resolve().parent / "storage" / "faultfs.py"
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
MOUNT_TIMEOUT = 15.0


def _unavailable(reason: str):
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: storage fixtures must work here; see .ci/run)",
                    pytrace=False)
    pytest.skip(reason)


# --------------------------------------------------------------------------- mount helpers
def _unescape(field: str) -> str:  # /proc/self/mounts escapes space, tab, newline, backslash
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))


def fuse_mounts() -> dict[str, str]:
    """{mount point: fs type} of every FUSE mount ("fuse", "fuse.bindfs", "fuse.faultfs", ...)."""
    out = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            _dev, mnt, fstype, *_ = line.split()
            if fstype == "fuse" or fstype.startswith("fuse."):
                out[_unescape(mnt)] = fstype
    return out


def is_mounted(path: os.PathLike | str) -> bool:
    """Whether ``path`` is a FUSE mount point (also true for a dead one: ENOTCONN)."""
    return os.path.realpath(path) in fuse_mounts()


def _fuse_problem(*tools: str) -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel/container)"
    for tool in ("fusermount3", *tools):
        if shutil.which(tool) is None:
            return f"{tool} not found: apt-get install fuse3 bindfs (see .ci/run)"
    return None


def _wait_mounted(mnt: Path, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while not is_mounted(mnt):
        if proc is not None and proc.poll() is not None:
            text = log.read_text() if log and log.exists() else ""
            raise RuntimeError(f"FUSE process exited with {proc.returncode} before mounting "
                               f"{mnt}:\n{text[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mnt} not mounted after {MOUNT_TIMEOUT}s")
        time.sleep(0.02)


def unmount(mnt: os.PathLike | str, proc: subprocess.Popen | None = None,
            busy_timeout: float = 3.0) -> None:
    """fusermount3 -u, retried while busy (say, a child process still exiting), then a lazy
    unmount; then stop the filesystem process ``proc`` (SIGTERM, then SIGKILL)."""
    mnt = str(mnt)
    deadline = time.monotonic() + busy_timeout
    lazy = False
    while is_mounted(mnt):
        r = subprocess.run(["fusermount3", "-u", mnt], capture_output=True, text=True)
        if r.returncode == 0 or not is_mounted(mnt):
            break
        if time.monotonic() > deadline:
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
            lazy = True
            break
        time.sleep(0.1)
    if proc is not None:
        # after a lazy unmount the process would serve the open files until they close: stop it
        for stop, wait in ((None, 0.2 if lazy else 3.0), (proc.terminate, 2.0), (proc.kill, 5.0)):
            if stop is not None:
                stop()
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        if is_mounted(mnt):  # the process died without unmounting: "transport endpoint not connected"
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)


# --------------------------------------------------------------------------- bindfs
class FuseDirs(NamedTuple):
    mount: Path  # use this
    root: Path   # the backing directory (look behind the filesystem's back)


@pytest.fixture
def bindfs_dirs(tmp_path) -> Iterator[FuseDirs]:
    """A real bindfs FUSE mount of a fresh directory."""
    problem = _fuse_problem("bindfs")
    if problem:
        _unavailable(problem)
    root, mnt = tmp_path / "bindfs-root", tmp_path / "bindfs-mnt"
    root.mkdir()
    mnt.mkdir()
    # bindfs daemonizes once the mount is up; --no-allow-other works for non-root users too.
    r = subprocess.run(["bindfs", "--no-allow-other", str(root), str(mnt)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        _unavailable(f"bindfs failed (exit {r.returncode}): {r.stderr.strip()}")
    try:
        _wait_mounted(mnt)
        yield FuseDirs(mnt, root)
    finally:
        unmount(mnt)


@pytest.fixture
def bindfs_mount(bindfs_dirs) -> Path:
    """Path of a real bindfs FUSE mount of a fresh tmp dir (backing dir: ``bindfs_dirs.root``)."""
    return bindfs_dirs.mount


# --------------------------------------------------------------------------- faultfs
class FaultFS:
    """A running tests/storage/faultfs.py mount. See that file for the rule format."""

    def __init__(self, base: Path):
        self.base = base
        self.root = base / "root"          # backing directory
        self.mount = base / "mnt"          # the FUSE mount: do I/O here
        self.rules_file = base / "rules.json"
        self.fired_file = base / "fired.jsonl"
        self.log_file = base / "faultfs.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "FaultFS":
        for d in (self.root, self.mount):
            d.mkdir(parents=True, exist_ok=True)
        self.set_rules([])
        cmd = [sys.executable, str(FAULTFS_SCRIPT), str(self.root), str(self.mount),
               "--control", str(self.rules_file), "--fired", str(self.fired_file), "--foreground"]
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        _wait_mounted(self.mount, self.proc, self.log_file)
        return self

    def set_rules(self, rules: list[dict]) -> None:
        """Replace the rules (atomically); they apply from the filesystem's next operation."""
        tmp = self.rules_file.with_name(f".{self.rules_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(list(rules)))
        os.replace(tmp, self.rules_file)

    def clear(self) -> None:
        """Back to plain passthrough; also ends delays in progress."""
        self.set_rules([])

    def fired(self, op: str | None = None) -> list[dict]:
        """Records of the faults fired since mount (or since reset_fired()), oldest first."""
        try:
            lines = self.fired_file.read_text().splitlines()
        except FileNotFoundError:
            return []
        recs = [json.loads(line) for line in lines if line.strip()]
        return [r for r in recs if op is None or r["op"] == op]

    def reset_fired(self) -> None:
        self.fired_file.unlink(missing_ok=True)

    def wait_fired(self, n: int = 1, timeout: float = 10.0, op: str | None = None) -> list[dict]:
        """Block until at least ``n`` faults (of ``op``) fired; returns them."""
        deadline = time.monotonic() + timeout
        while len(recs := self.fired(op)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(recs)}/{n} faults fired after {timeout}s: {recs}")
            time.sleep(0.02)
        return recs

    def log(self) -> str:
        """The filesystem's stderr: one line per fired fault, rule reloads, tracebacks."""
        return self.log_file.read_text() if self.log_file.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        self.clear()
        unmount(self.mount, self.proc)
        self.proc = None


@pytest.fixture
def faultfs(tmp_path) -> Iterator[FaultFS]:
    """tests/storage/faultfs.py mounted on ``.mount`` over ``.root``, no rules yet."""
    problem = _fuse_problem()
    if problem:
        _unavailable(problem)
    try:
        import mfusepy  # noqa: F401  (loads libfuse3)
    except (ImportError, OSError) as e:
        _unavailable(f"mfusepy unusable ({e}): pip install -e '.[dev]' and apt-get install fuse3")
    fs = FaultFS(tmp_path / "faultfs")
    try:
        fs.start()
        yield fs
    finally:
        fs.stop()


# --------------------------------------------------------------------------- S3 (moto)
# Read by botocore (so by aiobotocore/s3fs/fsspec, boto3) in this process and in every
# subprocess that inherits os.environ; the endpoint vars are added by s3_url.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",   # never probe 169.254.169.254 for credentials
    "AWS_CONFIG_FILE": os.devnull,          # ignore ~/.aws of whoever runs the tests
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server on 127.0.0.1 (a free port), for the whole session."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        _unavailable(f"moto[server] not installed ({e}): pip install -e '.[dev]'")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_server, monkeypatch) -> Iterator[str]:
    """``"s3://<fresh bucket>"`` on the moto server; fsspec.open / url_to_fs reach it, here and
    in subprocesses (AWS_ENDPOINT_URL_S3 + AWS_ENDPOINT_URL + test credentials in os.environ)."""
    try:
        import s3fs
    except ImportError as e:
        _unavailable(f"s3fs not installed ({e}): pip install -e '.[dev]'")
    for key, value in {**S3_ENV, "AWS_ENDPOINT_URL_S3": s3_server,
                       "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    monkeypatch.setenv("NO_PROXY", no_proxy)
    monkeypatch.setenv("no_proxy", no_proxy)
    # fsspec caches S3FileSystem instances (each holding a client bound to an endpoint):
    # start and end with none, so no instance outlives the env it was made with.
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    s3fs.S3FileSystem().mkdir(bucket)
    try:
        yield f"s3://{bucket}"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
