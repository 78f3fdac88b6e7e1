"""The plan: every method priced for the configured run on this machine, the configured one checked to fit.

Library code. The `plan` stage (`python -m stages.plan`) writes `build_plan`'s plan to `reports/plan.json`;
`frugaltune plan` prints it; the `train` stage takes its `auto` values from it and refuses a configuration that
cannot fit (`check_fits`). `build_plan` reads the project's data and model, decides the machine
(frugaltune.planner.machine), prices every method with the memory model (frugaltune.planner.memory) and, with
`probe.calibrate`, calibrates the configured method (frugaltune.planner.calibration) and prices them again.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from frugaltune.methods import METHODS, NAMES, get as method_named, timing_order
from frugaltune.planner.calibration import RECALIBRATE, timed_micro_batches
from frugaltune.planner.recalibration import at_the_pick, calibrate_at
from frugaltune.planner.machine import decide_machine, layer_flops_per_s, memory_limit
from frugaltune.planner.memory import (Constants, GiB, MethodKnobs, MiB, ModelShape, memory_estimate, model_shape,
                                       planned_batches, planned_order, training_flops_per_token)
from frugaltune.planner.worker import CalibrationWorker

if TYPE_CHECKING:
    from frugaltune.config import Params


HEADROOM = 0.9  # plan to use at most this share of the memory limit: the OS and page cache need the rest


class PlanError(ValueError):
    """The configured run cannot fit; the message names the limit and a configuration that fits."""


@dataclass(frozen=True)
class RunSpec:
    """The configured training run, as the planner needs it."""

    method: str
    batch_size: int
    grad_accum: int
    epochs: float
    max_steps: int | None
    seq_len: int  # tokenize.max_length: the longest a sequence can be
    lengths: tuple[int, ...]  # token counts of the training split
    seed: int
    group_by_length: bool = True
    precision: str = "auto"  # auto | bf16 | fp32
    micro_batch_size: int | str = "auto"
    gradient_checkpointing: bool | str = "auto"
    threads: int | None = None
    knobs: dict[str, MethodKnobs] = field(default_factory=dict)
    ranks: int = 1  # train.distributed.nproc_per_node: data-parallel processes on this host
    micro_batch_tokens: int | None = None  # train.micro_batch_tokens: the loop splits wider batches (part_rows)
    # causal_lm: leading tokens every training row has in common (its prompt template), read once per micro-batch
    # part by the training loop (LoopConfig.speed.shared_prefix_min): the ETA does not count them per row
    shared_prefix: int = 0



def _candidates(batch_size: int) -> list[int]:
    sizes, size = [], batch_size
    while size >= 1:
        sizes.append(size)
        if size == 1:
            break
        size = math.ceil(size / 2)
    return sizes


def plan_method(method: str, run: RunSpec, hardware: dict, shape: ModelShape, constants: Constants,
                limit_bytes: int, bf16: bool, devices: list[dict],
                schedule: tuple[int, list[tuple[int, int]]] | None = None) -> dict:
    """Fits or not, the recommended micro-batch / accumulation / checkpointing, predicted peak and ETA."""
    knobs = run.knobs.get(method, MethodKnobs())
    steps, batches = schedule or planned_batches(list(run.lengths), run.batch_size, run.grad_accum, run.epochs,
                                                 run.max_steps, run.seed, run.group_by_length)
    if not method_named(method).trained:
        steps, batches = 0, []
    from frugaltune.training.batching import part_rows

    # The largest part the loop runs, in tokens, decides the peak; a batch of sequences at the cap bounds it.
    batches_or_cap = batches or [(run.batch_size, run.seq_len)]
    budget = int(limit_bytes * HEADROOM)
    # On CPU the ranks share the host's RAM, each with its own copy of the weights; a GPU rank has its own memory
    host_ranks = run.ranks if devices[0]["kind"] == "cpu" else 1
    if run.micro_batch_size != "auto":
        micro_options = [int(run.micro_batch_size)]
    else:
        micro_options = _candidates(run.batch_size)
    if run.gradient_checkpointing == "auto":
        ckpt_options = [False, True]
    else:
        ckpt_options = [bool(run.gradient_checkpointing)]
    # Fastest first: the largest micro-batch without checkpointing; checkpointing only when memory requires it.
    tried = []
    chosen = None
    for ckpt in ckpt_options:
        for micro in micro_options:
            split = math.ceil(run.batch_size / micro)
            # Every distinct part the loop runs: (rows, length, alone in its optimizer step), each rank computing its
            # share of a batch (every ranks-th sequence) in parts as the loop splits it. A part alone in its
            # step may have backward's gradients take the pages of the activations it frees (memory_estimate; the
            # calibration measures whether they do), so the peak is the largest estimate over them, not always the
            # largest part's.
            kinds = set()
            for rows, longest in batches_or_cap:
                mine = math.ceil(rows / run.ranks)
                part = part_rows(mine, longest, split, run.micro_batch_tokens)
                kinds.add((part, longest, run.grad_accum == 1 and run.ranks == 1 and part >= mine))
            estimates = {kind: memory_estimate(shape, method, bf16=bf16, micro_batch=kind[0], seq_len=kind[1],
                                               gradient_checkpointing=ckpt, constants=constants,
                                               device=devices[0]["kind"], knobs=knobs,
                                               gradients_overlap=kind[2] and constants.gradients_overlap)
                         for kind in kinds}
            worst = max(estimates, key=lambda kind: (estimates[kind]["peak"], kind[0] * kind[1]))
            est = estimates[worst]
            tried.append((micro, ckpt, est["peak"] * host_ranks))
            if est["peak"] * host_ranks <= budget:
                chosen = (micro, ckpt, est)
                break
        if chosen:
            break
    fits = chosen is not None
    micro, ckpt, est = chosen or (micro_options[-1], ckpt_options[-1], memory_estimate(
        shape, method, bf16=bf16, micro_batch=1, seq_len=worst[1], gradient_checkpointing=ckpt_options[-1],
        constants=constants, device=devices[0]["kind"], knobs=knobs))
    split = math.ceil(run.batch_size / micro)
    padded = sum(rows * length for rows, length in batches)
    if run.shared_prefix and not ckpt:  # each part computes the shared prefix once, not once per row
        parts = split * run.ranks
        padded -= sum(max(rows - parts, 0) * run.shared_prefix for rows, _ in batches)
    rows = sum(r for r, _ in batches)
    flops = padded * training_flops_per_token(shape, method, padded / rows) if rows else 0.0
    eta, eta_note = _eta(method, constants, steps, padded, ckpt, flops)
    calibrated, ratio = constants.calibrated_method, constants.measured_ratio(method, ckpt)
    peak_note = None
    if ratio is not None:
        peak_note = (f"activations: {calibrated}'s x {ratio:.2f}, the bytes {method} saved for backward against "
                     f"{calibrated}'s on the same rows here")
    elif calibrated and method != calibrated and method_named(method).trained:
        peak_note = f"activations: {method}'s analytic bytes per token at {calibrated}'s measured scale"
    grad_accum = run.grad_accum * split
    reasons = _reasons(method, run, fits, split, micro, grad_accum, ckpt)
    return {
        "fits": fits,
        "predicted_peak_bytes": est["peak"],
        "predicted_peak_mb": round(est["peak"] / MiB),
        "ranks": run.ranks,
        "predicted_peak_all_ranks_mb": round(est["peak"] * host_ranks / MiB),
        "components_mb": {k: round(v / MiB, 1) for k, v in est.items() if k != "peak"},
        "micro_batch_size": micro,
        "grad_accum": grad_accum,
        "effective_batch": run.batch_size * run.grad_accum,
        "gradient_checkpointing": ckpt,
        "precision": "bf16" if bf16 else "fp32",
        "seq_len": run.seq_len,
        "largest_batch": {"sequences": worst[0], "length": worst[1]},  # the largest part the loop runs
        "steps": steps,
        "padded_tokens": padded,  # the tokens the model computes: padding counted, shared prefixes once per part
        "shared_prefix": run.shared_prefix if not ckpt else 0,
        "eta_seconds": None if eta is None else round(eta, 1 if eta >= 10 else 4),  # tiny test runs take ms
        "eta_note": eta_note,
        "peak_note": peak_note,
        "trainable_params": shape.trainable_params,
        "total_params": shape.total_params,
        "why": "; ".join(reasons) if fits else _does_not_fit(method, tried, budget, limit_bytes),
    }


def _eta(method: str, constants: Constants, steps: int, padded: int, ckpt: bool,
         flops: float) -> tuple[float | None, str]:
    """(ETA seconds, where it comes from) of `method`'s run: `steps` optimizer steps over `padded` tokens at the
    calibrated speed, scaled to `method` by its measured cost or its training FLOPs; not calibrated, the run's
    training `flops` at the kernels stage's measured layer speed (None: neither)."""
    eta, eta_note = None, "no calibration: run `frugaltune plan` with calibration for an ETA"
    trained = method_named(method).trained
    recompute = 4 / 3 if ckpt else 1.0  # checkpointing reruns the forward pass: +1 forward per 3 passes
    if constants.seconds_per_token is None and constants.flops_per_s and trained:
        eta = flops * recompute / constants.flops_per_s
        eta_note = (f"analytic, not calibrated: {flops * recompute / 1e12:.2f} TFLOP at the "
                    f"{constants.flops_per_s / 1e9:.0f} GFLOP/s the kernels stage measured through a decoder layer "
                    "(the steps' overhead, the optimizer and the start-up not counted)")
    elif constants.seconds_per_token is not None and trained:
        factor, calibrated = 1.0, constants.calibrated_method
        if calibrated and calibrated != method:
            factor = (constants.method_cost.get(method)
                      or method_named(method).flops_factor / method_named(calibrated).flops_factor)
        eta = (constants.startup_s + (steps * constants.step_overhead_s
                                      + padded * constants.seconds_per_token * recompute) * factor)
        if not calibrated or calibrated == method:
            eta_note = "measured on this machine"
        elif method in constants.method_cost:
            eta_note = (f"the {calibrated} calibration x {factor:.2f}: a step of {method} timed here against one of "
                        f"{calibrated} on the same micro-batch")
        else:
            why = constants.not_timed.get(method, "not asked for")
            eta_note = (f"the {calibrated} calibration x {factor:.2f} (training FLOPs per token: {method} not timed: "
                        f"{why})")
    elif not trained:
        eta, eta_note = 0.0, "nothing to train"
    return eta, eta_note


