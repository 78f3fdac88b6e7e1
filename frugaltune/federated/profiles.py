"""Per-client plans: each federated client declares its hardware (RAM, cores, optional GPU memory) and the project's
planner (frugaltune.planner) picks its method (LoRA, else QLoRA), micro-batch, gradient checkpointing and local
steps so that it fits and finishes a round in the time budget; a client that cannot fit anything is left out, with
the planner's reason.

Library code, used by the `federated` stage when it assigns clients; unit-tested in tests/unit/test_federated.py.
Presets describe typical owners: `laptop`, `small_cpu_box`, `gpu_server` (numbers below); `federated.clients` in
params.yaml may use a preset or give its own numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from frugaltune.methods import get as method_named
from frugaltune.planner.assembly import RunSpec, plan_method
from frugaltune.planner.memory import Constants, MethodKnobs, model_shape

GiB = 1024 ** 3


@dataclass(frozen=True)
class HardwareProfile:
    ram_gb: float
    cores: int
    gpu_memory_gb: float | None = None
    lora_rank: int | None = None  # None: the global rank; a smaller one makes a smaller, faster adapter


PRESETS = {
    "laptop": HardwareProfile(ram_gb=16, cores=4, lora_rank=8),
    "small_cpu_box": HardwareProfile(ram_gb=4, cores=2, lora_rank=4),
    "gpu_server": HardwareProfile(ram_gb=64, cores=16, gpu_memory_gb=24, lora_rank=16),
}


def resolve(profile: str | HardwareProfile) -> HardwareProfile:
    if isinstance(profile, HardwareProfile):
        return profile
    if profile not in PRESETS:
        raise ValueError(f"federated.clients: unknown hardware profile {profile!r}; presets: {', '.join(PRESETS)}, "
                         "or give ram_gb / cores / gpu_memory_gb.")
    return PRESETS[profile]


def plan_client(profile: HardwareProfile, run: RunSpec, model_config, num_labels: int,
                knobs: MethodKnobs, constants: Constants, local_steps: int,
                round_budget_s: float | None, calibrated_cores: int | None = None,
                host_threads: int | None = None) -> dict:
    """The client's plan: {"fits": True, method, rank, micro_batch_size, gradient_checkpointing, local_steps, ...}
    or {"fits": False, "reason": ...}. `run` is the configured run (batch size, lengths of the client's rows);
    `constants` the calibration of the CPU that measured it with `calibrated_cores` threads (the plan stage's).

    Time: a CPU client's step is the calibrated step scaled by cores (calibrated_cores / its cores: a rough model,
    stated in the plan), and `round_budget_s` caps its local steps by it; a GPU client gets no estimate from a CPU's
    calibration and keeps the configured steps. `predicted_seconds_here` is the same steps on this host with
    `host_threads` threads, where a simulation runs every client: the figure its measured seconds compare with."""
    rank = min(profile.lora_rank or knobs.r, knobs.r)
    knobs = replace(knobs, r=rank)
    on_gpu = profile.gpu_memory_gb is not None
    devices = [{"kind": "cuda" if on_gpu else "cpu"}]
    limit = int((profile.gpu_memory_gb if on_gpu else profile.ram_gb) * GiB)
    reasons = []
    for method in ("lora", "qlora"):
        if method_named(method).quantized_base and not on_gpu:
            reasons.append(f"{method}: 4-bit training needs a CUDA GPU here")
            continue
        shape = model_shape(model_config, num_labels, method, knobs)
        spec = replace(run, method=method, max_steps=local_steps, knobs={method: knobs})
        plan = plan_method(method, spec, {}, shape, constants, limit, bf16=on_gpu, devices=devices)
        if not plan["fits"]:
            reasons.append(plan["why"])
            continue
        steps, note = local_steps, "configured local steps (no calibration of this CPU: no time estimate)"
        predicted_seconds = predicted_here = per_step = None
        if plan["eta_seconds"] is not None:
            # per optimizer step, without the run's one-off startup (a client's model outlives its rounds)
            per_step = max(0.0, plan["eta_seconds"] - constants.startup_s) / max(1, plan["steps"])
        if per_step is not None and on_gpu:
            note = "configured local steps (a CPU's calibration says nothing of a GPU's speed: no estimate)"
        elif per_step is not None:
            own = per_step * calibrated_cores / profile.cores if calibrated_cores else per_step
            note = (f"{own:.2f} s/step estimated on {profile.cores} cores"
                    + (f" (measured on {calibrated_cores}, time assumed ~1/cores)" if calibrated_cores else ""))
            if round_budget_s:
                steps = max(1, min(local_steps, math.floor(round_budget_s / own)))
                note += f": {steps} step(s) fit the {round_budget_s:g} s round budget"
            predicted_seconds = round(own * steps, 3)
        if per_step is not None:
            scale = calibrated_cores / host_threads if calibrated_cores and host_threads else 1.0
            predicted_here = round(per_step * scale * steps, 3)
        return {"fits": True, "method": method, "lora_rank": rank, "micro_batch_size": plan["micro_batch_size"],
                "gradient_checkpointing": plan["gradient_checkpointing"], "local_steps": steps,
                "threads": profile.cores, "predicted_peak_mb": plan["predicted_peak_mb"],
                "predicted_seconds": predicted_seconds, "predicted_seconds_here": predicted_here, "why": plan["why"],
                "time_note": note, "profile": asdict(profile)}
    return {"fits": False, "reason": "; ".join(reasons), "profile": asdict(profile)}
