"""TrainState: everything a resumed run needs to continue exactly where it stopped.

Model and optimizer are sharded DTensor state (DCP reshards them to any world size).
The rest is small and goes as bytes: the step, the LR schedule, the data sampler's
position (global, so it means the same at any world size) and, per rank, every RNG.
"""

from __future__ import annotations

import io
import json
import random

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llmtrain.checkpoint.shards import ShardReader


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainState:
    def __init__(self, model, optimizer, scheduler, data, rank: int):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.data, self.rank = data, rank

    def _trainer_bytes(self, step: int) -> io.BytesIO:
        blob = {"step": step, "scheduler": self.scheduler.state_dict(),
                "data": self.data.state_dict()}
        return io.BytesIO(json.dumps(blob).encode())

    def state_dict(self, step: int) -> dict:
        """What DCP saves; the same keys on every rank but the RNG, which is per rank."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        rng = io.BytesIO()
        torch.save(_rng_state(), rng)
        return {"model": model_sd, "optim": optim_sd, "trainer": self._trainer_bytes(step),
                f"rng.{self.rank}": rng}

    def load(self, url: str, process_group, *, threads: int = 4) -> tuple[int, bool]:
        """Loads the checkpoint at ``url`` (already verified) into the live objects,
        ``threads`` parallel reads at a time.

        Returns the step it was saved at, and whether this rank's RNG state was in it
        (a rank that did not exist at save time keeps its seeded RNG).
        """
        reader = ShardReader(url, threads=threads)
        saved_keys = reader.read_metadata().state_dict_metadata
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd, "trainer": io.BytesIO()}
        rng_key = f"rng.{self.rank}"
        if rng_key in saved_keys:
            state[rng_key] = io.BytesIO()
        dcp.load(state, storage_reader=reader, process_group=process_group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        trainer = json.loads(state["trainer"].getvalue())
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.data.load_state_dict(trainer["data"])
        if rng_key in state:
            state[rng_key].seek(0)
            _set_rng_state(torch.load(state[rng_key], weights_only=True))
        return trainer["step"], rng_key in state
