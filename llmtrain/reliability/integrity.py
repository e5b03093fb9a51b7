"""Training-state integrity: a bad step never reaches the weights, a bad state never a
checkpoint.

Every step, on the device and without a host sync, the step is *judged*: each rank's loss
goes into one small all-reduce (so every rank holds every rank's loss and all judge
alike); the step is non-finite when a loss or the global gradient norm is inf/NaN, and a
spike when the global loss lies ``spike_z`` robust deviations (MAD) above the median of
the last ``spike_window`` applied losses. A judged step is not applied
(:func:`optimizer_step`): a fused optimizer takes the verdict as its ``found_inf``, which
leaves weights, moments and step count as they were, with no host sync; any other has
the verdict read on the host, and its step is not taken.

The verdicts are read on the host only where the loop reads values anyway (a report, a
save, a state check), become events naming the step, the ranks and the samples, and a
policy: go on (the step was skipped), roll back to the last checkpoint and skip the batch,
or stop after ``max_bad_steps`` within the window (the run diverges; exit 78).

Before every save (and every ``sdc_every`` steps) the state is *checked*: each rank
fingerprints its parameter shards bit for bit (an integer sum of their bits, so any
flipped bit changes it) and counts non-finite values; replicas that must be equal (HSDP)
and the gradient norm every rank computed are compared. A majority names the odd rank.
Two replicas have none: the run rolls back and replays, and the rank whose values at the
mismatched step lie far from the replay's held the corrupted replica.

Every ``recompute_every`` steps each rank also computes the next rank's first micro-batch:
the two losses must agree bit for bit, so a rank whose arithmetic is wrong disagrees with
both its neighbours (corruption that replicas share, since it arrives through averaged
gradients, is invisible to fingerprints).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.config import IntegrityConfig, step_ranges
from llmtrain.events import EventLog, read_events
from llmtrain.exit_codes import FatalError

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Verdict codes, as the device computes them.
_OK, _NONFINITE, _SPIKE = 0, 1, 2


class TrainingDiverged(FatalError, RuntimeError):
    """The run keeps producing bad steps or bad state: a restart would do the same."""


@dataclass
class BadStep:
    step: int
    reason: str              # "nonfinite" or "spike"
    loss: float
    grad_norm: float | None
    ranks: list[int]         # ranks whose own loss was not finite
    applied: bool = False    # a spike under on_spike="warn"


@dataclass
class StateCheck:
    step: int
    nonfinite_ranks: list[int] = field(default_factory=list)
    split: list[list[int]] = field(default_factory=list)  # replicas that differ, no majority
    suspects: list[int] = field(default_factory=list)     # odd ranks out of a majority
    diverged: list[int] = field(default_factory=list)     # named by the replay of a split

    @property
    def ok(self) -> bool:
        return not (self.nonfinite_ranks or self.split or self.suspects)


def fingerprint(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(each tensor's elements' bits summed as integers, the count of non-finite elements)
    on the device; equal replicas give equal sums, in any summation order."""
    bits = torch.stack([t.detach().reshape(-1).view(_INT_OF_SIZE[t.element_size()])
                        .sum(dtype=torch.int64) for t in tensors])
    bad = [(~torch.isfinite(t.detach())).sum() for t in tensors if t.is_floating_point()]
    return bits, sum(bad, torch.zeros((), dtype=torch.int64, device=bits.device))


def _number(x: float | None) -> float | str | None:
    """A float as JSON can hold it: "nan", "inf" and "-inf" as strings."""
    return x if x is None or math.isfinite(x) else str(x)


def replica_groups(mesh: DeviceMesh) -> list[list[int]]:
    """The groups of ranks holding the same shards (HSDP replicas) in the job's mesh:
    ``(dp_replicate, dp_shard)``, ``(dp_shard,)``, either with a last ``tp`` dim. The
    ranks of one coordinate in every dim but ``dp_replicate`` hold the same shards."""
    ranks = mesh.mesh
    replicas = ranks.shape[0] if (mesh.mesh_dim_names or ())[:1] == ("dp_replicate",) else 1
    return ranks.reshape(replicas, -1).T.tolist()


