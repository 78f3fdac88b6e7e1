"""The plan as a table a person reads, each choice explained.

Library code, no entry point: the `plan` stage and `frugaltune plan` print it.
"""

from __future__ import annotations

from frugaltune.planner.memory import GiB


def render(plan: dict) -> str:
    """The plan as a table a person reads, each choice explained."""
    dev = plan["device"]
    lines = [
        f"Plan for {dev['name']} ({dev['kind']}): memory limit {plan['memory_limit_bytes'] / GiB:.1f} GiB "
        f"({plan['memory_limit_source']}), budget {plan['budget_bytes'] / GiB:.1f} GiB; {plan['threads']} threads; "
        f"precision {plan['precision']} ({plan['precision_why']}).",
        f"Constants: {plan['constants']['source']}.",
    ]
    if plan.get("gpus_note"):
        lines.append(plan["gpus_note"])
    header = f"{'method':9s} {'fits':5s} {'peak GiB':>8s} {'micro':>5s} {'accum':>5s} {'ckpt':>4s} {'ETA':>9s}  why"
    lines += ["", header, "-" * len(header)]
    # a method the calibration did not time (its budget spent, or not buildable here): its ETA is the calibrated
    # method's scaled by training FLOPs, marked so that it does not read as measured
    not_timed = (plan.get("constants") or {}).get("not_timed") or {}
    for method, p in plan["methods"].items():
        eta = "-" if p["eta_seconds"] is None else ("~" if method in not_timed else "") + _duration(p["eta_seconds"])
        mark = "*" if method == plan["configured_method"] else " "
        lines.append(f"{method + mark:9s} {'yes' if p['fits'] else 'NO':5s} {p['predicted_peak_bytes'] / GiB:8.2f} "
                     f"{p['micro_batch_size']:5d} {p['grad_accum']:5d} {'on' if p['gradient_checkpointing'] else 'off':>4s} "
                     f"{eta:>9s}  {p['why']}")
    lines.append("* configured (train.method). ETA: training wall time; " + next(
        (p["eta_note"] for m, p in plan["methods"].items() if m == plan["configured_method"]), ""))
    shown = [m for m in plan["methods"] if m in not_timed and plan["methods"][m]["eta_seconds"]]
    if shown:
        reasons = sorted({not_timed[m] for m in shown})
        lines.append(f"~ not timed here ({', '.join(shown)}: {'; '.join(reasons)}): the "
                     f"{plan['constants'].get('calibrated_method')} calibration scaled by training FLOPs per token")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
