"""Sharded initialization: built on meta, sharded by FSDP2 over 1 or 2 gloo ranks and
materialized shard by shard, the model gets bitwise the weights of a plain model built
whole with the same seed.

Each rank (:func:`worker`, forked from the test worker's server) builds the model the
trainer's way; rank 0 saves the gathered full weights.
"""

from __future__ import annotations


import pytest
import torch

from llmtrain.config import ModelConfig, ParallelismConfig
from llmtrain.model import INIT_BLOCK_ELEMENTS, Transformer
from ranks import spawn

pytestmark = pytest.mark.slow

SEED = 5

# The embedding and output tables (40009 x 16) span three init blocks, and an odd row count
# puts the 2-rank shard boundary inside the second one. Selective checkpointing wraps the
# blocks, so the parameter names the seeds are keyed by carry a wrapper prefix.
CFG = ModelConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=40009,
                  multiple_of=16, max_seq_len=16)
PARALLELISM = ParallelismConfig(device="cpu", param_dtype="float32",
                                activation_checkpoint="selective")


def worker(rank: int, world: int, out: str, seed: int) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from llmtrain.distributed.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}.store", world), rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Transformer(CFG)
    parallelize(model, mesh, PARALLELISM)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save(state, out)
    dist.destroy_process_group()


def reference(seed: int) -> dict[str, torch.Tensor]:
    model = Transformer(CFG)
    model.init_weights(seed)
    return model.state_dict()


@pytest.mark.parametrize("nproc", [1, 2])
def test_sharded_init_is_bitwise_the_full_construction(nproc, tmp_path):
    assert CFG.vocab_size * CFG.dim > INIT_BLOCK_ELEMENTS
    out = tmp_path / "weights.pt"
    spawn(worker, args=(nproc, str(out), SEED), nprocs=nproc)
    got = torch.load(out)
    want, other = reference(SEED), reference(SEED + 1)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
        if not name.endswith("norm.weight"):  # norms start at 1 whatever the seed
            assert not torch.equal(got[name], other[name]), name
