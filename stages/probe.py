"""Record this machine's hardware facts and plan the training run on it.  Run by DVC as:  python -m stages.probe

1. `reports/hardware.json`: CPU model, cores and flags (avx2, avx512f, avx512_bf16, AMX), RAM, the torch build, and
   the NVIDIA GPUs that NVML sees (name, memory, compute capability), or `"gpus": []` with a `gpu_note` saying why
   there are none. Volatile readings (free memory, load, clock) stay out: `kernels` and training depend on this
   file, and a volatile reading would make DVC rerun them on every `dvc repro`. After moving the project to other
   hardware, run `dvc repro -f probe`; if the facts are the same the file is byte-identical and nothing reruns.
2. `reports/plan.json` (frugaltune.planner): for every method, fits or not in `probe.memory_limit_gb` (default: the
   machine's RAM, or the GPU's memory), the predicted peak, the micro-batch / accumulation / gradient checkpointing
   / precision / threads it recommends and the ETA, calibrated by a few real steps of `train.method` on this
   machine (`probe.calibrate`). The `train` stage takes its `auto` values from it and refuses a run that cannot
   fit. The same table prints here and from `frugaltune plan`.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from frugaltune import planner
from frugaltune.hardware import probe, supports_bf16_autocast
from frugaltune.io import read_json, write_json
from stages import paths
from stages.config import Params, ParamsError, load_params


def method_knobs(params: Params) -> dict[str, planner.MethodKnobs]:
    """`train.<method>` as the planner sees it (adapter rank, targets, quantization)."""
    knobs = {}
    for method in planner.ADAPTER_METHODS:
        k = getattr(params.train, method)
        extra = {"quant_type": k.quant_type, "double_quant": k.double_quant} if method == "qlora" else {}
        knobs[method] = planner.MethodKnobs(r=k.r, alpha=k.alpha, dropout=k.dropout,
                                            target_modules=tuple(k.target_modules), **extra)
    return knobs


def run_spec(params: Params, lengths: list[int]) -> planner.RunSpec:
    tp = params.train
    return planner.RunSpec(
        method=tp.method, batch_size=tp.batch_size, grad_accum=tp.grad_accum, epochs=tp.epochs,
        max_steps=tp.max_steps, seq_len=params.tokenize.max_length, lengths=tuple(lengths), seed=params.common.seed,
        group_by_length=tp.group_by_length, precision=tp.precision, micro_batch_size=tp.micro_batch_size,
        gradient_checkpointing=tp.gradient_checkpointing, threads=tp.threads, knobs=method_knobs(params),
    )


def build_plan(params: Params, hardware: dict[str, Any], calibrate: bool | None = None,
               memory_limit_gb: float | None = None, methods: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The plan for this project's model, data and params on `hardware` (used by this stage and `frugaltune plan`)."""
    from datasets import load_from_disk

    for needed, stage in ((paths.BASE_MODEL, "import_model"), (paths.TOKENIZED_DIR, "tokenize"),
                          (paths.LABELS, "ingest")):
        if not needed.exists():
            raise FileNotFoundError(f"{needed} is missing: run `dvc repro {stage}` first (the plan needs it).")
    labels = read_json(paths.LABELS)["labels"]
    lengths = [len(ids) for ids in load_from_disk(str(paths.TOKENIZED_DIR))["train"]["input_ids"]]
    spec = run_spec(params, lengths)
    knobs = spec.knobs
    methods = methods or ("none", *planner.TRAINED_METHODS)
    shapes = {m: planner.model_shape(paths.BASE_MODEL, len(labels), m, knobs.get(m, planner.MethodKnobs()))
              for m in methods}
    limit_gb = memory_limit_gb if memory_limit_gb is not None else params.probe.memory_limit_gb
    draft = planner.make_plan(spec, hardware, shapes, planner.Constants(), limit_gb)
    calibrate = params.probe.calibrate if calibrate is None else calibrate
    method = spec.method
    if not calibrate or method == "none" or not draft["methods"][method]["fits"]:
        if calibrate and method != "none":
            print(f"probe: not calibrating: {method} does not fit by the analytic model")
        return draft
    entry = draft["methods"][method]
    from frugaltune.models import load_tokenizer

    large = entry["largest_batch"]["sequences"]
    split = math.ceil(spec.batch_size / entry["micro_batch_size"])  # the plan's parts of each batch
    print(f"probe: calibrating {method}: {params.probe.calibration_steps} steps at micro-batch "
          f"{max(1, large // 2)} and {large}, length {entry['largest_batch']['length']} ...")
    constants, calibration = planner.calibrate(
        paths.BASE_MODEL, labels, load_tokenizer(paths.BASE_MODEL).pad_token_id, method,
        knobs.get(method, planner.MethodKnobs()), shapes[method], bf16=entry["precision"] == "bf16",
        gradient_checkpointing=entry["gradient_checkpointing"],
        micro_batches=(max(1, large // 2), large) if large > 1 else (1, 2),
        seq_len=entry["largest_batch"]["length"], threads=draft["threads"], seed=params.common.seed,
        steps=params.probe.calibration_steps, allocator=params.train.allocator, batches=[
            (math.ceil(rows / split), length) for rows, length in planner.planned_batches(
                lengths, spec.batch_size, spec.grad_accum, spec.epochs, spec.max_steps, spec.seed,
                spec.group_by_length)[1]])
    return planner.make_plan(spec, hardware, shapes, constants, limit_gb, calibration)


def run(params: Params) -> dict[str, Any]:
    hw = probe(use_nvml=params.probe.nvml)
    write_json(paths.HARDWARE, hw)  # atomic: temp file + rename
    gpus = ", ".join(f"{g['name']} ({g['arch']})" for g in hw["gpus"])
    cpu = hw["cpu"]
    print(
        f"probe: {cpu['model']}, {cpu['physical_cores']} physical / {cpu['logical_cores']} logical cores, "
        f"{hw['memory']['total_bytes'] / 2**30:.1f} GiB RAM, torch {hw['torch']['version']} ({hw['torch']['build']}); "
        f"{gpus or hw['gpu_note']}; native bf16 (flags or GPU): {'yes' if supports_bf16_autocast(hw) else 'no'}"
    )
    plan = build_plan(params, hw)
    write_json(paths.PLAN, plan)
    print(planner.render(plan))
    print(f"probe: wrote {paths.HARDWARE} and {paths.PLAN}")
    return hw


def main() -> None:
    try:
        run(load_params())
    except (ParamsError, FileNotFoundError, RuntimeError) as exc:
        sys.exit(f"probe: {exc}")


if __name__ == "__main__":
    main()