def _reasons(method: str, run: RunSpec, fits: bool, split: int, micro: int, grad_accum: int, ckpt: bool) -> list[str]:
    """Why the plan of a method that fits is what it is: accumulation, checkpointing, or as configured."""
    reasons = []
    if not method_named(method).trained:
        reasons.append("inference only: weights and one batch of hidden states")
    elif fits:
        if split > 1:
            reasons.append(f"micro-batch {run.batch_size} does not fit; {micro} x {grad_accum} accumulation keeps the "
                           f"effective batch {run.batch_size * run.grad_accum}")
        if ckpt and run.gradient_checkpointing == "auto":
            reasons.append("gradient checkpointing on: without it even micro-batch 1 exceeds the budget")
        if not reasons:
            reasons.append("fits as configured: no gradient checkpointing (it would cost ~33% time)")
    return reasons


def _does_not_fit(method: str, tried: list, budget: int, limit: int) -> str:
    smallest = min(peak for _, _, peak in tried)
    return (f"{method}: even the smallest option tried (micro-batch {tried[-1][0]}, gradient checkpointing "
            f"{'on' if tried[-1][1] else 'off'}) needs {smallest / GiB:.2f} GiB, over the budget of "
            f"{budget / GiB:.2f} GiB ({HEADROOM:.0%} of the {limit / GiB:.2f} GiB limit)")


