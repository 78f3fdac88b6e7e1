"""The clients' plans on this machine: the precision they train in (the plan's machine decisions) and, per client,
its preset hardware's plan (frugaltune/federated/profiles.py) timed by the plan stage's calibration of this CPU.

Library code, used by the federated stage and the centralized reference; never run.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from frugaltune import paths, resolve
from frugaltune.planner.assembly import RunSpec
from frugaltune.planner.memory import Constants
from frugaltune.config import FederatedParams, Params
from frugaltune.federated import profiles, rows
from frugaltune.io import read_json


class Precision(NamedTuple):
    """How this machine's clients (and the centralized reference) train: the plan's machine decisions for LoRA."""
    bf16: bool
    eager: int  # eager attention up to this many tokens
    int8: bool = False  # int8 products with the frozen weights (frugaltune/int8.py), as the train stage's LoRA


def machine_precision(params: Params) -> Precision:
    """The clients' precision on this machine: the plan's machine decisions (frugaltune.resolve) for LoRA, read,
    never decided again (`federated.precision` set to another precision than the plan's: resolve's PlanError);
    int8 products as the plan decided them for LoRA (`train.int8_products`: the project's one switch for them)."""
    decided = resolve.machine(params.federated.precision, "lora", params.train.int8_products,
                              keys=("federated.precision", "train.int8_products"))
    return Precision(bool(decided["bf16"]), int(decided["eager_attention_max_len"]), bool(decided["int8"]["on"]))


def machine_cores() -> int:
    """The physical cores of this machine, as the plan counted them (its machine decisions): the federation lays out
    its Ray workers (`federated.threads` cores each) and its server's evaluation threads on them."""
    return resolve.cores()


def plan_calibration(bf16: bool, int8: bool = False) -> tuple[Constants, int | None, str]:
    """(constants, threads they were measured with, where from) for the clients' time estimates: the plan stage's
    calibration (reports/plan.json) when it measured this CPU (reports/hardware.json), on a CPU, in the precision the
    clients train in, with their int8 products or without as they; else the planner's uncalibrated defaults, and the
    plans carry no time estimate."""
    if not paths.PLAN.exists():
        return Constants(), None, f"{paths.PLAN} missing: no time estimate (dvc repro plan)"
    plan = read_json(paths.PLAN)
    hardware = read_json(paths.HARDWARE) if paths.HARDWARE.exists() else {}
    device, values = plan.get("device", {}), plan.get("constants") or {}
    precision = "bf16" if bf16 else "fp32"
    if device.get("kind") != "cpu" or device.get("name") != hardware.get("cpu", {}).get("model"):
        why = f"{paths.PLAN} describes {device.get('name')!r}, not this CPU"
    elif values.get("seconds_per_token") is None:
        why = f"{paths.PLAN} is not calibrated (probe.calibrate)"
    elif plan.get("run", {}).get("precision") != precision:
        why = f"{paths.PLAN} was calibrated in {plan.get('run', {}).get('precision')}, the clients train in {precision}"
    elif bool((plan.get("calibration") or {}).get("int8_products")) != int8:
        why = (f"{paths.PLAN} was calibrated {'with' if not int8 else 'without'} int8 products, the clients train "
               f"{'with' if int8 else 'without'}")
    else:
        return Constants(**values), plan.get("threads"), f"{paths.PLAN}: {values.get('source')}"
    return Constants(), None, why + ": no time estimate"


def plan_clients(fp: FederatedParams, summary: dict, parts: Path, model_dir: Path, num_labels: int, max_length: int,
                 seed: int, precision: Precision) -> list[dict]:
    """Each client's plan on its declared hardware (frugaltune/federated/profiles.py): method, rank, micro-batch and
    local steps, with the time the plan stage's calibration of this CPU predicts (`round_budget_s` caps the steps by
    it) and the memory the planner's model predicts."""
    knobs = fp.lora.knobs()
    constants, calibrated_cores, source = plan_calibration(precision.bf16, precision.int8)
    plans = []
    for entry in summary["clients"]:
        preset = fp.profiles[entry["client"] % len(fp.profiles)]
        lengths = rows.client_lengths(parts, entry["client"]) or (max_length,)
        run = RunSpec(method="lora", batch_size=fp.batch_size, grad_accum=1, epochs=1.0,
                      max_steps=fp.local_steps, seq_len=max_length, lengths=lengths, seed=seed)
        plan = profiles.plan_client(profiles.resolve(preset), run, str(model_dir), num_labels, knobs, constants,
                                    fp.local_steps, fp.round_budget_s, calibrated_cores, fp.threads)
        plans.append({"client": entry["client"], "preset": preset, "examples": entry["examples"], **plan,
                      "calibration": source})
    return plans