def learned_skips(run_dir: str) -> set[int]:
    """The batches earlier rollbacks of this run chose to skip (their events): rank 0
    reads the log, once, and tells the others, instead of every rank reading every file."""
    found: list = [[]]
    if dist.get_rank() == 0:
        try:
            found = [sorted({s for e in read_events(run_dir, "integrity_skip")
                             for s in e["steps"]})]
        except FileNotFoundError:
            pass
    dist.broadcast_object_list(found, src=0)
    return set(found[0])


def optimizer_step(optimizer: torch.optim.Optimizer, verdict: torch.Tensor | None) -> None:
    """Takes ``optimizer``'s step unless ``verdict`` (:meth:`Integrity.judge`'s: 1.0 for a
    bad step; None when integrity is off) says not to; a step not taken leaves the
    parameters and the optimizer's state as they were, bit for bit.

    An optimizer that takes the verdict as its ``found_inf`` (those whose
    ``_step_supports_amp_scaling`` says so, as ``GradScaler`` asks: fused Adam, AdamW, SGD
    and Adagrad in torch 2.13) skips on the device, with no host sync: its kernel leaves
    parameters and state, and takes back the step count it added. Every other one
    (foreach or for-loop Adam, AdamW and SGD, Adafactor, ...) refuses a ``found_inf`` or
    ignores it, so its verdict is read on the host: one sync, which waits for the step's
    forward and backward to finish, and the step is not called at all.

    A fused step that would create a parameter's state is decided on the host too: under
    ``found_inf`` fused SGD keeps a new momentum buffer as ``torch.empty_like`` made it,
    garbage the next step would take for momentum. That is the first step of each
    parameter without state (a fresh optimizer's first, once: a restored or loaded one
    has its state)."""
    if verdict is None:
        optimizer.step()
        return
    stepping = [p for group in optimizer.param_groups for p in group["params"]
                if p.grad is not None]
    if getattr(optimizer, "_step_supports_amp_scaling", False) \
            and _all_stepped(optimizer, stepping):
        optimizer.found_inf = verdict
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        return
    if verdict.item() != 0:  # the host sync
        return
    optimizer.step()
    _STEPPED.setdefault(optimizer, set()).update(map(id, stepping))


