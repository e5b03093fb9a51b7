"""The long soak: a fault every minute or two for half an hour, on one running job.

Runs ``llmtrain chaos --repeat`` (every kind once in a seeded order, then at random, or
by a fleet's failure mix with ``--mix``) on
a job long enough to last ``--minutes``, and prints the verdict table and where the lost
time went; the baseline is the Young/Daly model's ETTR for the costs and failure rate
measured in the same run.

    python benchmarks/soak.py [--minutes 30] [--interval 60] [--workdir runs/soak] [--cold]
        [--mix llama3|FILE] [--spares N] [--repair-s 20]

Lost ranks are replaced warm (see ``llmtrain.chaos.runner``) unless ``--cold``; the
per-kind table says which path each kind took. With ``--spares 0`` no spare waits: a
lost node's job shrinks, and grows back when the node returns ``--repair-s`` after its
fault.

Prints the table, then one JSON line of the figures, and exits 1 unless the run passed
(``llmtrain.chaos.summary.passed``). A kind the run could not inject (``partition`` and
``lossy_link`` without network namespaces) is listed under ``not_run`` and counted nowhere;
under ``CI=true`` it fails the run. Stopped (Ctrl-C, SIGTERM), the soak ends its nodes,
unmounts its checkpoint filesystem and removes its namespaces before it exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from llmtrain.chaos import runner as chaos


def main() -> int:
    """Runs the soak; 0 if it passed, else 1."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=60.0, help="mean seconds between faults")
    ap.add_argument("--step-s", type=float, default=0.18,
                    help="wall seconds per step, faults' cost included, to size the job "
                         "(0.18 on 2 CPU cores: 6,666 steps took 19.8 minutes at 0.27)")
    ap.add_argument("--workdir", default=f"runs/soak-{int(time.time())}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cold", action="store_true", help="without the warm path")
    ap.add_argument("--spares", type=int, default=None,
                    help="spare nodes (default: chaos's); 0: shrink, then grow back")
    ap.add_argument("--repair-s", type=float, default=20.0,
                    help="with --spares 0: a lost node returns this long after its fault")
    ap.add_argument("--mix", default="", help="draw faults by a mix's weights (a TOML file, "
                                              "or a shipped mix: llama3)")
    args = ap.parse_args()
    mix, source = chaos.load_mix(args.mix) if args.mix else (None, "")
    cfg = chaos.ChaosConfig(workdir=args.workdir, interval_s=args.interval, seed=args.seed,
                            repeat=True, steps=int(args.minutes * 60 / args.step_s),
                            warm=not args.cold, mix=mix, mix_source=source,
                            spares=args.spares, repair_s=args.repair_s)
    start = time.time()
    result = chaos.Chaos(cfg).execute()
    with open(f"{args.workdir}/verdict.json", "w") as f:
        json.dump(result, f, indent=1)
    print(chaos.table(result))
    figures = {k: result.get(k) for k in ("finished", "faults", "detected", "correct", "ettr",
                                          "ettr_predicted", "mtbf_s", "restart_cost_s",
                                          "bitwise_equal_to_reference", "weighted_detected",
                                          "weighted_correct", "mix_covered", "shrinks",
                                          "grows", "below_full_s")}
    figures["committed_checkpoints_lost"] = len(result["committed_checkpoints_lost"])
    figures["ettr_over_predicted"] = (round(result["ettr"] / result["ettr_predicted"], 3)
                                      if result.get("ettr_predicted") else None)
    figures["badput_s"] = {k: round(v, 1) for k, v in result.get("badput_s", {}).items()}
    figures["minutes"] = round((time.time() - start) / 60, 1)
    figures["not_run"] = result["not_run"]
    figures["passed"] = chaos.passed(result)
    print(json.dumps(figures))
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