def make_plan(run: RunSpec, hardware: dict, shapes: dict[str, ModelShape], constants: Constants,
              limit_gb: float | None = None, calibration: dict | None = None,
              measured_precision: dict | None = None, decided: dict | None = None) -> dict:
    """The plan for every method in `shapes`; `run.method` is the configured one.

    `decided`: the machine decisions (`decide_machine`; decided here without int8 products when None).
    `measured_precision`: the `cpu` section of reports/kernels.json (see `recommend_precision`). The plan's `run`
    section is what the configured run resolves to; the train stage depends on exactly those keys, so a
    recalibration that changes only the ETA or the predicted peak retrains nothing.
    """
    decided = decided or decide_machine(hardware, measured_precision, run.precision, "false", (),
                                        threads=run.threads, ranks=run.ranks)
    limit, limit_source = memory_limit(hardware, limit_gb)
    bf16 = decided["bf16"]
    gpus = hardware.get("gpus") or []
    devices = [{"kind": "cuda", "name": g["name"], "memory_bytes": g["memory_total_bytes"]} for g in gpus] or [
        {"kind": "cpu", "name": hardware.get("cpu", {}).get("model", "CPU"), "memory_bytes": limit}]
    if gpus:  # weights and activations live on the first GPU; its memory is the limit that matters
        limit, limit_source = int(gpus[0]["memory_total_bytes"]), f"{gpus[0]['name']} memory"
    schedule = planned_batches(list(run.lengths), run.batch_size, run.grad_accum, run.epochs, run.max_steps,
                               run.seed, run.group_by_length)
    methods = {m: plan_method(m, run, hardware, s, constants, limit, bf16, devices, schedule)
               for m, s in shapes.items()}
    for method, entry in methods.items():
        entry["int8_products"] = bool(decided["int8"].get(method, {}).get("on", False))
    configured = methods.get(run.method)
    fitting = [m for m, p in methods.items() if p["fits"] and method_named(m).trained]
    return {
        "configured_method": run.method,
        "fits": bool(configured and configured["fits"]),
        # What the configured run resolves to: the train and evaluate stages depend on these keys alone.
        "run": {"method": run.method, "precision": decided["precision"],
                "micro_batch_size": configured["micro_batch_size"] if configured else run.batch_size,
                "gradient_checkpointing": bool(configured["gradient_checkpointing"]) if configured else False,
                "eager_attention_max_len": decided["eager_attention_max_len"],
                "int8_products": bool(configured and configured["int8_products"])},
        # Every machine decision, made once (decide_machine): frugaltune.resolve reads them for every consumer
        "machine": decided,
        "device": devices[0],
        "memory_limit_bytes": limit,
        "memory_limit_source": limit_source,
        "budget_bytes": int(limit * HEADROOM),
        "threads": decided["threads"],
        "threads_why": decided["threads_why"],
        "ranks": run.ranks,
        "precision": decided["precision"],
        "precision_why": decided["precision_why"],
        "constants": asdict(constants),
        "calibration": calibration,
        "methods": methods,
        "methods_that_fit": fitting,
        "gpus_note": None if gpus else (hardware.get("gpu_note") or "no NVIDIA GPU: planning for CPU RAM"),
    }


