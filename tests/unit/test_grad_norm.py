"""The global gradient norm llmtrain computes with the integrity verdict (each rank's share
of the squared norm, summed in the verdict's own all-reduce) is the norm
``clip_grad_norm_`` computes over FSDP2's shards, and clipping to it scales the gradients
as ``clip_grads_with_norm_`` does: on FSDP's 1-D mesh and on HSDP's 2-D one, where each
shard is held by every replica and must be counted once."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ranks import spawn

from llmtrain.optim import clip_to, global_norm, square_norm_share


def _model(mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3))
    model[0].bias.requires_grad_(False)  # a parameter without a gradient is left out
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(1 + dist.get_rank())  # each rank its own batch
    model(torch.randn(5, 6)).square().sum().backward()
    return model


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]


def _worker(rank: int, tmp: str, shape: tuple[int, ...]) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store{len(shape)}", 4),
                            rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        ours, theirs = _model(mesh), _model(mesh)
        norm = global_norm(square_norm_share(ours, torch.device("cpu")))
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5).full_tensor()
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
        assert norm > 0.5  # so the clip below scales
        clip_to(ours, 0.5, norm)
        for a, b in zip(_grads(ours), _grads(theirs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()


def test_the_norm_and_the_clip_match_torchs_on_fsdp_and_hsdp(tmp_path):
    for shape in ((4,), (2, 2)):  # FSDP over 4 ranks; 2 replicas of 2 shards
        spawn(_worker, args=(str(tmp_path), shape), nprocs=4)
