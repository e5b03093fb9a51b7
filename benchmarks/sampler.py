"""The sample order's memory per rank and index throughput: the Feistel order against the
stored permutation it replaced.

- **Memory per rank**: the new sampler's peak traced allocation (tracemalloc sees numpy's
  buffers) while it is built and draws ``--batches`` batches, at ``--samples`` (default
  1 billion) and at ``--baseline-samples``; the stored permutation's is measured at
  ``--baseline-samples`` and computed (8 bytes a sample) at ``--samples``, as allocating
  it there would take gigabytes.
- **Throughput**: dataset indices per second a rank gets from ``next_batch_indices``
  (global batch ``--batch`` on one rank, so a rank's whole step), new vs stored
  permutation at ``--baseline-samples`` (its build time counted separately), and new at
  ``--samples``.

    python benchmarks/sampler.py [--samples 1000000000] [--baseline-samples 10000000]

Prints a table, then one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc

import numpy as np

from llmtrain.data.sampler import GlobalSampler
from reaper import reaping


class StoredPermutation(GlobalSampler):
    """The old order: each epoch's ``rng.permutation`` held whole (8 bytes a sample)."""

    def slice_indices(self, consumed: int, dp_rank: int) -> list[int]:
        start = consumed + dp_rank * self.local_batch_size
        out = []
        for g in range(start, start + self.local_batch_size):
            epoch, pos = divmod(g, self.num_samples)
            if epoch != self._epoch:
                self._epoch = epoch
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(
                    self.num_samples)
            out.append(int(self._perm[pos]))
        return out


def measure(cls, samples: int, batch: int, batches: int) -> dict:
    tracemalloc.start()
    t0 = time.perf_counter()
    sampler = cls(samples, batch, 0, 0, 1)
    sampler.next_batch_indices()  # builds what the epoch needs
    t1 = time.perf_counter()
    for _ in range(batches):
        sampler.next_batch_indices()
    t2 = time.perf_counter()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"peak_bytes": peak, "first_batch_s": t1 - t0,
            "indices_per_s": batches * batch / (t2 - t1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1_000_000_000)
    p.add_argument("--baseline-samples", type=int, default=10_000_000)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--batches", type=int, default=200)
    args = p.parse_args()

    new_big = measure(GlobalSampler, args.samples, args.batch, args.batches)
    new_small = measure(GlobalSampler, args.baseline_samples, args.batch, args.batches)
    old_small = measure(StoredPermutation, args.baseline_samples, args.batch, args.batches)
    old_big_bytes = 8 * args.samples

    rows = [("feistel", args.samples, new_big, "measured"),
            ("feistel", args.baseline_samples, new_small, "measured"),
            ("stored permutation", args.baseline_samples, old_small, "measured"),
            ("stored permutation", args.samples, None, "computed: 8 B x samples")]
    print(f"{'order':<20} {'samples':>14} {'memory/rank':>14} {'first batch':>12} "
          f"{'indices/s':>12}  memory")
    for name, n, m, how in rows:
        mem = m["peak_bytes"] if m else old_big_bytes
        first = f"{m['first_batch_s'] * 1e3:9.1f} ms" if m else "-"
        rate = f"{m['indices_per_s']:12.3g}" if m else "-"
        print(f"{name:<20} {n:>14,} {mem / 2**20:>11.3f} MB {first:>12} {rate:>12}  {how}")
    figures = {
        "samples": args.samples,
        "feistel_bytes_per_rank": new_big["peak_bytes"],
        "permutation_bytes_per_rank": old_big_bytes,
        "memory_ratio": old_big_bytes / new_big["peak_bytes"],
        "goal_under_1mb": new_big["peak_bytes"] < 2**20,
        "feistel_indices_per_s": new_big["indices_per_s"],
        "baseline_samples": args.baseline_samples,
        "feistel_indices_per_s_baseline_size": new_small["indices_per_s"],
        "permutation_indices_per_s": old_small["indices_per_s"],
        "throughput_ratio": new_small["indices_per_s"] / old_small["indices_per_s"],
        "permutation_build_s": old_small["first_batch_s"],
        "permutation_bytes_measured": old_small["peak_bytes"],
    }
    print(f"feistel at {args.samples:,} samples: {new_big['peak_bytes'] / 1024:.1f} KiB per "
          f"rank vs {old_big_bytes / 2**30:.1f} GiB stored ({figures['memory_ratio']:.3g}x); "
          f"{figures['throughput_ratio']:.2f}x the stored permutation's index rate")
    print(json.dumps(figures))


if __name__ == "__main__":
    with reaping():
        main()