def check_fits(plan: dict, method: str | None = None) -> dict:
    """The plan of `method` (default: the configured one), or PlanError saying what to change."""
    method = method or plan["configured_method"]
    entry = plan["methods"].get(method)
    if entry is None:
        raise PlanError(f"reports/plan.json has no plan for train.method = {method}: run `dvc repro plan`.")
    if entry["fits"] or not method_named(method).trained:
        return entry
    # The fastest fitting method first: the largest micro-batch, then the fewest training FLOPs, then the least memory.
    others = sorted((-p["micro_batch_size"], method_named(m).flops_factor, p["predicted_peak_bytes"], m)
                    for m, p in plan["methods"].items() if p["fits"] and method_named(m).trained)
    if others:
        best = plan["methods"][others[0][3]]
        suggestion = (f"train.method: {others[0][3]} fits (predicted peak {best['predicted_peak_bytes'] / GiB:.2f} GiB "
                      f"at micro-batch {best['micro_batch_size']})")
    else:
        suggestion = "no method fits: lower tokenize.max_length or train.batch_size, or use a machine with more memory"
    raise PlanError(
        f"train.method = {method} cannot fit: predicted peak {entry['predicted_peak_bytes'] / GiB:.2f} GiB with "
        f"micro-batch {entry['micro_batch_size']}, gradient checkpointing "
        f"{'on' if entry['gradient_checkpointing'] else 'off'}; the limit is {plan['memory_limit_bytes'] / GiB:.2f} GiB "
        f"({plan['memory_limit_source']}, {HEADROOM:.0%} usable). Change: {suggestion}; or raise probe.memory_limit_gb "
        "if the machine has more memory than that."
    )


def method_knobs(params: "Params") -> dict[str, MethodKnobs]:
    """`train.<method>` as the planner sees it (adapter rank, targets, quantization), for the methods with adapters."""
    return {name: params.train.knobs(m) for name, m in METHODS.items() if m.adapters}


def run_spec(params: "Params", lengths: list[int]) -> RunSpec:
    tp = params.train
    return RunSpec(
        method=tp.method, batch_size=tp.batch_size, grad_accum=tp.grad_accum, epochs=tp.epochs,
        max_steps=tp.max_steps, seq_len=params.tokenize.max_length, lengths=tuple(lengths), seed=params.common.seed,
        group_by_length=tp.group_by_length, precision=tp.precision, micro_batch_size=tp.micro_batch_size,
        gradient_checkpointing=tp.gradient_checkpointing, threads=tp.threads, knobs=method_knobs(params),
        ranks=tp.distributed.nproc_per_node, micro_batch_tokens=tp.micro_batch_tokens,
    )


