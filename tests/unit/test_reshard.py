"""Resharding the state from memory: three real gloo ranks train a step of an FSDP2 model
and replicate their snapshots to their buddies; one is lost, and the two survivors rebuild
the model at world size 2 and fill it from what they hold. The result must be bit for bit
what DCP's own resharding load of the same step gives."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ranks import spawn

from llmtrain.checkpoint.snapshots import Schedule, SnapshotError, Snapshots
from llmtrain.config import load_config
from llmtrain.distributed.process_group import WorldInfo
from llmtrain.recovery.coordinator import world_sizes
from llmtrain.state_registry import state_entries, state_tensors
from llmtrain.events import EventLog
from llmtrain.recovery.reshard import Mesh, plan_moves, plan_unit_moves, reshard, whole_units
from llmtrain.state_registry import local_shard


_OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1),
               "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}


def _model(world: int, seed: int, kind: str):
    """Rows that no world size here divides evenly, and a tensor with fewer rows than
    ranks (an empty shard at 3)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 10), torch.nn.ReLU(), torch.nn.Linear(10, 2))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return model, _OPTIMIZERS[kind](model.parameters())


def _worker(rank: int, tmp: str, kind: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store3", 3), rank=rank,
                            world_size=3)
    model, optimizer = _model(3, seed=0, kind=kind)
    torch.manual_seed(10 + rank)
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optimizer))),
             checkpoint_id=f"{tmp}/ckpt")
    # snapshots replicated around the ring, each to the next rank's buddy as on nodes
    snaps = Snapshots(Schedule(1), rank, buddy=(rank + 1) % 3, ward=(rank - 1) % 3,
                      events=EventLog(tmp, rank))
    snaps.start(dist.new_group(backend="gloo"), None, 0)
    assert snaps.take(1, state_tensors(model, optimizer, []), {"rank": rank})
    assert snaps.wait_idle(30)
    snaps.stop(30)
    dist.destroy_process_group()
    if rank == 2:
        return  # lost: its state lives on in rank 0's replica
    held = {rank: snaps.own.at(1)}
    if rank == 0:
        held[2] = snaps.replicas.at(1)
    for snap in held.values():
        snap.verify()
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store2", 2), rank=rank,
                            world_size=2)
    model, optimizer = _model(2, seed=1, kind=kind)  # other values: each must be overwritten
    header = reshard(held, {0: 0, 1: 1, 2: 0}, Mesh(1, 3), Mesh(1, 2),
                     state_entries(model, optimizer), own=rank, group=dist.group.WORLD)
    reference, ref_optimizer = _model(2, seed=2, kind=kind)
    state = dict(zip(("model", "optim"), get_state_dict(reference, ref_optimizer)))
    dcp.load(state, checkpoint_id=f"{tmp}/ckpt")
    set_state_dict(reference, ref_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    ours, theirs = state_tensors(model, optimizer, []), state_tensors(reference, ref_optimizer, [])
    result = {"header_rank": header["rank"], "tensors": len(ours),
              "equal": [torch.equal(a, b) for a, b in zip(ours, theirs)],
              "rows": [list(local_shard(t).shape[:1]) for t in state_entries(model, optimizer)]}
    with open(f"{tmp}/result.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_reshard_from_memory_equals_dcps_resharding_load(tmp_path, kind):
    """Any optimizer's state: AdamW's step and moments, SGD's momentum."""
    spawn(_worker, args=(str(tmp_path), kind), nprocs=3)
    per_param = {"adamw": 3, "sgd": 1}[kind]  # step, exp_avg, exp_avg_sq; momentum_buffer
    for rank in (0, 1):
        r = json.load(open(tmp_path / f"result.{rank}"))
        assert r["header_rank"] == rank  # the survivor keeps its own RNGs and position
        assert r["tensors"] == 4 + 4 * per_param and all(r["equal"]), r
    # the new shards are world 2's: 10 rows as 5 + 5, 2 rows as 1 + 1
    assert json.load(open(tmp_path / "result.0"))["rows"][:4] == [[5], [5], [1], [1]]


def _received(moves) -> int:
    return sum(b - a for pieces in moves.receives.values() for p in pieces
               for a, b in [p.rows])


def test_dropping_a_whole_replica_moves_nothing_and_a_rank_receives_at_most_its_shard():
    # HSDP 2 x 2 loses replica 0 (old ranks 0 and 1): the survivors keep their shards
    for rank in (0, 1):
        moves = plan_moves(rank, [10, 7, None], {2: 0, 3: 1}, Mesh(2, 2), Mesh(1, 2))
        assert not moves.sends and not moves.receives
        assert [(p.source, p.rows) for p in moves.copies] == (
            [(2, (0, 5)), (2, (0, 4))] if rank == 0 else [(3, (5, 10)), (3, (4, 7))])
    # 8 ranks of plain FSDP lose two; old shards 6 and 7 are held by their buddies 0, 1
    providers = {o: o for o in range(6)} | {6: 0, 7: 1}
    rows = [1000, 17, 3]
    total_sent = 0
    for rank in range(6):
        moves = plan_moves(rank, rows, providers, Mesh(1, 8), Mesh(1, 6))
        mine = sum(b - a for n in rows for a, b in [Mesh(1, 6).rows(n, rank)])
        copied = sum(b - a for p in moves.copies for a, b in [p.rows])
        assert copied + _received(moves) == mine  # every row of its shard, once
        total_sent += sum(b - a for pieces in moves.sends.values() for p in pieces
                          for a, b in [p.rows])
    assert total_sent == sum(_received(plan_moves(r, rows, providers, Mesh(1, 8), Mesh(1, 6)))
                             for r in range(6))


def test_with_tensor_parallelism_whole_replicas_move_each_rank_its_places_tensors_whole():
    """Two replicas of a tp 2 group (ranks (r*1+s)*2+t): a shrink keeps the survivors'
    tensors where they are; a grow sends each newcomer every tensor of its tp place from
    the survivor of that place; a place nobody holds is an error, never a guess."""
    old, new = Mesh(2, 1, tp=2), Mesh(1, 1, tp=2)
    assert whole_units(old, new) and not whole_units(Mesh(1, 2), Mesh(1, 1))
    for rank in (0, 1):  # old ranks 2 and 3 go on as 0 and 1
        moves = plan_unit_moves(rank, 3, {2: 0, 3: 1}, old, new)
        assert not moves.sends and not moves.receives
        assert [(p.tensor, p.source, p.rows) for p in moves.copies] == [
            (i, rank + 2, None) for i in range(3)]
    grown = {rank: plan_unit_moves(rank, 2, {0: 0, 1: 1}, new, old) for rank in range(4)}
    assert {peer: [(p.tensor, p.source) for p in pieces]
            for peer, pieces in grown[1].sends.items()} == {3: [(0, 1), (1, 1)]}
    assert [(p.tensor, p.source) for p in grown[2].receives[0]] == [(0, 0), (1, 0)]
    assert not grown[2].copies and not grown[0].receives
    with pytest.raises(SnapshotError, match=r"unit\(s\) \[1\]"):
        plan_unit_moves(0, 2, {2: 0}, old, new)  # the place of old rank 3: nobody


def test_with_tensor_parallelism_a_resize_that_would_change_dp_shard_is_refused():
    """tp 2 on nodes of 2 ranks: with dp_shard -1 a shrink from 2 nodes to 1 would
    shard over 1 rank instead of 2 (strided TP pieces the reshard cannot cut): the size
    is not one the warm path may reach, and the reason names the fix; whole replicas
    (dp_replicate -1, dp_shard 1) are."""
    world = WorldInfo(rank=0, world_size=4, local_rank=0, host="node1", local_world_size=2,
                      min_nodes=1, max_nodes=2)
    fsdp = load_config("debug_cpu", [("parallelism.tp", 2)])
    reason = world_sizes(world, fsdp.mesh_shape, tp=2)(2)
    assert "only whole replicas come and go" in reason
    assert "set parallelism.dp_shard=2 and parallelism.dp_replicate=-1" in reason
    assert world_sizes(world, fsdp.mesh_shape, tp=1)(2) == (1, 1)  # (without TP: resharded)
    hsdp = load_config("debug_cpu", [("parallelism.tp", 2), ("parallelism.dp_replicate", -1),
                                     ("parallelism.dp_shard", 1)])
    assert world_sizes(world, hsdp.mesh_shape, tp=2)(2) == (1, 1)
