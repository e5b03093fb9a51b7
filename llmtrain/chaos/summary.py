"""A chaos run's result read out: the verdict table, each kind's results, the rates a
fleet's failure mix weighs, what did not run, and whether the run passed.

A kind that did not run (left out for want of network namespaces, refused for a user's
loop, or given no room by the job's steps) is never counted: it has no row and no rate,
the table names it as not run, and under ``CI=true``, where everything a kind needs is set
up, a requested kind that did not run fails the run."""

from __future__ import annotations

import os

from llmtrain.chaos.verdict import Verdict


def in_ci() -> bool:
    """Whether this runs under ``CI=true`` (where nothing may be skipped)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def path_of(v: Verdict) -> str:
    """How the job recovered, and took the node back: warm, shrink+grow, cold..."""
    return "+".join(p for p in (v.path, v.returned) if p) or "-"


def row(v: Verdict) -> str:
    """Verdict ``v`` as a row of the table."""
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"
    return (f"{v.kind:<16} {v.target:<28} {'yes' if v.detected else 'NO':<4} "
            f"{num(v.detect_s):>7} {'ok' if v.correct else 'WRONG':<6} {path_of(v):<11} "
            f"{num(v.recover_s):>8} {num(v.return_s):>8} "
            f"{'-' if v.steps_lost is None else v.steps_lost:>5}  {v.diagnosis[:70]}")


def _mean(xs) -> str:
    xs = [x for x in xs if x is not None]
    return f"{sum(xs) / len(xs):.1f}" if xs else "-"


def by_kind(verdicts: list[dict], not_run: dict[str, str] | None = None) -> str:
    """Per fault kind: how many, detected and right, mean seconds to detect and recover,
    steps lost in all, the recovery paths taken; then each kind in ``not_run`` (kind ->
    why), counted nowhere."""
    lines = [f"{'kind':<16} {'n':>3} {'det':>4} {'right':>5} {'detect_s':>8} {'recover_s':>9} "
             f"{'lost':>5}  paths"]
    for kind in sorted({v["kind"] for v in verdicts}):
        vs = [v for v in verdicts if v["kind"] == kind]
        lines.append(f"{kind:<16} {len(vs):>3} {sum(v['detected'] for v in vs):>4} "
                     f"{sum(v['correct'] for v in vs):>5} "
                     f"{_mean(v['detect_s'] for v in vs):>8} "
                     f"{_mean(v['recover_s'] for v in vs):>9} "
                     f"{sum(v['steps_lost'] or 0 for v in vs):>5}  "
                     f"{','.join(sorted({path_of(Verdict(**v)) for v in vs} - {'-'})) or '-'}")
    for kind, why in sorted((not_run or {}).items()):
        lines.append(f"{kind:<16} {0:>3}  NOT RUN: {why}")
    return "\n".join(lines)


def weighted(verdicts: list[dict], mix: dict[str, float]) -> dict:
    """Detection and diagnosis rates as the fleet would see them: each kind's rate
    weighted by its share of the mix, over the kinds that ran (``mix_covered``: their
    share of the mix's weight)."""
    ran = {v["kind"] for v in verdicts} & set(mix)
    total = sum(mix[k] for k in ran)

    def rate(field: str) -> float:
        return sum(mix[k] * sum(v[field] for v in verdicts if v["kind"] == k)
                   / sum(v["kind"] == k for v in verdicts) for k in ran) / total if total else 0.0
    return {"weighted_detected": rate("detected"), "weighted_correct": rate("correct"),
            "mix_covered": total / sum(mix.values())}


def not_run(requested: list[str], ran: set[str], left_out: dict[str, str],
            no_room: list[str]) -> dict[str, str]:
    """The requested kinds that did not run (not in ``ran``), and why: left out
    (``left_out``: kind -> why), no room left for them (``no_room``), or not reached."""
    why = {k: "no room: the job neared its last step first" for k in no_room}
    why.update(left_out)
    return {k: why.get(k, "not reached") for k in requested if k not in ran}


def passed(result: dict, ci: bool | None = None) -> bool:
    """Whether the run held: some fault ran, and every fault was detected and diagnosed
    right, the job finished and saved its last step, nothing committed was lost, its
    weights (where compared) are the fault-free run's, every kind found room; and, under
    CI (``ci``; default: :func:`in_ci`), every requested kind ran."""
    ci = in_ci() if ci is None else ci
    return (result["finished"] and result["faults"] > 0
            and result["detected"] == result["correct"] == result["faults"]
            and not result["committed_checkpoints_lost"] and not result.get("no_room")
            and not (ci and result.get("not_run"))
            and result.get("final_checkpoint_committed", True)
            and result.get("bitwise_equal_to_reference", True))


def _kinds_lines(result: dict, ci: bool) -> list[str]:
    """What did not run, or found no room, in words."""
    lines = []
    for kind, why in result.get("not_run", {}).items():
        lines.append(f"NOT RUN: {kind} ({why}): skipped, counted nowhere"
                     + ("; under CI=true that fails the run" if ci else ""))
    for kind, why in result.get("left_out", {}).items():
        if kind not in result.get("not_run", {}):
            lines.append(f"left out: {kind} ({why})")
    if result.get("no_room"):
        lines.append(f"no room for: {', '.join(result['no_room'])} (the job neared its "
                     f"last step first: give more --steps)")
    if result["faults"] == 0:
        lines.append("no fault ran: nothing was tested")
    return lines


def _end_lines(result: dict) -> list[str]:
    """The job's end, its size changes, its weights and its ETTR, in words."""
    lines = []
    if result.get("nodes_killed_after_the_end"):
        lines.append(f"launchers still running a minute after the job ended, killed: "
                     f"{', '.join(result['nodes_killed_after_the_end'])} (see their logs; "
                     f"the verdict has the spare pool as it was)")
    for r in result.get("restarts", []):
        lines.append(f"cold restart at +{r['at_s']:.1f} s (rank 0 on {r['host']}, restart "
                     f"{r['restart_count']}) after: "
                     + "; ".join(r["after"] or ["nothing any rank or launcher said"]))
    if result.get("shrinks") or result.get("grows"):
        lines.append(f"shrinks {result['shrinks']}, grows back {result['grows']}; "
                     f"{result['below_full_s']:.0f} s below full size")
    if "bitwise_equal_to_reference" in result:
        lines.append(f"final weights bitwise equal to a fault-free run: "
                     f"{result['bitwise_equal_to_reference']}")
    if "reference" in result:
        lines.append(f"final weights: {result['reference']}")
    if "ettr" in result:
        lines.append(f"ETTR measured {result['ettr']:.3f}, Young/Daly model "
                     f"{result['ettr_predicted']:.3f} (MTBF {result['mtbf_s']:.0f} s, "
                     f"restart {result['restart_cost_s']:.1f} s); badput: " + ", ".join(
                         f"{k} {v:.1f}s" for k, v in result["badput_s"].items() if v > 0.05))
    if "mix" in result:
        lines.append(f"weighted by the mix ({result['mix']['source']}): detected "
                     f"{result['weighted_detected']:.3f}, diagnosed right "
                     f"{result['weighted_correct']:.3f}, over kinds holding "
                     f"{result['mix_covered']:.3f} of its weight")
    return lines


def table(result: dict, ci: bool | None = None) -> str:
    """The whole verdict: a row per fault, a row per kind, and the summary."""
    ci = in_ci() if ci is None else ci
    head = (f"{'fault':<16} {'target':<28} {'det':<4} {'detect_s':>7} {'diag':<6} "
            f"{'path':<11} {'recover_s':>8} {'return_s':>8} {'lost':>5}  diagnosis")
    rows = [row(Verdict(**v)) for v in result["verdicts"]]
    summary = [f"job finished: {result['finished']} (step {result['steps']})",
               f"faults detected: {result['detected']}/{result['faults']}, diagnosed right: "
               f"{result['correct']}/{result['faults']}",
               f"committed checkpoints lost: {len(result['committed_checkpoints_lost'])}"]
    if result["finished"] and not result.get("final_checkpoint_committed", True):
        summary.append(f"the job's last step ({result['steps']}) has no committed checkpoint")
    summary += _kinds_lines(result, ci) + _end_lines(result)
    return "\n".join([head, *rows, "", by_kind(result["verdicts"], result.get("not_run")),
                      "", *summary])
