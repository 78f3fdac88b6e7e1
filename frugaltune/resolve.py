"""A run's machine-dependent settings, read from the plan.

Library code, no entry point. The `plan` stage (`python -m stages.plan`) decides precision, int8 products, the
attention crossover, threads and micro-batch once (frugaltune/planner/: `decide_machine`, `plan_method`) and writes
them to reports/plan.json. Every consumer (the train, evaluate, compare and federated stages, the scheduling
pipeline, the benchmarks) reads them here and nothing here decides: a missing plan, one made on another CPU or for
other settings stops with a PlanError naming the setting and `dvc repro plan`. A library caller without a plan
calls the plan's entry point (`planner.machine.decide_machine`) itself. `frugaltune.training.setup` then builds the
run from params and this `Run` the same way for every caller (the planner's calibration included).
docs/ARCHITECTURE.md lists each decision with its one site.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING


from frugaltune import methods, paths
from frugaltune.planner.assembly import PlanError, check_fits
from frugaltune.planner.machine import int8_setting_name, measured_on
from frugaltune.io import read_json

if TYPE_CHECKING:
    import torch

    from frugaltune.config import Params

# What a plan's machine section holds since its decisions were only read: an older plan is made again
RECORDED = ("precision_setting", "cores", "threads_setting", "ranks", "int8_by_setting")


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


def _again(why: str) -> PlanError:
    return PlanError(f"{why}: the machine decisions (precision, int8 products, attention, threads) are the plan's; "
                     "run `dvc repro plan` (in the scheduling pipeline: `dvc repro scheduling/dvc.yaml:plan`).")


def read_plan(path: Path = paths.PLAN) -> dict:
    """reports/plan.json, made on this machine's CPU by this planner; else PlanError (a plan from git describes the
    machine that last ran it)."""
    if not path.exists():
        raise _again(f"{path} is missing")
    plan = read_json(path)
    hardware, _ = machine_facts()
    here = hardware.get("cpu", {}).get("model")
    if plan.get("device", {}).get("kind") == "cpu" and here and plan["device"].get("name") != here:
        raise _again(f"{path} was made on {plan['device'].get('name')!r}, this machine is {here!r}")
    missing = [key for key in RECORDED if key not in plan.get("machine", {})]
    if missing:
        raise _again(f"{path} has no machine.{missing[0]} (an older planner made it)")
    return plan


def machine(precision_setting: str = "auto", method: str = "lora", int8_setting: str | bool | None = None,
            plan: dict | None = None, ranks: int | None = None, threads: int | None = None,
            keys: tuple[str, str] = ("train.precision", "train.int8_products")) -> dict:
    """The plan's machine decisions for a run of `method` (reports/plan.json when `plan` is None). Keys: bf16,
    precision, precision_why, eager_attention_max_len, threads, cores, int8 (a decision dict).

    Read, never decided: the plan must have been made for the same `precision_setting` (or an explicit one that
    is the precision it decided), with `int8_setting` (true / false set explicitly are read from what the plan
    recorded for them; None: the caller does not use int8 products) and, for a caller that runs on `ranks`
    processes with `threads` (None: the plan's), for the same ranks with no thread count set (`ranks` None: the
    caller does not use the plan's threads). Otherwise PlanError names the setting (`keys`: the params keys of the first
    two) and says to run the plan again."""
    decided = (plan or read_plan())["machine"]
    if precision_setting not in (decided["precision_setting"], decided["precision"]):
        raise _again(f"{keys[0]} is {precision_setting}, the plan decided {decided['precision']} for "
                     f"train.precision = {decided['precision_setting']}")
    int8 = {"on": False, "why": "int8 products not asked for"}
    if int8_setting is not None:
        setting = int8_setting_name(int8_setting)
        if setting not in decided["int8_by_setting"]:
            raise _again(f"{keys[1]} is {setting}, the plan decided int8 products for "
                         f"train.int8_products = {decided['int8_setting']}")
        int8 = (decided["int8_by_setting"][setting].get(method)
                or {"on": False, "why": f"no int8 decision for {method} (no model dims)"})
    planned_threads = decided["threads_setting"] is None and decided["ranks"] == ranks
    if ranks is not None and threads is None and not planned_threads:
        raise _again(f"train.threads is null on {ranks} rank(s), the plan decided for train.threads = "
                     f"{decided['threads_setting']} on {decided['ranks']}")
    return {**decided, "threads": threads or decided["threads"], "int8": int8}


def cores(plan: dict | None = None) -> int:
    """The physical cores of this machine, as the plan counted them (reports/plan.json when `plan` is None)."""
    return int((plan or read_plan())["machine"]["cores"])


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
    """What a training run resolves to on this machine: the plan's decisions for its method, and the method itself
    (`train.method`'s registry entry, looked up here once: what the run sets up reads its facts from this)."""

    method: methods.Method
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

    Raises PlanError before anything loads when the plan says the method cannot fit, or is missing or was made for
    other settings (`machine`). `use_plan=False` (the method comparison: every method on the same batches) takes
    the machine decisions but the configured batch, no checkpointing.
    """
    tp = params.train
    plan = read_plan()
    entry = check_fits(plan, tp.method) if use_plan else {}
    decided = machine(tp.precision, tp.method, tp.int8_products, plan, tp.distributed.nproc_per_node, tp.threads)
    if use_plan and plan.get("run", {}).get("method") == tp.method:  # the configured run: its resolved keys
        bf16, eager = plan["run"]["precision"] == "bf16", int(plan["run"]["eager_attention_max_len"])
        int8 = {**decided["int8"], "on": bool(plan["run"].get("int8_products", decided["int8"]["on"]))}
    else:
        bf16, eager, int8 = decided["bf16"], decided["eager_attention_max_len"], decided["int8"]
    micro = tp.micro_batch_size if tp.micro_batch_size != "auto" else entry.get("micro_batch_size", tp.batch_size)
    ckpt = (tp.gradient_checkpointing if tp.gradient_checkpointing != "auto"
            else entry.get("gradient_checkpointing", False))
    return Run(method=methods.get(tp.method), bf16=bool(bf16), micro_batch_size=int(micro),
               gradient_checkpointing=bool(ckpt), eager_attention_max_len=eager, threads=decided["threads"], int8=int8,
               predicted_peak_mb=entry.get("predicted_peak_mb"), eta_seconds=entry.get("eta_seconds"))
