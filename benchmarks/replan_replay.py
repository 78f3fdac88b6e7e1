"""The federated budget's replan rules replayed over every federated stage on record: each committed
reports/federated.json whose budget was replanned, its rounds' predictions rescaled as each rule would have
predicted them, against what the rounds took.

    python benchmarks/replan_replay.py

Run from the repository root (it reads `git log` of reports/federated.json; nothing is trained). Per stage and
rule: how many rounds' predictions are beyond +-25 % of what they took, their range, and the stage's prediction
against its measured wall time. The rules (frugaltune/federated/budget.py `replan` predicts with "current"):
- calibration: the plan's calibration alone (no replan scaling);
- latest: the first federation's last measured round's pace (round 2's; round 1's in stages before 2026-12-01);
- halfway: halfway between that pace and the calibration's;
- current: the rule in use (budget.predicting_pace): halfway where the pace fell from round 1 to round 2, the
  latest pace otherwise.
The stage's prediction is rescaled in its per-round part only (start-ups, ends and, in stages before the replan
cut rounds instead of starting over, a restart's lost rounds as recorded), so a rule's stage figure is approximate;
the per-round figures are exact rescalings.
"""

import argparse
import json
import subprocess

from frugaltune.federated.budget import predicting_pace

REPORT = "reports/federated.json"


def recorded() -> list[tuple[str, str, dict]]:
    """(commit, date, report) for each distinct replanned stage in the history of REPORT, newest first."""
    run = subprocess.run(["git", "log", "--format=%h %ad", "--date=short", "--", REPORT], capture_output=True,
                         text=True)
    if run.returncode:
        raise SystemExit(f"replan_replay reads the history of {REPORT} with git, which said: {run.stderr.strip()}\n"
                         "Run it from the root of a git clone of the repository (an exported tree has no history).")
    log = run.stdout
    found, seen = [], set()
    for line in filter(None, log.splitlines()):
        commit, date = line.split()
        shown = subprocess.run(["git", "show", f"{commit}:{REPORT}"], capture_output=True, text=True)
        if shown.returncode:
            continue
        report = json.loads(shown.stdout)
        budget = report.get("budget") or {}
        replan = budget.get("replan") or {}
        if "training_scale" not in replan or budget.get("measured_seconds") in seen:
            continue
        seen.add(budget.get("measured_seconds"))
        found.append((commit, date, report))
    return found


def rules(replan: dict) -> dict[str, tuple[float, float]]:
    """Each rule's (training, evaluation) pace relative to the calibration's. A report's training_scale is the
    pace it predicted with: the latest measured one up to e6f455d; its `paces` list the rounds measured."""
    paces = [(p["training_scale"], p["evaluation_scale"]) for p in replan.get("paces", [])]
    latest = paces[-1] if paces else (replan["training_scale"], replan.get("evaluation_scale", 1.0))
    halfway = tuple((1.0 + now) / 2 for now in latest)
    current = predicting_pace(paces) if paces else latest
    return {"calibration": (1.0, 1.0), "latest": latest, "halfway": halfway, "current": current}


def replay(report: dict) -> dict[str, dict]:
    budget = report["budget"]
    replan = budget["replan"]
    used = (replan["training_scale"], replan.get("evaluation_scale", 1.0))
    out = {}
    for rule, (training, evaluation) in rules(replan).items():
        scale_t, scale_e = training / used[0], evaluation / used[1]
        errors, delta = [], 0.0
        for name, run in report["runs"].items():
            for planned, measured in zip(budget["runs"][name], run.get("round_seconds", [])):
                train_s = planned["training_seconds"]
                eval_s = planned["seconds"] - train_s
                factor = (train_s * scale_t + eval_s * scale_e) / max(train_s + eval_s, 1e-9)
                errors.append(measured["predicted_seconds"] * factor / measured["measured_seconds"] - 1)
                delta += train_s * (scale_t - 1) + eval_s * (scale_e - 1)
        rounds = len(errors) // max(len(report["runs"]), 1)
        delta += sum((budget.get("reference_seconds") or [])[:rounds]) * (scale_t - 1)
        if errors:
            out[rule] = {"beyond": sum(abs(e) > 0.25 for e in errors), "rounds": len(errors),
                         "low": min(errors), "high": max(errors),
                         "stage": (budget["predicted_seconds"] + delta) / budget["measured_seconds"] - 1}
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    totals: dict[str, list] = {}
    for commit, date, report in recorded():
        replayed = replay(report)
        if not replayed:
            continue
        print(f"{commit} {date}  stage measured {report['budget']['measured_seconds'] / 60:.1f} min")
        for rule, r in replayed.items():
            print(f"  {rule:12s} rounds beyond +-25 %: {r['beyond']:2d} of {r['rounds']:2d} "
                  f"({r['low']:+.0%} .. {r['high']:+.0%}); stage {r['stage']:+.1%}")
            total = totals.setdefault(rule, [0, 0, []])
            total[0] += r["beyond"]
            total[1] += r["rounds"]
            total[2].append(abs(r["stage"]))
    print("all stages:")
    for rule, (beyond, rounds, stages) in totals.items():
        mean = sum(stages) / len(stages)
        print(f"  {rule:12s} rounds beyond +-25 %: {beyond} of {rounds}; stage |error| mean {mean:.1%}, "
              f"max {max(stages):.1%} over {len(stages)} stages")


if __name__ == "__main__":
    main()
