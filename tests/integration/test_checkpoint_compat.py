"""Checkpoints written before checkpoint/shards.py was split by job still load, bitwise.

``tests/data/checkpoints/tiny-2rank/`` holds one checkpoint of each format (raw and dcp),
written at commit 5af596a by a real 2-rank run of the debug preset shrunk to 0.01M
parameters::

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m llmtrain train \\
        --config debug_cpu --training.steps 2 --checkpoint.interval_steps 2 \\
        --checkpoint.format <raw|dcp> --model.dim 8 --model.n_layers 1 --model.n_heads 2 \\
        --model.n_kv_heads 1 --model.multiple_of 8 --model.max_seq_len 16 \\
        --data.seq_len 16 --training.global_batch_size 4 --training.micro_batch_size 2

and ``summary.json`` beside them is :func:`summary` of each, as that commit's code loaded
them: every tensor's dtype, shape and sha256, every object's sha256 or repr. A change to
the formats' readers that reads anything differently fails here.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from llmtrain.checkpoint import storage
from llmtrain.checkpoint.in_place import (InPlace, LiveShards, plan_in_place, read_in_place,
                                         read_objects)
from llmtrain.checkpoint.safe_unpickle import stored_object
from llmtrain.checkpoint.shard_read import ShardReader, load_unsharded

DATA = Path(__file__).resolve().parents[1] / "data" / "checkpoints" / "tiny-2rank"
FORMATS = ("raw", "dcp")
STEP = 2
WORLD = 2


def step_dir(fmt: str) -> str:
    return storage.step_dir(str(DATA / fmt), STEP)


def described(value) -> dict:
    """A loaded value as JSON: a tensor by its dtype, shape and bytes' sha256, bytes (a
    BytesIO) by their sha256, anything else by its repr."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"dtype": str(value.dtype), "shape": list(value.shape),
                "sha256": hashlib.sha256(data).hexdigest()}
    if hasattr(value, "getvalue"):
        return {"sha256": hashlib.sha256(value.getvalue()).hexdigest()}
    return {"repr": repr(value)}


def summary(state: dict, prefix: str = "") -> dict:
    """Every leaf of a nested state dict, by its dotted name, :func:`described`."""
    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update(summary(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = described(value)
    return found


def planned(url: str, rank: int) -> tuple[ShardReader, dict, InPlace | None]:
    """A reader of ``rank``'s own items (its section of INDEX2.bin), a live tensor for
    each of its chunks (by (name, offset), filled with NaN) and the plan of a load in
    place into them and of its objects."""
    reader = ShardReader(url, rank=rank, world=WORLD)
    assert reader.has_own_section()
    items = reader.own_items()
    tensors = {key: torch.full(item.sizes, float("nan"), dtype=item.dtype)
               for key, item in items.items() if item.sizes is not None}
    objects = [name for name, offset in items if offset is None]
    return reader, tensors, plan_in_place(reader, LiveShards(tensors), objects)


def in_place(url: str, rank: int) -> dict:
    """``rank``'s own items read as a restart at the saved world size reads them (no DCP
    planning), each checked against its recorded sum: its tensors' chunks by (name,
    offset), its objects decoded."""
    reader, tensors, plan = planned(url, rank)
    assert plan is not None and plan.checked
    read_in_place(reader, plan, check=True)
    values = {name: stored_object(data)
              for name, data in read_objects(reader, plan, check=True).items()}
    return {**{f"{name}@{list(offset)}": described(t) for (name, offset), t in tensors.items()},
            **{name: described(value) for name, value in values.items()}}


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads((DATA / "summary.json").read_text())


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_checkpoint_verifies_with_its_recorded_checksums(fmt):
    url = step_dir(fmt)
    assert storage.read_manifest(url)["format"] == fmt
    assert storage.verify(url, checksums=True) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_whole_checkpoint_loads_as_it_did_before_the_split(fmt, expected):
    assert summary(load_unsharded(step_dir(fmt))) == expected[fmt]["unsharded"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_each_ranks_own_items_load_in_place_as_before_the_split(rank, expected):
    assert in_place(step_dir("raw"), rank) == expected["raw"][f"rank{rank}"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_dcp_format_checkpoint_is_left_to_dcps_planner(rank):
    """Its tensors are ``torch.save`` records, not raw bytes: no load in place (the
    whole load above, through DCP's planning, reads them)."""
    assert planned(step_dir("dcp"), rank)[2] is None
