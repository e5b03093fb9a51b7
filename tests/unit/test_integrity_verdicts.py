"""The integrity component on one rank: step verdicts on the device, the policy on the
host, state fingerprints. (Faults in real multi-rank runs: tests/integration.)"""

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.config import ConfigError, IntegrityConfig, step_ranges
from llmtrain.events import read_events, EventLog
from llmtrain.reliability.integrity import (Integrity, TrainingDiverged, fingerprint,
                                           replica_groups)
from llmtrain.state_registry import StateRegistry


@pytest.fixture
def integrity(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def make(**cfg) -> Integrity:
        return Integrity(IntegrityConfig(**cfg), events=EventLog(str(tmp_path), 0),
                         device=torch.device("cpu"), rank=0, world_size=1, replicas=[[0]],
                         global_batch_size=16)
    yield make
    dist.destroy_process_group()


def judge(it: Integrity, step: int, loss: float, norm: float = 1.0) -> float:
    return it.judge(step, torch.tensor(loss), torch.tensor(norm))[0].item()


def test_a_loss_spike_is_judged_on_the_step_it_appears(integrity):
    it = integrity(spike_window=16, spike_z=8.0)
    # a falling, noisy loss is never a spike, nor a jump while the window fills
    assert judge(it, 1, 9.0) == 0.0
    losses = [5.0 - 0.02 * s + 0.03 * math.sin(s) for s in range(2, 40)]
    assert [judge(it, s, v) for s, v in enumerate(losses, 2)] == [0.0] * len(losses)
    assert judge(it, 40, 10.0) == 1.0
    assert judge(it, 41, losses[-1]) == 0.0  # the spike did not enter the window
    (bad,) = it.read()
    assert (bad.step, bad.reason, bad.ranks) == (40, "spike", [])
    assert it.loss == pytest.approx(losses[-1])


def test_non_finite_loss_or_gradients_are_judged_bad_and_name_the_rank(integrity):
    it = integrity(spike_z=0)
    assert judge(it, 1, 3.0) == 0.0
    assert judge(it, 2, math.nan) == 1.0
    assert judge(it, 3, 3.0, norm=math.inf) == 1.0
    assert [(b.step, b.reason, b.ranks) for b in it.read()] == [
        (2, "nonfinite", [0]), (3, "nonfinite", [])]
    assert it.read() == []


def test_the_policy_skips_rolls_back_or_stops(integrity, tmp_path):
    it = integrity(spike_z=0, on_nonfinite="rollback", max_bad_steps=3, spike_window=8)
    judge(it, 5, math.nan)
    assert it.review(it.read(), 5) is True
    assert it.learn_skips(5) == [5] and 5 in it.skips
    (skipped,) = read_events(str(tmp_path), "step_skipped")
    assert skipped["samples"] == [64, 80] and skipped["ranks"] == [0]
    judge(it, 6, math.nan)
    assert it.review(it.read(), 6) is True
    judge(it, 20, math.nan)  # step 5 and 6 left the window of 8
    assert it.review(it.read(), 20) is True
    judge(it, 21, math.inf)
    judge(it, 22, math.nan)
    with pytest.raises(TrainingDiverged, match=r"diverged at step 21: 3 step\(s\) of the last 8"):
        it.review(it.read(), 22)
    stop = integrity(spike_z=0, on_nonfinite="stop")
    judge(stop, 1, math.nan)
    with pytest.raises(TrainingDiverged, match="non-finite loss on rank"):
        stop.review(stop.read(), 1)


def test_a_restored_state_keeps_the_verdicts_not_read_yet(integrity):
    """A snapshot between log steps: step 3's verdict (NaN) is judged but not read when the
    state is taken. Restored, it is read and reviewed as it would have been (a rollback,
    counted towards max_bad_steps); restored without it, the rollback was missed, and a
    rank that had read it before failing counted one bad step more than the others."""
    it = integrity(spike_z=0, on_nonfinite="rollback", max_bad_steps=2, spike_window=8)
    judge(it, 1, 3.0)
    judge(it, 2, math.nan)
    assert it.review(it.read(), 2) is True
    judge(it, 3, math.nan)
    state = json.loads(json.dumps(it.state_dict()))  # as a snapshot's header carries it
    judge(it, 4, 3.0)
    it.read()  # this rank went on past the snapshot before the failure
    it.load_state_dict(state)
    assert [(b.step, b.reason) for b in it.read()] == [(3, "nonfinite")]
    restored = integrity(spike_z=0, on_nonfinite="rollback", max_bad_steps=3, spike_window=8)
    restored.load_state_dict(state)  # a spare, from its buddy's replica
    bad = restored.read()
    assert [(b.step, b.ranks) for b in bad] == [(3, [0])]
    assert restored.review(bad, 3) is True and restored.bad_steps == [2, 3]


def test_fingerprints_see_one_flipped_bit_in_any_order():
    a, b = torch.randn(1000), torch.randn(7, 3)
    bits, bad = fingerprint([a, b])
    assert bad.item() == 0 and torch.equal(fingerprint([b, a])[0], bits.flip(0))
    a.view(torch.int32)[500] ^= 1 << 3  # a low mantissa bit: the value barely moves
    assert fingerprint([a, b])[0][0] != bits[0] and fingerprint([a, b])[0][1] == bits[1]
    a[1] = math.nan
    assert fingerprint([a, b])[1].item() == 1


def test_a_non_finite_value_anywhere_in_the_saved_state_fails_the_check(integrity):
    """The check before a save covers every tensor the save writes: a NaN in Adam's second
    moment (a third of the state) is as bad as one in a weight, and would otherwise be
    committed as checked, for every rollback to return to."""
    it = integrity()
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    registry = StateRegistry()
    registry.bind(model, optimizer)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert len(registry.tensors()) == 2 + 2 * 3  # weight, bias; each: step, exp_avg, exp_avg_sq
    assert it.check_state(1, registry.tensors(), torch.tensor(1.0)).ok
    optimizer.state[model.weight]["exp_avg_sq"][0, 0] = math.nan
    check = it.check_state(2, registry.tensors(), torch.tensor(1.0))
    assert not check.ok and check.nonfinite_ranks == [0]
    optimizer.state[model.weight]["exp_avg_sq"][0, 0] = 0.0
    with torch.no_grad():
        model.weight[0, 0] = math.inf
    assert it.check_state(3, registry.tensors(), torch.tensor(1.0)).nonfinite_ranks == [0]


def test_skip_steps_are_parsed_or_refused_by_name():
    assert step_ranges("integrity.skip_steps", "3, 10-12,3") == {3, 10, 11, 12}
    assert step_ranges("integrity.skip_steps", "") == set()
    for bad in ("12-10", "x", "1-2-3", "-4"):
        with pytest.raises(ConfigError, match="integrity.skip_steps"):
            step_ranges("integrity.skip_steps", bad)


def test_verdicts_restored_from_another_world_size_are_read_and_saved(integrity):
    """A snapshot taken between log steps carries verdicts judged at the world size then
    (one loss per rank); after a shrink or a grow they sit beside this world's, longer or
    shorter, and are read and saved all the same."""
    it = integrity(spike_z=0)
    judge(it, 3, 3.0)
    judge(it, 4, 3.0)
    state = it.state_dict()
    for step, row in state["pending"]:  # as judged by four ranks, rank 2's loss not finite
        row[:] = [2.0, math.nan, 1.0, 3.0, 3.0, math.nan, 3.0] if step == 4 else row + [3.0] * 3
    restored = integrity(spike_z=0)
    restored.load_state_dict(state)
    judge(restored, 5, 3.0)  # judged by this one rank
    assert [len(row) for _, row in restored.state_dict()["pending"]] == [7, 7, 4]
    assert [(b.step, b.ranks) for b in restored.read()] == [(4, [2])]


@pytest.mark.parametrize("dims, groups", [
    ({"dp_shard": 4}, [[0], [1], [2], [3]]),
    ({"dp_replicate": 2, "dp_shard": 2}, [[0, 2], [1, 3]]),
    ({"dp_shard": 2, "tp": 2}, [[0], [1], [2], [3]]),  # each rank its own shards
    ({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, [[0, 4], [1, 5], [2, 6], [3, 7]]),
])
def test_replicas_are_the_ranks_of_one_coordinate_in_every_dim_but_dp_replicate(
        integrity, dims, groups):
    """(A mesh of names only: the groups are read from its ranks, no group is formed.)"""
    integrity()  # (its fixture forms the one-rank default group a mesh asks for)
    size = math.prod(dims.values())
    mesh = DeviceMesh("cpu", torch.arange(size).reshape(*dims.values()),
                      mesh_dim_names=tuple(dims), _init_backend=False)
    assert replica_groups(mesh) == groups
