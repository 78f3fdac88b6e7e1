"""Plan the training run on this machine.  Run by DVC after `probe` and `kernels` as:  python -m stages.plan

Writes `reports/plan.json` (frugaltune.planner): for every method, fits or not in `probe.memory_limit_gb` (default:
the machine's RAM, or the GPU's memory), the predicted peak, the micro-batch / accumulation / gradient
checkpointing / precision / threads it recommends and the ETA, calibrated by a few real steps of `train.method`
on this machine (`probe.calibrate`; not for a run too short for it: `probe.calibration_max_share`) in the
precision the plan chose.

The precision is decided once, here, from what this machine measured: the root pipeline's `reports/kernels.json`
`cpu` section (the kernels stage times a decoder layer in fp32 and bf16, once per machine; the scheduling
pipeline's plan reads the same report), or a CUDA GPU's compute capability, or `train.precision` when it is not
`auto`. Training then uses the plan's `run` section (method, precision,
micro-batch, gradient checkpointing): `train` depends on those four keys and not on the machine's facts, so a
recalibration that only moves the ETA retrains nothing, and another machine that resolves the same run reuses
the trained adapter.
"""

from __future__ import annotations


from frugaltune.entry import stage_main
from frugaltune import paths
from frugaltune.fit_summary import fit_line
from frugaltune.planner.assembly import build_plan
from frugaltune.planner.machine import measured_on
from frugaltune.planner.render import render
from frugaltune.config import Params
from frugaltune.io import read_json, write_json


def run(params: Params) -> dict:
    if not paths.HARDWARE.exists():
        raise FileNotFoundError(f"{paths.HARDWARE} is missing: run `dvc repro probe` first (the plan needs it).")
    hardware = read_json(paths.HARDWARE)
    measured = paths.kernels_report()  # the root pipeline's in every pipeline: measured once per machine
    kernels = read_json(measured) if measured.exists() else None
    plan = build_plan(params, hardware, measured_on(hardware, kernels))
    write_json(paths.PLAN, plan)  # atomic: temp file + rename
    print(render(plan))
    print(fit_line(plan))
    resolved = plan["run"]
    print(f"plan: wrote {paths.PLAN}; train runs {resolved['method']} in {resolved['precision']}, micro-batch "
          f"{resolved['micro_batch_size']}, gradient checkpointing {'on' if resolved['gradient_checkpointing'] else 'off'}")
    return plan


def main() -> None:
    stage_main("plan", run, FileNotFoundError, RuntimeError)


if __name__ == "__main__":
    main()
