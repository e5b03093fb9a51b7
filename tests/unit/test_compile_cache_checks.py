"""The compile cache loads only a blob its record vouches for, a record signed for this
start's key with the job's secret: anything else is ignored with an event that says why,
and the start compiles afresh. What it loads lands in the job's own inductor cache, never
in the node's shared one."""

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import torch

from conftest import events
from llmtrain.config import load_config
from llmtrain.distributed.compile_cache import (DIR, CompileCache, NoCompileCache, cache_key,
                                                compile_cache_for, signed_record)
from llmtrain.distributed.signed_store import job_secret
from llmtrain.events import EventLog

PARTS = cache_key(load_config("debug_cpu"), torch.device("cpu"))
SECRET = job_secret()  # the tests' job secret (conftest)


@pytest.fixture(autouse=True)
def node(tmp_path, monkeypatch):
    """This "node"'s shared inductor cache, where other jobs of the user look."""
    node = tmp_path / "node"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node))
    return node


def start(run_dir, parts=PARTS) -> CompileCache:
    cache = CompileCache(str(run_dir), parts, EventLog(str(run_dir), 0), rank=0, secret=SECRET)
    cache.ready()
    return cache


def put(run_dir, key: str, blob: bytes, parts=PARTS, kernels: bytes | None = None,
        secret: bytes = SECRET) -> None:
    """A cache for ``key`` as rank 0 saves it: the blob, the kernel bundle, the record
    signed with ``secret``."""
    d = run_dir / DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{key}.bin").write_bytes(blob)
    body = {"key": key, "parts": parts, "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(), "saved": 1.0}
    if kernels is not None:
        (d / f"{key}.kernels.tar").write_bytes(kernels)
        body["kernels"] = {"bytes": len(kernels), "sha256": hashlib.sha256(kernels).hexdigest()}
    (d / f"{key}.json").write_text(json.dumps(signed_record(secret, key, body)))


def bundle(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def ignored(run_dir) -> list[str]:
    return [e["reason"] for e in events(run_dir, "compile_cache_ignored")]


def so_files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.so")) if root.exists() else []


def test_no_cache_yet_is_no_event(tmp_path):
    cache = start(tmp_path)
    assert cache.loaded == 0 and cache.ignored is None
    assert not (tmp_path / "events").exists()  # nothing to say


@pytest.mark.parametrize("damage", ["flipped", "cut"])
def test_a_blob_that_is_not_what_its_record_says_is_never_loaded(tmp_path, damage):
    key = start(tmp_path).key
    put(tmp_path, key, b"x" * 64)
    blob = tmp_path / DIR / f"{key}.bin"
    blob.write_bytes(b"y" + b"x" * 63 if damage == "flipped" else b"x" * 10)
    cache = start(tmp_path)
    assert cache.loaded == 0
    [reason] = ignored(tmp_path)
    assert "damaged or cut short" in reason and f"{key}.bin" in reason


def test_a_blob_torch_cannot_read_is_ignored_not_fatal(tmp_path):
    key = start(tmp_path).key
    put(tmp_path, key, b"not a mega-cache blob")
    cache = start(tmp_path)
    assert cache.loaded == 0
    assert ignored(tmp_path) and "could not read" in ignored(tmp_path)[0]


@pytest.mark.parametrize("forger", ["rewrites the digests", "has no secret", "another secret"])
def test_a_replaced_blob_or_kernel_with_a_record_to_match_is_refused(tmp_path, node, forger):
    """Whoever writes the run dir replaces the blob and one ``.so`` of the kernel bundle,
    and writes a record whose sizes and digests match them: without the job's secret the
    record's signature cannot match, so nothing of it is loaded (torch's loader never
    sees the blob) and no kernel lands anywhere; the start compiles as if there were no
    cache."""
    key = start(tmp_path).key
    put(tmp_path, key, b"the job's blob", kernels=bundle({"ab/cgenuine.so": b"genuine"}))
    evil_blob, evil_kernels = b"a blob that runs code", bundle({"ab/cgenuine.so": b"evil"})
    d = tmp_path / DIR
    (d / f"{key}.bin").write_bytes(evil_blob)
    (d / f"{key}.kernels.tar").write_bytes(evil_kernels)
    record = json.loads((d / f"{key}.json").read_text())
    body = {**record, "bytes": len(evil_blob), "sha256": hashlib.sha256(evil_blob).hexdigest(),
            "kernels": {"bytes": len(evil_kernels),
                        "sha256": hashlib.sha256(evil_kernels).hexdigest()}}
    if forger == "has no secret":
        body.pop("hmac_sha256")
    elif forger == "another secret":
        body = signed_record(b"a secret of someone else's", key,
                             {k: v for k, v in body.items() if k != "hmac_sha256"})
    (d / f"{key}.json").write_text(json.dumps(body))
    cache = start(tmp_path)
    assert cache.loaded == 0 and cache.kernels == 0 and cache.record == {}
    [reason] = ignored(tmp_path)
    assert f"{key}.json is not signed for this key with the job's secret" in reason
    assert so_files(node) == []


def test_a_record_copied_from_another_key_is_refused(tmp_path):
    """A genuine record and blob of another key (another model, another torch), copied
    under this start's key, its key and parts edited to this one's: the signature covers
    the key it was made for, so it serves no other."""
    theirs = {**PARTS, "graphs": "0" * 16}
    put(tmp_path, "0123456789abcdef", b"their blob", parts=theirs)
    key = start(tmp_path).key
    d = tmp_path / DIR
    (d / f"{key}.bin").write_bytes((d / "0123456789abcdef.bin").read_bytes())
    for edit in ({}, {"key": key, "parts": PARTS}):
        record = {**json.loads((d / "0123456789abcdef.json").read_text()), **edit}
        (d / f"{key}.json").write_text(json.dumps(record))
        cache = start(tmp_path)
        assert cache.loaded == 0 and "not signed for this key" in cache.ignored


def test_a_cache_made_under_another_torch_is_stale_and_says_what_changed(tmp_path):
    theirs = {**PARTS, "torch": "2.11.0"}
    put(tmp_path, "0123456789abcdef", b"old", parts=theirs)
    cache = start(tmp_path)
    assert cache.loaded == 0
    [reason] = ignored(tmp_path)
    assert reason == f"made for another torch '2.11.0' (now {PARTS['torch']!r})"


def test_the_key_changes_with_the_graphs_inputs_not_with_the_run_length():
    cfg = load_config("debug_cpu")
    longer = load_config("debug_cpu", [("training.steps", "999")])
    wider = load_config("debug_cpu", [("model.dim", "256")])
    cpu = torch.device("cpu")
    assert cache_key(longer, cpu) == cache_key(cfg, cpu)
    assert cache_key(wider, cpu)["graphs"] != cache_key(cfg, cpu)["graphs"]


def test_cpu_kernels_land_only_in_the_jobs_own_cache_and_only_from_a_checked_bundle(
        tmp_path, node):
    """The kernel bundle is opened only when its sha256 is the signed record's, and only
    ``<2 chars>/<name>.so`` members are put in the job's own inductor cache, never in the
    node's shared one that other jobs load from: nothing lands outside it, and a kernel
    already there is not replaced."""
    cache = start(tmp_path / "run")
    job = Path(cache.inductor_dir)
    assert job.parent == node and job.name.startswith("llmtrain-job-")
    (job / "ab").mkdir(parents=True)
    (job / "ab" / "ckept.so").write_bytes(b"the job's own")
    blob = bundle({"cd/cnew.so": b"kernel", "ab/ckept.so": b"other", "../escape.so": b"x",
                   "cd/notes.txt": b"x"})
    (tmp_path / "run" / DIR).mkdir(parents=True)
    (tmp_path / "run" / DIR / f"{cache.key}.kernels.tar").write_bytes(blob)
    cache.record = {"kernels": {"sha256": hashlib.sha256(blob).hexdigest()}}
    assert cache._put_kernels() == 1
    assert (job / "cd" / "cnew.so").read_bytes() == b"kernel"
    assert (job / "ab" / "ckept.so").read_bytes() == b"the job's own"
    assert not (tmp_path / "escape.so").exists() and not (job / "cd" / "notes.txt").exists()
    assert [p for p in so_files(node) if not p.startswith(job.name)] == []  # none shared
    cache.record = {"kernels": {"sha256": "0" * 64}}  # the bundle replaced after signing
    (job / "cd" / "cnew.so").unlink()
    assert cache._put_kernels() == 0 and not (job / "cd" / "cnew.so").exists()
    assert "damaged or replaced" in ignored(tmp_path / "run")[-1]


def test_the_job_holds_its_inductor_cache_apart_and_without_a_secret_uses_no_run_dir_cache(
        tmp_path, node, monkeypatch):
    """With the job's secret, inductor's cache in this process is the job's own
    subdirectory of the node's, the same at every start of the job and another for a job
    holding another secret. Without one, nothing is loaded from or saved to the run dir: one
    event (rank 0's) says so."""
    cfg = load_config("debug_cpu", [("parallelism.compile", "true"),
                                    ("training.run_dir", str(tmp_path / "run"))])
    ours = start(tmp_path / "run").inductor_dir
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == ours and os.path.dirname(ours) == str(node)
    assert start(tmp_path / "run").inductor_dir == ours  # a second start in the process
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node))
    other = CompileCache(str(tmp_path / "other"), PARTS, EventLog(str(tmp_path / "other"), 0),
                         rank=0, secret=b"another job's secret")
    assert other.inductor_dir != ours and os.path.dirname(other.inductor_dir) == str(node)
    other.ready()

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node))
    monkeypatch.delenv("LLMTRAIN_JOB_SECRET")
    for rank in (0, 1):
        assert isinstance(compile_cache_for(cfg, rank, 0, EventLog(str(tmp_path / "run"), rank)),
                          NoCompileCache)
    [reason] = ignored(tmp_path / "run")
    assert reason.startswith("no job secret") and "neither loaded nor saved" in reason
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(node)  # torch's own, as it was