def common_prompt_prefix(input_ids: list[list[int]], labels: list[list[int]]) -> int:
    """How many leading tokens every causal_lm example has in common before its first scored prediction (the
    training loop reads them once per batch: `frugaltune.training.inference.shared_prefix_length`); 0 when fewer than
    the loop's minimum. Every batch shares at least these; the ETA still comes out low, because a token read once
    for the batch saves less than a row's token costs (docs/DECISIONS.md)."""
    from frugaltune.generation import _common_prefix_length
    from frugaltune.training.batching import IGNORE_INDEX
    from frugaltune.training.loop_config import Speed

    if len(input_ids) < 2:
        return 0
    length = min(_common_prefix_length(input_ids), min(len(ids) for ids in input_ids) - 1)
    for targets in labels:  # the logit before a row's first target token is its own
        scored = next((i for i, t in enumerate(targets) if t != IGNORE_INDEX), len(targets))
        length = min(length, max(scored - 1, 0))
    return length if length >= Speed.shared_prefix_min else 0


def build_plan(params: "Params", hardware: dict[str, Any], measured_precision: dict | None = None,
               run_calibration: bool | str | None = None, memory_limit_gb: float | None = None,
               methods: tuple[str, ...] | None = None, log=print, model=None) -> dict[str, Any]:
    """The plan for this project's model, data and params on `hardware` (the `plan` stage and `frugaltune plan`).

    Run from the project root. `measured_precision` is the `cpu` section of reports/kernels.json; the
    calibration steps run in the precision the plan chose, so the constants describe the run that will train.
    `model` (a `frugaltune.shapes.PlannedModel`, `frugaltune plan --model`): plan that model instead of
    models/base, its shape from its config, its calibration on its `weights_dir()` (random weights of its shape
    when it has none); the rows stay the project's, tokenized by models/base's tokenizer.
    """
    from frugaltune import paths

    for needed, stage in ((paths.BASE_MODEL, "import_model"), (paths.TOKENIZED_DIR, "tokenize"),
                          (paths.LABELS, "ingest")):
        if not needed.exists():
            raise FileNotFoundError(f"{needed} is missing: run `dvc repro {stage}` first (the plan needs it).")
    started = time.monotonic()  # `frugaltune plan --model` by shape: its answer's time (probe.calibration_by_shape_s)
    run_calibration = params.probe.calibrate if run_calibration is None else run_calibration
    # The calibration's process starts now: its imports run beside this function's own work (the data, the shapes,
    # the machine's decisions) instead of after it. Closed unused when the run is not calibrated.
    worker = (CalibrationWorker(params.train.allocator)
              if run_calibration and method_named(params.train.method).trained else None)
    try:
        return _build_plan(params, hardware, measured_precision, run_calibration, memory_limit_gb, methods, log, worker,
                           model, started)
    finally:
        if worker:
            worker.close()


def _too_short_to_calibrate(micro_batches: int, probe) -> str | None:
    """Why a run is not worth calibrating (`probe.calibrate: auto`), or None: the micro-batches the calibration
    would time are more than `probe.calibration_max_share` of the run's. A share of the run's own micro-batches,
    not of seconds: the analytic seconds leave out the steps' overhead, the optimizer and the start-up, and how
    much they leave out differs from one CPU and precision to another, so a threshold in seconds let a run
    several times longer than its analytic ETA go uncalibrated on a fast CPU (docs/DECISIONS.md)."""
    timed = timed_micro_batches(probe.calibration_steps)
    if micro_batches and timed <= probe.calibration_max_share * micro_batches:
        return None
    return (f"not calibrating: the calibration would time {timed} of the run's {micro_batches} micro-batches, over "
            f"probe.calibration_max_share ({probe.calibration_max_share:.0%}); with the model's load and the "
            "warm-up it would cost a good share of the run. Its ETA is analytic (probe.calibrate: true calibrates "
            "anyway)")


