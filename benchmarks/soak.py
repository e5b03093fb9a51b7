"""The long soak: a fault every minute or two for half an hour, on one running job.

Runs ``llmtrain chaos --repeat`` (every kind once in a seeded order, then at random) on
a job long enough to last ``--minutes``, and prints the verdict table and where the lost
time went; the baseline is the Young/Daly model's ETTR for the costs and failure rate
measured in the same run.

    python benchmarks/soak.py [--minutes 30] [--interval 60] [--workdir runs/soak] [--cold]

Lost ranks are replaced warm (see ``llmtrain.chaos.runner``) unless ``--cold``; the
per-kind table says which path each kind took.

Prints the table, then one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import time

from llmtrain.chaos import runner as chaos


def by_kind(verdicts: list[dict]) -> str:
    """Per fault kind: how many, all right or not, mean seconds to detect and recover,
    steps lost in all."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return f"{sum(xs) / len(xs):.1f}" if xs else "-"
    lines = [f"{'kind':<16} {'n':>3} {'right':>5} {'detect_s':>8} {'recover_s':>9} {'lost':>5}"
             f"  paths"]
    for kind in sorted({v["kind"] for v in verdicts}):
        vs = [v for v in verdicts if v["kind"] == kind]
        lines.append(f"{kind:<16} {len(vs):>3} {sum(v['correct'] for v in vs):>5} "
                     f"{mean(v['detect_s'] for v in vs):>8} "
                     f"{mean(v['recover_s'] for v in vs):>9} "
                     f"{sum(v['steps_lost'] or 0 for v in vs):>5}  "
                     f"{','.join(sorted({v['path'] for v in vs if v['path']})) or '-'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=60.0, help="mean seconds between faults")
    ap.add_argument("--step-s", type=float, default=0.27,
                    help="wall seconds per step, faults' cost included, to size the job "
                         "(0.27 on 2 CPU cores: 0.22 s steps, ETTR about 0.85)")
    ap.add_argument("--workdir", default=f"runs/soak-{int(time.time())}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cold", action="store_true", help="without the warm path")
    args = ap.parse_args()
    cfg = chaos.ChaosConfig(workdir=args.workdir, interval_s=args.interval, seed=args.seed,
                            repeat=True, steps=int(args.minutes * 60 / args.step_s),
                            warm=not args.cold)
    start = time.time()
    result = chaos.Chaos(cfg).execute()
    with open(f"{args.workdir}/verdict.json", "w") as f:
        json.dump(result, f, indent=1)
    print(chaos.table(result))
    print(by_kind(result["verdicts"]))
    figures = {k: result.get(k) for k in ("finished", "faults", "detected", "correct", "ettr",
                                          "ettr_predicted", "mtbf_s", "restart_cost_s",
                                          "bitwise_equal_to_reference")}
    figures["committed_checkpoints_lost"] = len(result["committed_checkpoints_lost"])
    figures["ettr_over_predicted"] = (round(result["ettr"] / result["ettr_predicted"], 3)
                                      if result.get("ettr_predicted") else None)
    figures["badput_s"] = {k: round(v, 1) for k, v in result.get("badput_s", {}).items()}
    figures["minutes"] = round((time.time() - start) / 60, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
