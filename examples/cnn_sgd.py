"""A small CNN trained with SGD and momentum on generated images: a plain PyTorch loop
with llmtrain's reliability added (the lines that name ``llmtrain`` or ``run``).

Alone, on one CPU process::

    python examples/cnn_sgd.py --training.run_dir runs/cnn --training.steps 100

Two ranks, warm recovery on (a rank that dies is replaced by the spare)::

    llmtrain launch --script examples/cnn_sgd.py --nproc-per-node 2 ... --standby  # a spare
    llmtrain launch --script examples/cnn_sgd.py --nproc-per-node 2 ...            # a node

The command line is llmtrain's (``--config`` and dotted overrides): see
``llmtrain config --reference``.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import llmtrain


class Images:
    """Generated 3x16x16 images of 4 classes, the same for a position and a rank on any
    machine: nothing to download. A class shifts the first channel's pixels and the
    others' up or down by a tenth of the noise, so the classes overlap a little and the
    loss settles above 0: steady at any batch size. (Labels decided by the sign of pure
    noise's mean, the first version, drove the weights up until the loss spiked and the
    run was stopped as diverged; well separated classes drive the loss to 0, where every
    hard sample reads as a spike.) Its position (the same on every rank) is the state a
    restart must bring back."""

    def __init__(self, rank: int, batch: int = 16):
        self.rank, self.batch, self.position = rank, batch, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.position * 4099 + self.rank)
        self.position += 1
        y = torch.randint(4, (self.batch,), generator=g)
        shift = torch.stack([y // 2, y % 2, y % 2], 1).float() * 0.2 - 0.1  # +-0.1
        x = torch.randn(self.batch, 3, 16, 16, generator=g) + shift[:, :, None, None]
        return x, y

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 4))


def build(world: llmtrain.World) -> llmtrain.Parts:
    """The model sharded over the ranks, its optimizer and the data: at the start, and
    again whenever the ranks form a new process group."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = cnn().to(world.device)
    for layer in model:
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            fully_shard(layer, mesh=world.mesh)
    fully_shard(model, mesh=world.mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    return llmtrain.Parts(model, optimizer, state={"data": Images(world.rank)})


def main() -> int:
    settings = llmtrain.Settings.from_args(sys.argv[1:])
    with llmtrain.start(settings, build) as run:
        while run.running:
            with run.step():
                model, optimizer = run.parts.model, run.parts.optimizer
                x, y = run.parts.state["data"].next()
                loss = F.cross_entropy(model(x.to(run.device)), y.to(run.device))
                loss.backward()
                run.optimizer_step(loss)  # instead of optimizer.step(): a bad step is skipped
                optimizer.zero_grad()
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main())
