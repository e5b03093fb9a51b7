"""The global sample order: a keyed permutation computed on the fly, and batches cut from it.

A stored permutation of an epoch costs 8 bytes a sample on every rank (15 GB at 1.8 billion
samples). :class:`FeistelPermutation` costs a few round keys instead: sample ``i`` of an
epoch is a Feistel network over the next power of two above the sample count, applied
again while the result falls outside (cycle-walking), which keeps it a bijection of
``[0, num_samples)``. Any position is computed directly, so resuming needs one number.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from llmtrain import fault_points
from llmtrain.config import ConfigError, JobConfig
from llmtrain.data import TokenDataset, check_vocab, shard_urls

# Names the order in checkpoints: a resumed run must walk the same order it started on.
ORDER = "feistel-v1"
ROUNDS = 6  # Luby-Rackoff needs 4 with ideal round functions; 2 more for margin
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: every input bit flips about half of the output bits."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A bijection of ``[0, n)`` chosen by ``key``, evaluated per element in O(1) memory.

    The index's bits (``bits`` of them, ``2**bits >= n``) split into a left and a right
    part that may differ by one bit; each round XORs one part with a keyed hash of the
    other, which is invertible whatever the hash, so every round, and the network, is a
    bijection of ``[0, 2**bits)``. Results ``>= n`` are pushed through again: the walk
    ends inside ``[0, n)`` (a cycle of a permutation that starts there returns there) and
    takes fewer than two passes on average, as ``2**bits < 2n``.
    """

    def __init__(self, n: int, key: bytes):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.left_bits, self.right_bits = bits // 2, bits - bits // 2
        digest = hashlib.blake2b(key, digest_size=8 * ROUNDS).digest()
        self.keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The images of ``positions`` (ints in ``[0, n)``), as uint64."""
        x = np.asarray(positions, dtype=np.uint64)
        out = self._network(x)
        outside = out >= self.n
        while outside.any():
            out[outside] = self._network(out[outside])
            outside = out >= self.n
        return out

    def _network(self, x: np.ndarray) -> np.ndarray:
        rb = np.uint64(self.right_bits)
        lmask, rmask = np.uint64((1 << self.left_bits) - 1), np.uint64((1 << self.right_bits) - 1)
        left, right = x >> rb, x & rmask
        for i, key in enumerate(self.keys):
            if i % 2:
                right ^= _mix(left ^ key) & rmask
            else:
                left ^= _mix(right ^ key) & lmask
        return (left << rb) | right


class GlobalSampler:
    """This rank's share of a global sample order that no world size can change.

    Global sample ``g`` is position ``g % num_samples`` of the permutation of epoch
    ``g // num_samples`` (keyed by the seed and the epoch). Step ``k`` takes global
    samples ``[k*B, (k+1)*B)`` and rank ``r`` of ``W`` the ``r``-th contiguous ``B/W`` of
    them, so the union over ranks of a step is the same for any ``W``, and the
    checkpointed state is a single global counter.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int,
                 dp_rank: int, dp_world: int):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if global_batch_size % dp_world:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                             f"{dp_world} data-parallel ranks; choose a multiple of "
                             f"{dp_world}")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_world})")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.local_batch_size = global_batch_size // dp_world
        self.consumed_samples = 0
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> FeistelPermutation:
        if epoch != self._epoch:
            self._epoch = epoch
            key = f"{ORDER}/{self.seed}/{epoch}/{self.num_samples}".encode()
            self._perm = FeistelPermutation(self.num_samples, key)
        return self._perm

    def indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices of global samples ``[start, start + count)``, int64."""
        out = np.empty(count, dtype=np.int64)
        g = start
        while g < start + count:  # one piece per epoch the range touches
            epoch, pos = divmod(g, self.num_samples)
            take = min(start + count - g, self.num_samples - pos)
            out[g - start:g - start + take] = self.permutation(epoch)(
                np.arange(pos, pos + take, dtype=np.uint64))
            g += take
        return out

    def next_batch_indices(self) -> list[int]:
        """Dataset indices of this rank's slice of the next global batch; advances."""
        out = self.slice_indices(self.consumed_samples, self.dp_rank)
        self.consumed_samples += self.global_batch_size
        return out

    def slice_indices(self, consumed: int, dp_rank: int) -> list[int]:
        """Dataset indices of ``dp_rank``'s slice of the global batch starting at global
        sample ``consumed``."""
        start = consumed + dp_rank * self.local_batch_size
        return self.indices(start, self.local_batch_size).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed,
                "num_samples": self.num_samples, "order": ORDER}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["seed"] != self.seed or sd["num_samples"] != self.num_samples:
            raise ConfigError(
                f"the data changed since the checkpoint: it was saved with data.seed="
                f"{sd['seed']} over {sd['num_samples']} samples, this run has data.seed="
                f"{self.seed} over {self.num_samples} samples; resume with the same "
                f"data.seed, shards and data.seq_len, or start a new run")
        consumed = int(sd["consumed_samples"])
        order = sd.get("order", "stored permutation (llmtrain before the Feistel order)")
        epoch, pos = divmod(consumed, self.num_samples)
        if order != ORDER and pos:
            # At an epoch boundary nothing is lost: the next epoch starts a new order anyway.
            raise ConfigError(
                f"the checkpoint's data position (global sample {consumed}, {pos} samples "
                f"into epoch {epoch}) is in the sample order {order!r}, and this llmtrain "
                f"walks the order {ORDER!r}: the rest of epoch {epoch} would repeat some "
                f"samples and skip others. Finish the run with the llmtrain that wrote "
                f"the checkpoint, or resume it from a checkpoint at an epoch boundary "
                f"(a multiple of {self.num_samples} samples), or start a new run")
        self.consumed_samples = consumed


