"""One line per plan: what does not fit under its memory limit, and what would, and how.

Library code: `frugaltune plan` prints it under the plan's table and puts it in `--json` as `fit`; the `plan` stage
prints it too. It reads the plan `frugaltune.planner` made (its memory model's choice of micro-batch, accumulation,
gradient checkpointing, int8 products and NF4 per method) and decides nothing itself.
"""

from __future__ import annotations

from frugaltune.methods import get as method_named

GiB = 2**30


def _how(entry: dict) -> str:
    how = f"micro-batch {entry['micro_batch_size']}"
    if entry["grad_accum"] > 1 and entry["fits"]:
        how += f" x {entry['grad_accum']} accumulation"
    extras = [name for name, on in (("gradient checkpointing", entry["gradient_checkpointing"]),
                                    ("int8 products", entry.get("int8_products"))) if on]
    return how + (f" with {' and '.join(extras)}" if extras else "")


def fit_line(plan: dict) -> str:
    """E.g. "At 8 GiB (7.2 usable): full needs 26.1 GiB even at micro-batch 1 with gradient checkpointing; lora fits
    at micro-batch 2 x 8 accumulation with gradient checkpointing (7.1 GiB); qlora (NF4) fits at micro-batch 4 x 4
    accumulation (5.5 GiB)." A method that does not fit shows its smallest configuration's need (the plan's peak
    for it)."""
    said = []
    for method, entry in plan["methods"].items():
        spec = method_named(method)
        if not spec.trained:
            continue
        name = f"{method} (NF4)" if spec.quantized_base else method
        peak = entry["predicted_peak_bytes"] / GiB
        if entry["fits"]:
            said.append(f"{name} fits at {_how(entry)} ({peak:.1f} GiB)")
        else:
            said.append(f"{name} needs {peak:.1f} GiB even at {_how(entry)}")
    fitting = [m for m, e in plan["methods"].items() if e["fits"] and method_named(m).trained]
    if not fitting:
        said.append("nothing trains here: lower tokenize.max_length or train.batch_size, or use a larger machine")
    return (f"At {plan['memory_limit_bytes'] / GiB:.3g} GiB ({plan['budget_bytes'] / GiB:.1f} usable): "
            + "; ".join(said) + ".")
