"""The plan's calibrations: at its analytic pick, and once more where the measured memory moves the pick.

Library code, no entry point; frugaltune.planner.assembly.build_plan calls it. The plan calibrates at its analytic
pick (`calibrate_at`); where the measured memory then moves the pick to another micro-batch or checkpointing, it
calibrates once more at the new pick (`at_the_pick`): a step costs a fixed amount per micro-batch as well as per
token (QLoRA dequantizes every weight at each forward and backward), which one micro-batch size cannot split, so
only the run's own micro-batch gives the run's ETA. The run's memory is then fitted through both calibrations' peaks
(`pooled_memory`); where that fit picks a micro-batch neither calibration ran, the run's time is measured there once
more (`_timed_at_third`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from frugaltune.planner.calibration import calibrate
from frugaltune.planner.memory import Constants, MethodKnobs, ModelShape
from frugaltune.planner.worker import CalibrationWorker

if TYPE_CHECKING:
    from frugaltune.config import Params


def calibrate_at(params: "Params", method: str, decided: dict, weights, labels: list[str], pad_token_id: int,
                  knobs: dict[str, MethodKnobs], shape: ModelShape, rows: list[list[int]], targets: list, order: list,
                  pick: dict, others: list[str], worker: CalibrationWorker | None, timeout: dict,
                  stop_when_busy: bool = True):
    """calibrate() of `method`'s run at `pick` (a plan entry's micro-batch, checkpointing and step counts), with
    `others` timed beside it: (Constants, calibration report). The plan stops a calibration the machine is too busy
    for (`stop_when_busy`)."""
    from frugaltune import methods
    from frugaltune.training import setup

    loop = setup.loop_config(params, method=methods.get(method), bf16=decided["bf16"],
                             micro_batch_size=pick["micro_batch_size"],
                             eager_attention_max_len=decided["eager_attention_max_len"])
    return calibrate(
        weights, labels, pad_token_id, method, knobs.get(method, MethodKnobs()), shape, rows=rows, targets=targets,
        order=order, loop=loop,
        int8=decided["int8"].get(method, {"on": False, "why": "not decided"}),
        gradient_checkpointing=pick["gradient_checkpointing"], threads=decided["threads"], seed=params.common.seed,
        time_samples=params.probe.calibration_steps, allocator=params.train.allocator, task=params.task.type,
        # every other method the plan lists and memory allows, timed on one micro-batch: each gets its own ETA
        others=[{"method": m, "knobs": knobs.get(m, MethodKnobs()),
                 "int8": decided["int8"].get(m, {"on": False, "why": "not decided"})} for m in others],
        worker=worker, planned=(pick["steps"], pick["padded_tokens"]), stop_when_busy=stop_when_busy,
        **timeout)


def at_the_pick(plan: dict, method: str, calibrated: dict, constants: Constants, calibration: dict, timed, replan,
                 log) -> dict:
    """The plan, calibrated again where the measured memory moved the pick off the micro-batch (or checkpointing)
    the calibration ran: a step's time is not its tokens' alone but a fixed cost per micro-batch too (QLoRA
    dequantizes every weight at each forward and backward), which a calibration at one micro-batch cannot split
    from the per-token cost. Timed at the run's own micro-batch, its ETA is the run's. The other methods keep the
    first calibration's costs; the report says what the first one ran and adds its seconds."""
    picked = plan["methods"][method]
    where = lambda entry: (entry["micro_batch_size"], entry["gradient_checkpointing"])  # noqa: E731
    if calibration["stopped"] or not picked["fits"] or where(picked) == where(calibrated):
        return plan
    log(f"plan: the measured memory picks micro-batch {picked['micro_batch_size']}"
        f"{' with gradient checkpointing' if picked['gradient_checkpointing'] else ''}, not the "
        f"{calibrated['micro_batch_size']} the calibration ran: calibrating {method} again at the pick ...")
    again, report = timed(picked, [], None, {})
    if report["stopped"]:  # keep the first: a stopped second calibration knows less
        log(f"plan: the second calibration stopped ({report['stopped']}); the ETA is the first's")
        return plan
    others = {"method_cost": constants.method_cost, "not_timed": constants.not_timed,
              "activation_ratio": constants.activation_ratio, "extra_cast_bytes": constants.extra_cast_bytes}
    report.update(others=calibration.get("others"), seconds=round(report["seconds"] + calibration["seconds"], 1),
                  first={"micro_batch_size": calibrated["micro_batch_size"],
                         "gradient_checkpointing": calibrated["gradient_checkpointing"],
                         "seconds": calibration["seconds"]})
    # the memory through both calibrations' peaks, since each one's own fit holds only near its own micro-batch
    # (pooled_memory): the second's alone, read within a small micro-batch, can under-predict a larger one enough to
    # move the pick past the micro-batch the first calibration measured over the limit
    memory = pooled_memory(constants, calibration["memory_points"], again, report["memory_points"])
    if memory:
        report["memory_from"] = "both calibrations' peaks"
    again = replace(again, **others, **memory)
    plan_again = replan(constants=again, calibration=report)
    final = plan_again["methods"][method]
    if where(final) == where(picked) or not final["fits"]:
        return plan_again
    if where(final) != where(calibrated):
        return _timed_at_third(plan_again, final, again, report, timed, replan, log)
    # the memory measured at the new pick moved it back (it did not fit there after all): the run is the first
    # calibration's micro-batch, so its time constants are the first's
    log(f"plan: micro-batch {picked['micro_batch_size']} does not fit as measured; the run keeps micro-batch "
        f"{calibrated['micro_batch_size']} and the first calibration's time")
    report["timed_at"] = "first"
    return replan(constants=replace(again, step_overhead_s=constants.step_overhead_s,
                                    seconds_per_token=constants.seconds_per_token, startup_s=constants.startup_s),
                  calibration=report)


