"""A run's machine-dependent settings, read from the plan.

Library code, no entry point. The `plan` stage (`python -m stages.plan`) decides precision, int8 products, the
attention crossover, threads and micro-batch once (frugaltune/planner/: `decide_machine`, `plan_method`) and writes
them to reports/plan.json. Every consumer (the train, evaluate, compare and federated stages, the scheduling
pipeline, the benchmarks) reads them here instead of deciding again; `frugaltune.training.setup` then builds the
run from params and this `Run` the same way for every caller (the planner's calibration included).
docs/ARCHITECTURE.md lists each decision with its one site.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING


from frugaltune import paths
from frugaltune.planner.assembly import check_fits
from frugaltune.planner.machine import decide_machine, int8_setting_name, measured_on
from frugaltune.io import read_json

if TYPE_CHECKING:
    import torch

    from frugaltune.config import Params


def machine_facts() -> tuple[dict, dict | None]:
    """This machine's facts (reports/hardware.json) and the kernels stage's measurement of this CPU (the root
    pipeline's report, paths.kernels_report; None when it measured another CPU: reports in git describe the last
    machine that ran)."""
    hardware = read_json(paths.HARDWARE) if paths.HARDWARE.exists() else {}
    report = paths.kernels_report()
    kernels = read_json(report) if report.exists() else None
    return hardware, measured_on(hardware, kernels)


def device() -> "torch.device":
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def read_plan(path: Path = paths.PLAN) -> dict | None:
    """reports/plan.json when it exists and describes this machine's CPU, else None (a plan from git describes
    the machine that last ran it)."""
    if not path.exists():
        return None
    plan = read_json(path)
    hardware, _ = machine_facts()
    here = hardware.get("cpu", {}).get("model")
    if plan.get("device", {}).get("kind") == "cpu" and here and plan["device"].get("name") != here:
        return None
    return plan


def machine(precision_setting: str = "auto", method: str = "lora", int8_setting: str | bool | None = None,
            plan: dict | None = None, ranks: int = 1, dims: tuple[int, int] | None = None,
            threads: int | None = None) -> dict:
    """The machine decisions for a run that has no entry of its own in the plan (evaluation, compare, federated
    clients): the plan's when it exists and was decided for the same `precision_setting`, else decided now by the
    plan's own function. Keys: bf16, precision_why, eager_attention_max_len, threads, cores, int8 (a decision dict).
    A plan written before `cores` was decided counts as none. The int8 decision is the plan's when it was made with
    the same `int8_setting` (a plan without the record: made with "auto"), else made now by the plan's function for
    that setting: a caller that sets true / false gets what it set, whatever the plan was made with. A caller
    that does not use int8 products (evaluation, the core count) leaves `int8_setting` None: nothing is decided
    again for it."""
    decided_in_plan = (plan or {}).get("machine", {})
    if decided_in_plan.get("precision_setting") == precision_setting and "cores" in decided_in_plan:
        decided = plan["machine"]
    else:
        hardware, measured = machine_facts()
        decided = decide_machine(hardware, measured, precision_setting,
                                 "auto" if int8_setting is None else int8_setting,
                                 (method,) if dims else (), dims, threads, ranks)
    setting = None if int8_setting is None else int8_setting_name(int8_setting)
    if setting is not None and decided.get("int8_setting", "auto") != setting:
        hardware, measured = machine_facts()
        decided = {**decided, "int8_setting": setting,
                   "int8": decide_machine(hardware, measured, decided["precision_setting"], int8_setting,
                                          (method,) if dims else (), dims, threads, ranks)["int8"]}
    int8 = decided["int8"].get(method) or {"on": False, "why": f"no int8 decision for {method} (no model dims)"}
    return {**decided, "int8": int8}


def model_dims(model_dir: Path = paths.BASE_MODEL) -> tuple[int, int] | None:
    """(hidden, intermediate) of the base model, which the int8 timing multiplies at; None before it is imported."""
    config = model_dir / "config.json"
    if not config.exists():
        return None
    values = read_json(config)
    hidden = values.get("hidden_size", 0)
    return hidden, values.get("intermediate_size", 4 * hidden)


@dataclass(frozen=True)
class Run:
    """What a training run resolves to on this machine: the plan's decisions for its method."""

    method: str
    bf16: bool
    micro_batch_size: int
    gradient_checkpointing: bool
    eager_attention_max_len: int
    threads: int
    int8: dict = field(default_factory=lambda: {"on": False, "why": "not decided"})
    predicted_peak_mb: float | None = None
    eta_seconds: float | None = None


def resolve_run(params: "Params", use_plan: bool = True) -> Run:
    """`params.train`'s run on this machine: `auto` micro-batch and gradient checkpointing from the plan's entry
    for the method, precision, int8 products, attention crossover and threads from the plan's machine section.

    Raises PlanError before anything loads when the plan says the method cannot fit. `use_plan=False` (the method
    comparison: every method on the same batches) takes the machine decisions but the configured batch, no
    checkpointing. Without a plan the same decisions are made now (planner.machine.decide_machine).
    """
    tp = params.train
    plan = read_plan()
    entry = check_fits(plan, tp.method) if plan and use_plan else {}
    decided = machine(tp.precision, tp.method, tp.int8_products, plan, tp.distributed.nproc_per_node, model_dims(),
                      tp.threads)
    if plan and use_plan and plan.get("run", {}).get("method") == tp.method:  # the configured run: its resolved keys
        bf16, eager = plan["run"]["precision"] == "bf16", int(plan["run"]["eager_attention_max_len"])
        int8 = {**decided["int8"], "on": bool(plan["run"].get("int8_products", decided["int8"]["on"]))}
    else:
        bf16, eager, int8 = decided["bf16"], decided["eager_attention_max_len"], decided["int8"]
    micro = tp.micro_batch_size if tp.micro_batch_size != "auto" else entry.get("micro_batch_size", tp.batch_size)
    ckpt = (tp.gradient_checkpointing if tp.gradient_checkpointing != "auto"
            else entry.get("gradient_checkpointing", False))
    return Run(method=tp.method, bf16=bool(bf16), micro_batch_size=int(micro), gradient_checkpointing=bool(ckpt),
               eager_attention_max_len=eager, threads=decided["threads"], int8=int8,
               predicted_peak_mb=entry.get("predicted_peak_mb"), eta_seconds=entry.get("eta_seconds"))
