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
    cache = CompileCache(str(run_dir), lambda: parts, EventLog(str(run_dir), 0), rank=0)
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
