"""Record this machine's stable hardware facts in reports/hardware.json.  Run by DVC as:  python -m stages.probe

CPU model, cores and flags (avx2, avx512f, avx512_bf16, AMX), RAM, the torch build, and the NVIDIA GPUs that NVML
sees (name, memory, compute capability), or `"gpus": []` with a `gpu_note` saying why there are none. Free memory
and load are left out on purpose: `kernels` and training depend on this file, and a volatile reading would make
DVC rerun them on every `dvc repro`. DVC reruns this stage when its code or params change, not when the machine
does: after moving the project to other hardware, run `dvc repro -f probe`; if the facts differ, the stages that
depend on them rerun, and if they do not, the file is byte-identical and nothing else does.
"""

from __future__ import annotations

from typing import Any

from frugaltune.hardware import probe, supports_bf16_autocast
from frugaltune.io import write_json
from stages import paths
from stages.config import Params, load_params


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
    print(f"probe: wrote {paths.HARDWARE}")
    return hw


def main() -> None:
    run(load_params())


if __name__ == "__main__":
    main()