class BatchIterator:
    """One optimizer step's worth of this rank's micro-batches at a time.

    With ``prefetch`` > 0 a background thread reads that many steps ahead, so shard reads
    (range requests on object stores) overlap the step instead of stalling it; with
    ``pin_memory`` the batches land in page-locked memory, which lets the host-to-GPU copy
    run asynchronously (``non_blocking``). A step's batch is a function of its global
    position only, so prefetching changes no data, and the state is still the position of
    the batches handed out: a read-ahead batch is dropped when the position moves
    elsewhere (a resume, a rollback).
    """

    name, per_rank = "data", False  # its place in the run's state registry: global

    def __init__(self, dataset, sampler: GlobalSampler, micro_batch_size: int,
                 prefetch: int = 0, pin_memory: bool = False):
        if sampler.local_batch_size % micro_batch_size:
            raise ValueError(f"this rank's {sampler.local_batch_size} samples per step do "
                             f"not split into micro-batches of {micro_batch_size}")
        self.dataset = dataset
        self.sampler = sampler
        self.micro_batch_size = micro_batch_size
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self._reader: ThreadPoolExecutor | None = None  # started by the first step
        self._ahead: dict[int, Future] = {}  # global position -> that step's batch

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(inputs, targets), ...]``, each ``[micro_batch_size, seq_len]`` int64."""
        s = self.sampler
        start, stride = s.consumed_samples, s.global_batch_size
        if not self.prefetch:
            out = self._step_at(start)
        else:
            if self._reader is None:
                # Pinning from a thread whose current device is another GPU's would open
                # a context on that GPU: the reader takes this thread's device.
                device = torch.cuda.current_device() if self.pin_memory else None
                self._reader = ThreadPoolExecutor(
                    1, "llmtrain-data",
                    initializer=None if device is None else torch.cuda.set_device,
                    initargs=() if device is None else (device,))
            wanted = [start + k * stride for k in range(self.prefetch + 1)]
            for pos in [p for p in self._ahead if p not in wanted]:
                self._ahead.pop(pos).cancel()
            for pos in wanted:
                if pos not in self._ahead:
                    self._ahead[pos] = self._reader.submit(self._step_at, pos)
            out = self._ahead.pop(start).result()
        s.consumed_samples += stride
        return out

    def peer_micro_batch(self, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first micro-batch ``dp_rank`` got in the step just taken, for a recompute."""
        s = self.sampler
        indices = s.slice_indices(s.consumed_samples - s.global_batch_size, dp_rank)
        return self._micro_batches(indices[:self.micro_batch_size])[0]

    def _step_at(self, consumed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        fault_points.point("data_read", consumed // self.sampler.global_batch_size + 1)
        return self._micro_batches(self.sampler.slice_indices(consumed, self.sampler.dp_rank))

    def _micro_batches(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        samples = torch.stack([self.dataset[i] for i in indices])
        pairs = [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous())
                 for mb in samples.split(self.micro_batch_size)]
        if self.pin_memory:
            pairs = [(inputs.pin_memory(), targets.pin_memory()) for inputs, targets in pairs]
        return pairs

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sampler.load_state_dict(sd)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)


def training_batches(cfg: JobConfig, rank: int, world_size: int) -> BatchIterator:
    """This rank's batches of the run's data: a missing or truncated shard fails here,
    before any process group starts."""
    t = cfg.training
    check_vocab(cfg.data, cfg.model.vocab_size)
    dataset = TokenDataset(shard_urls(cfg.data, t.run_dir), cfg.data.seq_len)
    sampler = GlobalSampler(len(dataset), t.global_batch_size, cfg.data.seed, rank, world_size)
    # Pinned only where a GPU will take the batches (pinning needs CUDA).
    return BatchIterator(dataset, sampler, t.micro_batch_size, prefetch=cfg.data.prefetch,
                         pin_memory=torch.cuda.is_available() and cfg.parallelism.device != "cpu")