# each optimizer's parameters (ids) that have their state: stepped once, or restored
_STEPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _all_stepped(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Whether a step of ``params`` creates no state: each has been stepped by
    :func:`optimizer_step` (an optimizer that keeps none for it has none to create), or
    has state (a restore's, a load's)."""
    seen = _STEPPED.setdefault(optimizer, set())
    if all(id(p) in seen for p in params):
        return True
    seen.update(id(p) for p in params if optimizer.state.get(p))
    return all(id(p) in seen for p in params)


class Integrity:
    """Judges steps and checks the state for one rank; every rank decides alike.

    Registered in the run's state registry as ``integrity``: the window of recent losses
    (what a spike is judged against), how many steps were judged and the steps to skip,
    so a resume or a warm restore judges the next step as the run would have."""

    name, per_rank = "integrity", False

    @classmethod
    def for_run(cls, cfg: IntegrityConfig, run_dir: str, events: EventLog,
                device: torch.device, mesh: DeviceMesh, samples_per_step: int,
                spare: bool) -> Integrity:
        """This rank's, over the job's ``mesh``; the steps earlier rollbacks learned to
        skip are read from the run's events in ``run_dir`` (a ``spare`` learns them from
        its buddy's replica instead, not from a collective its peers are not in)."""
        return cls(cfg, events=events, device=device, rank=dist.get_rank(),
                   world_size=dist.get_world_size(), replicas=replica_groups(mesh),
                   global_batch_size=samples_per_step,
                   learned_skips=set() if spare else learned_skips(run_dir))

    def __init__(self, cfg: IntegrityConfig, *, events: EventLog, device: torch.device,
                 rank: int, world_size: int, replicas: list[list[int]],
                 global_batch_size: int, learned_skips: set[int] = frozenset()):
        self.cfg, self.events, self.device = cfg, events, device
        self.rank, self.world = rank, world_size
        self.replicas = replicas
        self.batch = global_batch_size
        self.skips = step_ranges("integrity.skip_steps", cfg.skip_steps) | set(learned_skips)
        self.history = torch.full((cfg.spike_window,), math.nan, device=device)
        self.judged = 0
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, [code, loss, norm, *losses])
        self.bad_steps: list[int] = []
        self.loss = math.nan  # the global loss of the last step read
        self.replayed: dict[int, list[int]] = {}  # split step -> each rank's fingerprint

    # -- what others ask -------------------------------------------------------------

    def enabled(self) -> bool:
        """Whether steps are judged and the state checked (``integrity.enable``)."""
        return self.cfg.enable

    def excludes_corrupt(self) -> bool:
        """Whether a rank named for silent data corruption has its node excluded
        (``integrity.on_sdc = exclude``)."""
        return self.cfg.on_sdc == "exclude"

    def skips_step(self, step: int) -> bool:
        """Whether ``step`` must not train (``integrity.skip_steps``, or a batch a
        rollback learned to skip)."""
        return step in self.skips

    def last_loss(self) -> float:
        """The global loss of the last step whose verdict was read (NaN before any)."""
        return self.loss

    # -- every step, on the device --------------------------------------------------

    def judge(self, step: int, local_loss: torch.Tensor, grad_norm: torch.Tensor | None,
              norm_share: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's verdict for :func:`optimizer_step` (1.0: do not apply) and its global
        gradient norm: ``grad_norm`` as given, or, from each rank's ``norm_share``
        (:func:`llmtrain.optim.square_norm_share`), summed in the same exchange as the
        losses. Costs one all-reduce of ``world_size + 1`` floats; integrity must be on."""
        losses = torch.zeros(self.world + 1, device=self.device)
        losses[self.rank] = local_loss.detach().float()
        if norm_share is not None:
            losses[self.world] = norm_share
        dist.all_reduce(losses)
        if norm_share is not None:
            grad_norm = losses[self.world].sqrt()
        losses = losses[:self.world]
        loss = losses.mean()
        norm = (grad_norm.detach().float() if grad_norm is not None
                else torch.zeros((), device=self.device))
        nonfinite = ~(torch.isfinite(losses).all() & torch.isfinite(norm))
        spike = self._spike(loss) & ~nonfinite
        code = torch.where(nonfinite, _NONFINITE, torch.where(spike, _SPIKE, _OK))
        skip = nonfinite | spike if self.cfg.on_spike != "warn" else nonfinite
        self.history[self.judged % self.cfg.spike_window] = torch.where(skip, math.nan, loss)
        self.judged += 1
        self.pending.append((step, torch.cat([torch.stack([code.float(), loss, norm]), losses])))
        return skip.float(), grad_norm

    def state_dict(self) -> dict:
        """Plain values: the window's losses (None for a skipped step's), the count of
        judged steps, the verdicts judged but not read yet (a snapshot between log steps
        holds some: restored without them, a bad step before it would never be reviewed,
        its rollback missed and ``max_bad_steps`` miscounted), the bad steps the window
        holds and the steps to skip. Reading the verdicts costs a host sync."""
        rows = self._rows()
        return {"history": [None if math.isnan(x) else x for x in self.history.tolist()],
                "judged": self.judged, "bad_steps": list(self.bad_steps),
                "pending": [[step, [_number(x) for x in row]]
                            for (step, _), row in zip(self.pending, rows)],
                "skips": sorted(self.skips)}

    def load_state_dict(self, state: dict) -> None:
        """The window and verdicts of an earlier step: those judged since then are
        dropped, to be judged again."""
        history = [math.nan if x is None else x for x in state["history"]]
        same_window = len(history) == len(self.history)  # else its size changed: anew
        if same_window:
            self.history = torch.tensor(history, dtype=self.history.dtype,
                                        device=self.history.device)
        self.judged = state["judged"] if same_window else 0
        self.pending = [(step, torch.tensor([float(x) for x in row], device=self.device))
                        for step, row in state.get("pending", [])]
        self.bad_steps = list(state["bad_steps"])
        self.skips |= set(state["skips"])

    def _spike(self, loss: torch.Tensor) -> torch.Tensor:
        if not self.cfg.spike_z or self.judged < self.cfg.spike_window // 2:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        median = self.history.nanmedian()
        spread = torch.maximum(1.4826 * (self.history - median).abs().nanmedian(),
                               0.01 * median.abs())  # a flat loss is no licence to flag noise
        return loss - median > self.cfg.spike_z * spread

    # -- where the loop reads values anyway, on the host -----------------------------

    def _rows(self) -> list[list[float]]:
        """The pending verdicts on the host, in one copy. A row holds one loss per rank of
        the world it was judged in: those restored from before a shrink or a grow are
        longer or shorter than the rest (and name that world's ranks)."""
        if not self.pending:
            return []
        flat = torch.cat([row for _, row in self.pending]).cpu().tolist()
        ends = itertools.accumulate(row.numel() for _, row in self.pending)
        return [flat[end - row.numel():end] for (_, row), end in zip(self.pending, ends)]

    def read(self) -> list[BadStep]:
        """The bad steps judged since the last read (one device-to-host copy)."""
        if not self.pending:
            return []
        steps, rows = [step for step, _ in self.pending], self._rows()
        self.pending.clear()
        self.loss = rows[-1][1]
        bad = []
        for step, (code, loss, norm, *losses) in zip(steps, rows):
            if code == _OK:
                continue
            bad.append(BadStep(
                step=step, reason="nonfinite" if code == _NONFINITE else "spike", loss=loss,
                grad_norm=norm, ranks=[r for r, v in enumerate(losses) if not math.isfinite(v)],
                applied=code == _SPIKE and self.cfg.on_spike == "warn"))
        return bad

    def review(self, bad: list[BadStep], step: int) -> bool:
        """Records ``bad`` as events and applies the policy: True when the run must roll
        back; raises TrainingDiverged when it must stop."""
        for b in bad:
            self.events.emit_once(
                "step_skipped" if not b.applied else "loss_spike", step=b.step,
                reason=b.reason, loss=_number(b.loss), grad_norm=_number(b.grad_norm),
                ranks=b.ranks, samples=[(b.step - 1) * self.batch, b.step * self.batch])
        skipped = [b for b in bad if not b.applied]
        window = self.cfg.spike_window
        self.bad_steps = [s for s in self.bad_steps if s > step - window]
        self.bad_steps += [b.step for b in skipped]
        policies = {self.cfg.on_nonfinite if b.reason == "nonfinite" else self.cfg.on_spike
                    for b in skipped}
        if len(self.bad_steps) >= self.cfg.max_bad_steps or "stop" in policies:
            first = skipped[0] if skipped else bad[0]
            ranks = sorted({r for b in skipped for r in b.ranks})
            raise TrainingDiverged(
                f"training diverged at step {first.step}: {len(self.bad_steps)} step(s) of "
                f"the last {window} were non-finite or loss spikes (steps "
                f"{', '.join(map(str, self.bad_steps[-10:]))}"
                + (f"; non-finite loss on rank(s) {ranks}" if ranks else "")
                + f"; loss {first.loss:.4g}, grad norm {first.grad_norm:.4g}). Resume from an "
                f"earlier checkpoint with a lower optim.lr, or skip the data with "
                f"integrity.skip_steps")
        return "rollback" in policies

    def learn_skips(self, bad_step: int) -> list[int]:
        """The batches a rollback skips: ``rollback_skip`` of them, ending with the bad
        step's. Recorded as an event, so a restart skips them too."""
        steps = list(range(max(1, bad_step - self.cfg.rollback_skip + 1), bad_step + 1))
        self.skips.update(steps)
        self.events.emit_once("integrity_skip", steps=steps)
        return steps

    # -- the state, before every save and every sdc_every steps -----------------------

    def check_due(self, step: int) -> bool:
        every = self.cfg.sdc_every
        return self.cfg.enable and (bool(every) and step % every == 0 or step in self.replayed)

    def check_state(self, step: int, shards: list[torch.Tensor],
                    grad_norm: torch.Tensor | None) -> StateCheck:
        """Fingerprints every rank's ``shards`` (every tensor a save would write: the
        parameters and the optimizer's state, :meth:`StateRegistry.tensors`) and compares
        replicas (one all-reduce of ``3 * world_size`` integers and a host read)."""
        bits, nonfinite = fingerprint(shards)
        norm = torch.zeros((), device=self.device) if grad_norm is None else grad_norm.detach()
        table = torch.zeros(self.world, 3, dtype=torch.int64, device=self.device)
        table[self.rank] = torch.stack([bits.sum(), norm.float().view(torch.int32).long(),
                                        nonfinite])
        dist.all_reduce(table)
        rows = table.cpu().tolist()
        check = StateCheck(step, nonfinite_ranks=[r for r, row in enumerate(rows) if row[2]])
        for group, column in [(g, 0) for g in self.replicas] + [(list(range(self.world)), 1)]:
            values = Counter(rows[r][column] for r in group)
            if len(values) < 2:
                continue
            common, count = values.most_common(1)[0]
            if count * 2 > len(group):
                check.suspects += [r for r in group if rows[r][column] != common]
            else:
                check.split.append(group)
        if step in self.replayed and check.ok:
            check.diverged, distances = self._farthest_from_replay(self.replayed.pop(step), shards)
            self.events.emit_once("replica_diverged", step=step, ranks=check.diverged,
                                  how="replay", distances=distances)
        elif check.split:
            self.replayed[step] = self._differing(bits, shards, check.split)
        check.suspects = sorted(set(check.suspects))
        if not check.ok:
            self.events.emit_once("state_check_failed", step=step,
                                  nonfinite_ranks=check.nonfinite_ranks, split=check.split,
                                  suspects=check.suspects)
        return check

    def _differing(self, bits: torch.Tensor, shards: list[torch.Tensor],
                   split: list[list[int]]) -> dict[int, torch.Tensor]:
        """Copies of this rank's shards that differ between split replicas, for the replay
        to judge (every rank joins: the split is known to all)."""
        table = torch.zeros(self.world, len(shards), dtype=torch.int64, device=self.device)
        table[self.rank] = bits
        dist.all_reduce(table)
        rows = table.cpu().tolist()
        differ = {i for group in split for i in range(len(shards))
                  if len({rows[r][i] for r in group}) > 1}
        return {i: shards[i].detach().clone() for i in differ}

    def _farthest_from_replay(self, before: dict[int, torch.Tensor],
                              shards: list[torch.Tensor]) -> tuple[list[int], list[float]]:
        """After a split was rolled back and replayed: each rank's largest distance between
        its old values and the replay's. Corruption that reached the others only through
        averaged gradients leaves them close; the corrupted rank stands out (10x)."""
        mine = max([(old.double() - shards[i].double()).abs().max() for i, old in before.items()],
                   default=torch.zeros((), dtype=torch.float64, device=self.device))
        distances = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        distances[self.rank] = mine
        dist.all_reduce(distances)
        d = distances.cpu().tolist()
        order = sorted(range(self.world), key=lambda r: -d[r])
        clear = d[order[0]] > 0 and (self.world < 2 or d[order[0]] > 10 * d[order[1]])
        return ([order[0]] if clear else []), d

    # -- a recomputed micro-batch, every recompute_every steps ---------------------------

    def recompute_due(self, step: int) -> bool:
        every = self.cfg.recompute_every
        return self.cfg.enable and bool(every) and self.world > 1 and step % every == 0

    def compare_recompute(self, step: int, own: torch.Tensor, peer: torch.Tensor) -> list[int]:
        """``own``: this rank's loss of its first micro-batch; ``peer``: this rank's loss of
        the next rank's. Each pair must agree bit for bit; a rank in two disagreements (its
        own batch and the one it recomputed) computes wrongly. Returns the ranks named."""
        table = torch.zeros(self.world, 2, dtype=torch.int64, device=self.device)
        table[self.rank] = torch.stack([own.detach().float(), peer.detach().float()]
                                       ).view(torch.int32).long()
        dist.all_reduce(table)
        rows = table.cpu().tolist()
        pairs = [[r, (r + 1) % self.world] for r in range(self.world)
                 if rows[r][1] != rows[(r + 1) % self.world][0]]
        counts = Counter(r for pair in pairs for r in pair)
        named = sorted(r for r, n in counts.items() if n >= 2) if self.world >= 3 else []
        if pairs:
            self.events.emit_once("recompute_mismatch", step=step, pairs=pairs, ranks=named)
        return named

