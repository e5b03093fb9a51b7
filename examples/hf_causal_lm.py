"""A Hugging Face transformers causal LM (a small ``LlamaForCausalLM`` built from its
config: nothing is downloaded), sharded with FSDP2, in a plain PyTorch loop with its own
data loader, and llmtrain's reliability added (the lines that name ``llmtrain`` or
``run``). docs/own-loop.md walks through it.

Alone, on one CPU process::

    python examples/hf_causal_lm.py --training.run_dir runs/hf --training.steps 100

Under ``llmtrain launch --script examples/hf_causal_lm.py`` on several nodes, with a
warm spare (``--standby``), a lost rank is replaced in about a second.
"""

import sys

import torch
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import llmtrain

VOCAB, SEQ = 512, 64


class Counting(Dataset):
    """Sequences that count up from a seeded start, modulo the vocabulary: a pattern a
    small model learns in a few hundred steps, generated, the same on any machine."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        start = torch.randint(VOCAB, (), generator=torch.Generator().manual_seed(i))
        return (start + torch.arange(SEQ)) % VOCAB


class Loader:
    """This rank's batches, in order: the loader's position is what a restart must bring
    back (the same on every rank)."""

    def __init__(self, rank: int, world_size: int, batch: int = 8):
        ranks_share = range(rank, len(Counting()), world_size)
        self.loader = DataLoader(torch.utils.data.Subset(Counting(), ranks_share),
                                 batch_size=batch)
        self.batches, self.position = iter(self.loader), 0

    def next(self) -> torch.Tensor:
        self.position += 1
        return next(self.batches)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.batches, self.position = iter(self.loader), 0
        for _ in range(state["position"]):  # cheap here; a real loader seeks
            self.next()


def build(world: llmtrain.World) -> llmtrain.Parts:
    """The model sharded over the ranks, its optimizer, schedule and data loader: at the
    start, and again whenever the ranks form a new process group."""
    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, attn_implementation="eager")
    model = LlamaForCausalLM(config).to(world.device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=world.mesh)
    fully_shard(model, mesh=world.mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    return llmtrain.Parts(model, optimizer, state={"schedule": schedule,
                                                   "data": Loader(world.rank, world.world_size)})


def main() -> int:
    settings = llmtrain.Settings.from_args(sys.argv[1:])
    with llmtrain.start(settings, build) as run:
        while run.running:
            with run.step():
                model, optimizer = run.parts.model, run.parts.optimizer
                tokens = run.parts.state["data"].next().to(run.device)
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                run.optimizer_step(loss, max_norm=1.0)  # instead of clipping and optimizer.step()
                run.parts.state["schedule"].step()
                optimizer.zero_grad()
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main())
