"""Run under torchrun by tests/integration/test_tensor_parallel.py: loads a checkpoint
(``URL``) into llmtrain's model sharded at this job's layout (the world size and the
``--parallelism.tp`` among the overrides), as a resume does, then checks on rank 0 that
every weight, gathered whole, equals the checkpoint's value read with no process group.
Every rank exits 0 when all are equal, 1 when rank 0 named some that are not.

    torchrun --nproc-per-node N tests/integration/tp_layout_load.py URL [--section.field V ...]
"""

import contextlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from llmtrain import sharded_model
from llmtrain.checkpoint.shard_read import ShardReader, load_unsharded
from llmtrain.config import load_config, parse_overrides
from llmtrain.distributed.process_group import build_mesh


def main(url: str, overrides: list[str]) -> int:
    cfg = load_config("debug_cpu", parse_overrides(overrides))
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    mesh = build_mesh(cpu, cfg.mesh_shape(dist.get_world_size()), 60.0, cfg.parallelism.tp)
    model = sharded_model.build(cfg, mesh, cpu, lambda part: contextlib.nullcontext()).model
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=ShardReader(url))
    whole = {name: value.full_tensor() if isinstance(value, DTensor) else value
             for name, value in state["model"].items()}
    code = 0
    if dist.get_rank() == 0:
        saved = load_unsharded(url)["model"]
        differ = sorted(name for name in saved if name not in whole
                        or not torch.equal(saved[name], whole[name]))
        print(f"{len(saved)} weights, mesh {mesh.mesh_dim_names} {tuple(mesh.shape)}; "
              f"differ: {differ}")
        code = int(bool(differ) or saved.keys() != whole.keys())
    # every rank leaves with rank 0's verdict, and none before rank 0 has given it: a peer
    # that tore down its gloo connections while rank 0 still compared made another abort
    verdict = torch.tensor([code])
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return int(verdict.item())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
