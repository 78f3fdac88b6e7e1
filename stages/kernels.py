"""Build, verify and benchmark the CUDA kernels; measure the CPU's precisions.  Run by DVC as:  python -m stages.kernels

Reads reports/hardware.json (stage `probe`) and `kernels.*`; writes reports/kernels.json. The root dvc.yaml runs
it once per machine; the other pipelines (scheduling/dvc.yaml's plan) depend on this report instead of measuring
again. What it does depends on the machine (frugaltune/kernels/report.py):

- CUDA device and a CUDA build of torch: build the kernels for it, verify, benchmark, decide whether the
  attention is used.
- No CUDA device, nvcc present: compile for `kernels.archs` and record the ptxas figures; nothing runs (the
  kernels' logic is checked on the CPU by the unit tests, or `python -m frugaltune.kernels.emulate`).
- No nvcc: the CUDA kernels are recorded as skipped.

On every machine the CPU's fp32 and bf16 are verified and timed at the model's shapes: `cpu.preferred_precision`
and `cpu.training_attention` are what the plan reads. A failed build or verification never fails the stage; a
benchmark figure above the device's peak does (after the report is written): that is a measurement error.
"""

from __future__ import annotations

import time
from typing import Any

from frugaltune import paths
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import read_json, write_json
from frugaltune.kernels.report import build_report


def run(params: Params) -> dict[str, Any]:
    if not paths.HARDWARE.is_file():
        raise SystemExit(f"kernels: {paths.HARDWARE} is missing. Run `dvc repro probe` (or python -m stages.probe).")
    start = time.perf_counter()
    report, error = build_report(params.kernels, read_json(paths.HARDWARE), paths.KERNEL_BUILD_DIR,
                                 params.common.seed)
    report["seconds"] = round(time.perf_counter() - start, 2)
    write_json(paths.report("kernels"), report)  # atomic: temp file + rename
    print(f"kernels: {report['summary']}")
    print(f"kernels: wrote {paths.report('kernels')} in {report['seconds']} s")
    if error:
        raise SystemExit(error)
    return report


def main() -> None:
    stage_main("kernels", run)


if __name__ == "__main__":
    main()