def _build_plan(params: "Params", hardware: dict[str, Any], measured_precision: dict | None,
                run_calibration: bool | str,
                memory_limit_gb: float | None, methods: tuple[str, ...] | None, log,
                worker: CalibrationWorker | None, model, started: float) -> dict[str, Any]:
    from datasets import load_from_disk

    from frugaltune import paths
    from frugaltune.models import load_tokenizer
    from frugaltune.training import setup

    labels = json.loads(paths.LABELS.read_text())["labels"]
    train_split = load_from_disk(str(paths.TOKENIZED_DIR))["train"]
    tokenizer = load_tokenizer(paths.BASE_MODEL)
    rows = setup.training_rows(params, train_split["input_ids"], tokenizer)  # as the model sees them (template)
    lengths = [len(ids) for ids in rows]
    spec = run_spec(params, lengths)
    if params.task.type == "causal_lm":
        spec = replace(spec, shared_prefix=common_prompt_prefix(train_split["input_ids"], train_split["labels"]))
    knobs = spec.knobs
    methods = methods or NAMES
    task = params.task.type
    config_dir = model.config_dir if model else paths.BASE_MODEL  # --model: its config, weights or not
    shapes = {m: model_shape(config_dir, max(len(labels), 1), m, knobs.get(m, MethodKnobs()), task)
              for m in methods}
    limit_gb = memory_limit_gb if memory_limit_gb is not None else params.probe.memory_limit_gb
    some_shape = next(iter(shapes.values()))
    decided = decide_machine(hardware, measured_precision, spec.precision, params.train.int8_products, methods,
                             (some_shape.hidden, some_shape.intermediate), spec.threads, spec.ranks)
    analytic = Constants(flops_per_s=layer_flops_per_s(measured_precision, decided["bf16"]))
    draft = make_plan(spec, hardware, shapes, analytic, limit_gb, measured_precision=measured_precision,
                      decided=decided)
    method = spec.method
    trained = method_named(method).trained
    if not run_calibration or not trained or not draft["methods"][method]["fits"]:
        if run_calibration and trained:
            log(f"plan: not calibrating: {method} does not fit by the analytic model")
        return draft
    _, order = planned_order(lengths, spec.batch_size, spec.grad_accum, spec.epochs, spec.max_steps, spec.seed,
                             spec.group_by_length)
    short = _too_short_to_calibrate(len(order), params.probe)
    if run_calibration == "auto" and short:
        log(f"plan: {short}")
        draft["calibration"] = {"skipped": short}
        return draft
    entry = draft["methods"][method]
    log(f"plan: calibrating {method} in {entry['precision']}: the run's own loop over "
        f"{timed_micro_batches(params.probe.calibration_steps)} of its micro-batches at most ...")
    # --model without weights: random weights of its shape, written only now that the calibration runs
    weights = model.weights_dir() if model else paths.BASE_MODEL
    others = [m for m in timing_order(methods)
              if m != method and method_named(m).trained and draft["methods"][m]["fits"]]
    limit = params.probe.calibration_by_shape_s
    budgeted = bool(model and model.by_shape and run_calibration == "auto" and limit)
    timeout = {}  # calibrate's own default, unless budgeted
    if budgeted:
        # a question asked before downloading a model: answered within the limit, what it timed by then calibrating
        left = limit - (time.monotonic() - started)
        if left <= 0:
            why = (f"not calibrating: writing the random weights left no time of probe.calibration_by_shape_s "
                   f"({limit:.0f} s); --calibrate calibrates without that limit")
            log(f"plan: {why}")
            draft["calibration"] = {"skipped": why}
            return draft
        others, timeout = [], {"timeout_s": left}
    timed = partial(calibrate_at, params, method, decided, weights, labels, tokenizer.pad_token_id,
                    knobs, shapes[method], rows, list(train_split["labels"]), order)
    constants, calibration = timed(entry, others, worker, timeout)
    if model and calibration["busy_note"]:  # `frugaltune plan --model`, not the plan stage: the advice is its own
        advice = f"`frugaltune plan --model {model.given} --calibrate`"
        calibration["busy_note"] = calibration["busy_note"].replace(RECALIBRATE, advice)
        constants = replace(constants, source=constants.source.replace(RECALIBRATE, advice))
    if calibration["busy_note"]:
        log(f"plan: {calibration['busy_note']}" + (
            f" (the timeout is what probe.calibration_by_shape_s, {limit:.0f} s, left after the random weights)"
            if budgeted and "timeout" in (calibration["stopped"] or "") else ""))
    replan = partial(make_plan, spec, hardware, shapes, limit_gb=limit_gb, measured_precision=measured_precision,
                     decided=decided)
    plan = replan(constants=constants, calibration=calibration)
    if not budgeted:  # a budgeted answer has no time left for a second calibration
        plan = at_the_pick(plan, method, entry, constants, calibration, timed, replan, log)
    eta = plan["methods"][method]["eta_seconds"]
    # What planning cost against what it plans (the calibration should stay a small share of the run)
    calibration["share_of_run"] = round(calibration["seconds"] / eta, 3) if eta else None
    return plan
