"""Real-storage pytest fixtures: a bindfs FUSE mount, the fault-injecting faultfs mount, an
NFS mount (nfs-ganesha on loopback + a FUSE NFS client), and a moto S3 server on loopback.

    bindfs_mount            -> Path: a bindfs (FUSE) mount of a fresh tmp dir
    bindfs_dirs             -> FuseDirs(mount, root): the same, with the backing dir
    nfs_mount               -> Path: an NFSv4 mount of a fresh tmp dir exported by nfs-ganesha
    nfs_dirs                -> FuseDirs(mount, root): the same, with the exported dir
    faultfs                 -> FaultFS: .mount .root .set_rules() .clear() .fired() .wait_fired()
    s3_server  (session)    -> endpoint URL "http://127.0.0.1:PORT" of a moto S3 server
    s3_url                  -> "s3://<fresh bucket>", with the AWS_* env set for s3fs/fsspec
                               (in this process and any subprocess started from it)

Nothing here is available -> the test is skipped with the reason; with CI=true it fails instead,
so a CI machine that lost fuse3/bindfs/moto does not go green by skipping.
Installed by `.ci/run` (apt: fuse3 bindfs nfs-ganesha nfs-ganesha-vfs) and the `dev` extra
(mfusepy, nfs4fs, s3fs, moto[server]).
"""
from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

from needs import unavailable
from llmtrain.chaos.mount import BindfsMount
from llmtrain.chaos.mount import FaultMount as FaultFS
from llmtrain.chaos.mount import fuse_mounts, fuse_problem, is_mounted, unmount
from llmtrain.chaos.nfs import NfsMount, nfs_problem

__all__ = ["FaultFS", "FuseDirs", "bindfs_dirs", "bindfs_mount", "faultfs", "fuse_mounts",
           "is_mounted", "nfs_dirs", "nfs_mount", "s3_server", "s3_url", "S3_ENV", "unmount"]

# --------------------------------------------------------------------------- bindfs
class FuseDirs(NamedTuple):
    mount: Path  # use this
    root: Path   # the backing directory (look behind the filesystem's back)


@pytest.fixture
def bindfs_dirs(tmp_path) -> Iterator[FuseDirs]:
    """A real bindfs FUSE mount of a fresh directory."""
    problem = fuse_problem("bindfs")
    if problem:
        unavailable(problem)
    bindfs = BindfsMount(tmp_path / "bindfs")
    try:
        bindfs.start()
    except RuntimeError as e:
        unavailable(str(e))
    try:
        yield FuseDirs(bindfs.mount, bindfs.root)
    finally:
        bindfs.stop()


@pytest.fixture
def bindfs_mount(bindfs_dirs) -> Path:
    """Path of a real bindfs FUSE mount of a fresh tmp dir (backing dir: ``bindfs_dirs.root``)."""
    return bindfs_dirs.mount


# --------------------------------------------------------------------------- NFS
@pytest.fixture
def nfs_dirs(tmp_path) -> Iterator[FuseDirs]:
    """A real NFSv4 mount (llmtrain.chaos.nfs) of a fresh directory; server and client
    stopped and unmounted afterwards."""
    problem = nfs_problem()
    if problem:
        unavailable(problem)
    nfs = NfsMount(tmp_path / "nfs")
    try:
        nfs.start()
        yield FuseDirs(nfs.mount, nfs.root)
    finally:
        nfs.stop()


@pytest.fixture
def nfs_mount(nfs_dirs) -> Path:
    """Path of a real NFS mount of a fresh tmp dir (exported dir: ``nfs_dirs.root``)."""
    return nfs_dirs.mount


# --------------------------------------------------------------------------- faultfs
@pytest.fixture
def faultfs(tmp_path) -> Iterator[FaultFS]:
    """llmtrain.chaos.faultfs mounted on ``.mount`` over ``.root``, no rules yet."""
    problem = fuse_problem()
    if problem:
        unavailable(problem)
    try:
        import mfusepy  # noqa: F401  (loads libfuse3)
    except (ImportError, OSError) as e:
        unavailable(f"mfusepy unusable ({e}): pip install -e '.[dev]' and apt-get install fuse3")
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
        unavailable(f"moto[server] not installed ({e}): pip install -e '.[dev]'")
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
        unavailable(f"s3fs not installed ({e}): pip install -e '.[dev]'")
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
