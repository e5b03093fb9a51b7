"""A warm spare's rehearsal of a step (llmtrain/spare_rehearsal.py): it trains one step of
the job's model on torch's fake process group, and nothing of that world reaches the
rank the spare later takes: no process group, no group name taken, no sharding plan that
names the rehearsal's meshes."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from llmtrain import sharded_model, spare_rehearsal
from llmtrain.config import load_config, parse_overrides
from llmtrain.distributed.process_group import build_mesh
from logs import logged

TP = ["--parallelism.tp", "2", "--parallelism.dp_replicate", "-1",
      "--parallelism.dp_shard", "1", "--training.micro_batch_size", "2"]


@pytest.fixture
def no_world():
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def cached_plans() -> int:
    prop = DTensor._op_dispatcher.sharding_propagator
    return prop.propagate_op_sharding.cache_info().currsize


def test_a_rehearsal_as_one_rank_leaves_nothing_that_names_its_world(no_world):
    """Rehearsed as rank 0, then built for real as rank 3 (here also on a fake world, of
    the same layout): the real step's outputs carry rank 3's mesh and coordinate. A plan
    kept from the rehearsal would hand them the rehearsal's mesh, an equal one (same ranks
    and dims) at rank 0's coordinate, whose groups are gone."""
    cfg = load_config("debug_cpu", parse_overrides(TP))
    took = spare_rehearsal.rehearse(cfg, 4, 0, 0)
    assert took is not None and took > 0
    assert not dist.is_initialized() and dist.distributed_c10d._world.group_count == 0
    assert cached_plans() == 0
    dist.init_process_group("fake", rank=3, world_size=4)
    with pytest.warns(UserWarning, match="Set timeout"):  # a fake group takes none
        mesh = build_mesh(torch.device("cpu"), cfg.mesh_shape(4), 60, tp=2)
    built = sharded_model.build(cfg, mesh, torch.device("cpu"),
                                lambda _part: contextlib.nullcontext())
    tokens = torch.randint(cfg.model.vocab_size, (2, cfg.data.seq_len))
    with loss_parallel():
        logits = built.model(tokens)
    assert isinstance(logits, DTensor)
    tp = mesh["tp"]
    assert list(logits.device_mesh.get_coordinate()) == [1] == list(tp.get_coordinate())
    assert logits.device_mesh.get_group() is tp.get_group()


def test_a_rehearsal_that_fails_costs_the_spare_nothing(no_world, monkeypatch):
    """A build that raises: the rehearsal says so, returns None, and leaves no world."""
    def broken(*_args, **_kwargs):
        raise RuntimeError("no memory for the rehearsal")
    monkeypatch.setattr(sharded_model, "build", broken)
    cfg = load_config("debug_cpu", parse_overrides(TP))
    with logged(logging.WARNING) as said:
        assert spare_rehearsal.rehearse(cfg, 4, 1, 1) is None
    assert not dist.is_initialized() and dist.distributed_c10d._world.group_count == 0
    assert any("rehearsal of a step failed" in line for line in said), said


def test_no_rehearsal_where_the_layout_does_not_fit_or_a_group_exists(no_world):
    cfg = load_config("debug_cpu", parse_overrides(TP))
    assert spare_rehearsal.rehearse(cfg, 3, 0, 0) is None  # tp 2 does not divide 3 ranks
    assert spare_rehearsal.rehearse(cfg, 0, 0, 0) is None  # a launcher that said no size
    assert spare_rehearsal.rehearse(cfg, 4, 5, 1) is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert spare_rehearsal.rehearse(load_config("debug_cpu"), 1, 0, 0) is None
    assert dist.get_backend() == "gloo"  # the group that was there is left alone
