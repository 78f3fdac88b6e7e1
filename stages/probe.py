"""Read this machine's stable hardware facts.  Run by DVC on every `dvc repro` as:  python -m stages.probe

Writes `reports/hardware.json`: CPU model, cores and flags (avx2, avx512f, avx512_bf16, AMX), RAM and the cgroup
limit, the torch build, and the NVIDIA GPUs that NVML sees (name, memory, compute capability), or `"gpus": []`
with a `gpu_note` saying why there are none.

The stage is `always_changed` in dvc.yaml: it runs on every `dvc repro`, in about two seconds, because a
pipeline that moves to another machine must not keep the last machine's facts. Volatile readings (free memory,
load, clock) stay out, so on the same machine the file comes out byte-identical and nothing downstream reruns;
on another machine the machine-dependent stages (`kernels`: the precision measurement, `plan`: calibration and
plan) rerun, and nothing else. The file in git describes the last machine that ran the pipeline.

`FRUGALTUNE_CPUINFO=<file>` makes the probe read that file instead of /proc/cpuinfo (the tests use it to play
another machine).
"""

from __future__ import annotations

import sys
from typing import Any

from frugaltune.faults import stage_errors
from frugaltune.hardware import probe
from frugaltune.io import write_json
from frugaltune import paths
from frugaltune.config import Params, ParamsError, load_params


def run(params: Params) -> dict[str, Any]:
    hw = probe(use_nvml=params.probe.nvml)
    write_json(paths.HARDWARE, hw)  # atomic: temp file + rename
    gpus = ", ".join(f"{g['name']} ({g['arch']})" for g in hw["gpus"])
    cpu = hw["cpu"]
    flags = ", ".join(flag for flag, present in cpu["flags"].items() if present) or "none of interest"
    print(
        f"probe: {cpu['model']}, {cpu['physical_cores']} physical / {cpu['logical_cores']} logical cores "
        f"({flags}), {hw['memory']['total_bytes'] / 2**30:.1f} GiB RAM, torch {hw['torch']['version']} "
        f"({hw['torch']['build']}); {gpus or hw['gpu_note']}"
    )
    return hw


def main() -> None:
    with stage_errors("probe"):  # a full disk: one clear line, not a traceback
        try:
            run(load_params())
        except ParamsError as exc:
            # probe is `always_changed`, the first stage of every `dvc repro`, and every stage validates the whole
            # file: a bad `train.lr` stops it first. Say that the key is at fault, not the probe (DVC still names
            # probe as the stage that failed).
            sys.exit(f"{exc} Nothing ran: every stage checks all of params.yaml and probe, the first stage of every "
                     "`dvc repro`, found this. Fix the key and rerun.")


if __name__ == "__main__":
    main()
