"""The compile cache loads only a blob its record vouches for, made under this start's key:
anything else is ignored with an event that says why, and the start compiles afresh."""

import hashlib
import json

import pytest
import torch

from conftest import events
from llmtrain.config import load_config
from llmtrain.distributed.compile_cache import DIR, CompileCache, cache_key
from llmtrain.events import EventLog

PARTS = cache_key(load_config("debug_cpu"), torch.device("cpu"))


def start(run_dir, parts=PARTS) -> CompileCache:
    cache = CompileCache(str(run_dir), parts, EventLog(str(run_dir), 0), rank=0)
    cache.ready()
    return cache


def put(run_dir, key: str, blob: bytes, parts=PARTS, **record) -> None:
    d = run_dir / DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{key}.bin").write_bytes(blob)
    (d / f"{key}.json").write_text(json.dumps(
        {"key": key, "parts": parts, "bytes": len(blob),
         "sha256": hashlib.sha256(blob).hexdigest(), "saved": 1.0, **record}))


def ignored(run_dir) -> list[str]:
    return [e["reason"] for e in events(run_dir, "compile_cache_ignored")]


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


def test_cpu_kernels_land_only_as_inductor_names_and_only_from_a_checked_bundle(
        tmp_path, monkeypatch):
    """The kernel bundle is opened only when its sha256 is the record's, and only
    ``<2 chars>/<name>.so`` members are put in the node's inductor cache: nothing lands
    outside it, and a kernel already there is not replaced."""
    import io
    import tarfile
    node = tmp_path / "node"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node))
    (node / "ab").mkdir(parents=True)
    (node / "ab" / "ckept.so").write_bytes(b"the node's own")
    bundle = io.BytesIO()
    with tarfile.open(fileobj=bundle, mode="w") as tar:
        for name, data in (("cd/cnew.so", b"kernel"), ("ab/ckept.so", b"other"),
                           ("../escape.so", b"x"), ("cd/notes.txt", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob = bundle.getvalue()
    cache = start(tmp_path / "run")
    (tmp_path / "run" / DIR).mkdir(parents=True)
    (tmp_path / "run" / DIR / f"{cache.key}.kernels.tar").write_bytes(blob)
    cache.record = {"kernels": {"sha256": hashlib.sha256(blob).hexdigest()}}
    assert cache._put_kernels() == 1
    assert (node / "cd" / "cnew.so").read_bytes() == b"kernel"
    assert (node / "ab" / "ckept.so").read_bytes() == b"the node's own"
    assert not (tmp_path / "escape.so").exists() and not (node / "cd" / "notes.txt").exists()
    cache.record = {"kernels": {"sha256": "0" * 64}}
    (node / "cd" / "cnew.so").unlink()
    assert cache._put_kernels() == 0 and not (node / "cd" / "cnew.so").exists()
    assert "damaged" in ignored(tmp_path / "run")[-1]
