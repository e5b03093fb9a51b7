"""llmtrain's own training loop: the Llama, its optimizer and schedule, and the data,
trained a step at a time through the public API (:mod:`llmtrain.api`), like any other
loop. Everything that keeps the run alive (checkpoints, warm recovery, the integrity
guard, the watchdog, the health monitor, run control, reporting) is the session's.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from llmtrain import fault_points, sharded_model
from llmtrain.api import Parts, RunInfo, Session, Summary, World
from llmtrain.config import JobConfig
from llmtrain.data.sampler import training_batches
from llmtrain.distributed.compile_cache import compile_cache_for
from llmtrain.distributed.parallelize import precompute_fp8_scales
from llmtrain.model import count_params, flops_per_token

__all__ = ["Summary", "Trainer", "run_info"]


def run_info(cfg: JobConfig) -> RunInfo:
    """What the run's reports and checkpoint manifests say of llmtrain's own model."""
    t, d = cfg.training, cfg.data
    return RunInfo(name=cfg.model.name, params=count_params(cfg.model),
                   tokens_per_step=cfg.tokens_per_step(),
                   flops_per_token=flops_per_token(cfg.model, d.seq_len),
                   samples_per_step=t.global_batch_size, fp8=cfg.parallelism.fp8 != "none",
                   config=cfg.to_dict(),
                   manifest={"config_digest": cfg.digest(), "model_config": cfg.to_dict()["model"],
                             # where the tokens came from: an export ships their tokenizer
                             "data": {"source": d.source, "path": d.path}})


class Trainer:
    """Trains ``cfg``'s model: ``Trainer(cfg)`` starts cold (resumed from the newest
    checkpoint), :meth:`as_spare` in a lost rank's place."""

    def __init__(self, cfg: JobConfig):
        self._prepare(cfg)
        self.session.start(self.build)

    @classmethod
    def as_spare(cls, cfg: JobConfig, plan: dict) -> Trainer:
        """A warm spare's trainer, in the place ``plan`` assigns it."""
        self = cls.__new__(cls)
        self._prepare(cfg, joining=True)
        self.session.join(self.build, plan)
        return self

    def _prepare(self, cfg: JobConfig, joining: bool = False) -> None:
        self.cfg = cfg
        self.session = session = Session(
            cfg.settings(), info=run_info(cfg), joining=joining,
            fits=lambda ranks: (cfg.validate(ranks), cfg.mesh_shape(ranks))[1])
        world = session.world
        session.info.micro_batches = cfg.accumulation_steps(world.world_size)
        # loads on a thread while the group forms; the first step waits for it
        self.compile_cache = compile_cache_for(cfg, world.rank, world.local_rank,
                                               session.events)
        with session.timed("data"):  # first: a bad shard fails before a group
            self._data_for = cfg.data_rank(world.rank, world.world_size)
            self.data = training_batches(cfg, *self._data_for)
        self._first_done = False
        # split logits (tensor parallel): the loss and its backward work on them in place
        self.loss_parallel = sharded_model.split_loss(cfg.parallelism)

    def build(self, world: World) -> Parts:
        """The model, its optimizer and schedule on ``world``'s mesh, and the data of its
        rank (anew when the job's size changed): at start and in each new generation."""
        cfg = self.cfg
        # CPU denormals run math (and torchao's FP8 emulation) 50x slower late in
        # training, when gradients get small; flushing them costs no accuracy.
        torch.set_flush_denormal(world.device.type == "cpu")
        data_for = cfg.data_rank(world.rank, world.world_size)
        if self._data_for != data_for:
            self.data.close()
            self._data_for = data_for
            self.data = training_batches(cfg, *data_for)
        # a re-formed group restores from memory, not from init_from
        self.model, self.optimizer, self.scheduler, self.fp8_scales = sharded_model.build(
            cfg, world.mesh, world.device, world.timed,
            init_from=cfg.checkpoint.init_from if world.first else "")
        with world.timed("compile_cache"):
            self.compile_cache.ready()
        return Parts(self.model, self.optimizer,
                     state={"scheduler": self.scheduler, "data": self.data})

    @property
    def step(self) -> int:
        return self.session.step_done

    @property
    def device(self) -> torch.device:
        return self.session.device

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> Summary:
        """Trains to ``training.steps`` or a stop; a failure the warm path survives is
        survived here, any other raised for the cold path."""
        session = self.session
        while session.running:
            with session.step() as step:
                self.run_step(step)
            if not self._first_done and session.step_done:
                self._first_done = True  # after it: saving is not part of the start-up
                session.say(self.compile_cache.first_step_done())
        return session.finish()

    def run_step(self, step: int) -> None:
        """One step's batch, trained (or skipped)."""
        micro_batches = self.data.next_step()
        if self.session.skipping():
            self.scheduler.step()  # the batch is consumed, the schedule moves on
        else:
            self.train_step(micro_batches)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches, then one optimizer step
        (unless judged bad). Returns this rank's mean loss (a tensor: no sync)."""
        session, step = self.session, self.session.step_done + 1
        if self.fp8_scales:  # of the weights as they are now: stepped, resumed or restored
            precompute_fp8_scales(self.model)
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            session.beat("forward")
            with self.loss_parallel():
                loss = self.loss(inputs, targets, step)
                session.beat("backward")
                (loss / len(micro_batches)).backward()
            loss = loss.detach()
            loss_sum += loss.full_tensor() if isinstance(loss, DTensor) else loss
            if i == 0 and session.recompute_due():
                self.recompute(step, own=loss.detach())
        loss = loss_sum / len(micro_batches)
        # clipped to the global norm llmtrain computes with the verdict: one collective
        session.optimizer_step(loss, max_norm=self.cfg.optim.max_grad_norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        # Asynchronous from pinned memory; the batch is never written to, so nothing can race.
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        loss = sharded_model.token_loss(self.model, inputs, targets)
        return fault_points.point("loss", step, loss)

    def recompute(self, step: int, own: torch.Tensor) -> None:
        """Computes the next rank's first micro-batch here too (see IntegrityGuard)."""
        world = self.session.world
        inputs, targets = self.data.peer_micro_batch((world.rank + 1) % world.world_size)
        with torch.no_grad():
            peer = self.loss(inputs, targets, step)
        self.session.compare_recompute(own, peer)

    # -- the end ----------------------------------------------------------------------

    exit_code = property(lambda self: self.session.exit_code)

    def close(self, failed: bool = False, timeout_s: float = 30.0) -> None:
        """Stops the data's reader and every component of the session."""
        try:
            self.data.close()
        finally:
            self.session.close(failed, timeout_s)