def _timed_at_third(plan_again: dict, final: dict, again: Constants, report: dict, timed, replan, log) -> dict:
    """The plan whose pick, through both calibrations' memory, is a micro-batch neither ran (between the two, or
    past the second): its time measured there, since either one's fixed cost per micro-batch is not the run's. The
    memory stays the fit through both; a stopped third timing leaves the second's."""
    log(f"plan: through both calibrations' memory the pick is micro-batch {final['micro_batch_size']}"
        f"{' with gradient checkpointing' if final['gradient_checkpointing'] else ''}: timing it there ...")
    third, timing = timed(final, [], None, {})
    if timing["stopped"]:
        log(f"plan: that timing stopped ({timing['stopped']}); the ETA is the second calibration's")
        return plan_again
    report.update(seconds=round(report["seconds"] + timing["seconds"], 1), timed_at="third",
                  third={"micro_batch_size": final["micro_batch_size"],
                         "gradient_checkpointing": final["gradient_checkpointing"], "seconds": timing["seconds"]})
    return replan(constants=replace(again, step_overhead_s=third.step_overhead_s,
                                    seconds_per_token=third.seconds_per_token, startup_s=third.startup_s),
                  calibration=report)


def pooled_memory(first: Constants, first_points: list, second: Constants, second_points: list) -> dict:
    """The memory constants (runtime bytes, activation scale) through both calibrations' largest parts, once the
    measured memory moved the pick and the plan calibrated again there. Each calibration's own fit reads the slope of
    peak against tokens within one micro-batch, so it holds near that micro-batch only: the second's under-predicts
    a larger micro-batch (docs/PLAN.md, the ladder's Qwen2.5-0.5B QLoRA and Llama-3.2-1B QLoRA at 4 GiB), the
    first's the one the pick moved to (which is what moved it). Each largest part is the batch that sets its run's
    peak, measured: the line through both is exact at both micro-batches. {} where the two are not
    alike (the method or checkpointing differ, so their per-token bytes are not one quantity) or the peaks do not
    grow with the tokens."""
    if (not first_points or not second_points or first.calibrated_method != second.calibrated_method
            or first.calibrated_checkpointing != second.calibrated_checkpointing or second.calibrated_per_token <= 0):
        return {}
    per_token = second.calibrated_per_token
    own_tokens, own_rss = second_points[-1]
    (low_tokens, low_rss), (high_tokens, high_rss) = sorted([tuple(first_points[-1]), (own_tokens, own_rss)])
    if high_tokens <= low_tokens or high_rss <= low_rss:  # RSS noise swamped the activations (tiny models)
        return {}
    # the static bytes (weights, optimizer state; gradients where the fit stood on them) as the second's fit counted
    static = own_rss - second.runtime_bytes - second.activation_scale * per_token * own_tokens
    scale = (high_rss - low_rss) / (high_tokens - low_tokens) / per_token
    runtime = own_rss - static - scale * per_token * own_tokens
    return {"activation_scale": round(scale, 4), "runtime_bytes": max(0, int(runtime))}
