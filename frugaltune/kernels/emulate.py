"""Run the CUDA kernels' own code on the CPU, one OS thread per CUDA thread, and check it against float64.

Where no GPU exists (this machine, CI) this is the only way the .cu files execute, so it is run by the unit tests
(tests/unit/test_kernels.py) and by hand, never by the pipeline: each kernel launch
`k<<<grid, block, 0, stream>>>(args)` is rewritten into a call of `emu_launch` (kernels/emulation/shim.h), the
sources are compiled with the host C++ compiler against the CUDA headers, and kernels/emulation/harness.cpp runs
ragged cases of both kernels. It checks indexing, masking, tiling, the online softmax and barrier placement; it
does not model speed, memory coalescing or occupancy, which only the GPU suite measures.

    python -m frugaltune.kernels.emulate           # prints one JSON line per case
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from frugaltune.kernels import build
from frugaltune.kernels.cuda import ATTN_TOLERANCE, SGEMM_TOLERANCE

EMULATION_DIR = build.KERNELS_DIR / "emulation"
_LAUNCH = re.compile(r"([A-Za-z_]\w*<[^<>;]*>)\s*<<<(.*?)>>>\((.*?)\);", re.S)


def cuda_include_dir() -> Path | None:
    """The directory holding cuda_fp16.h (the headers are host-compilable)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = build.find_nvcc()
    if nvcc:
        # /usr/local/bin/nvcc may be a wrapper script; the real one sits in <cuda>/bin.
        text = Path(nvcc).read_text(errors="ignore")[:500] if Path(nvcc).stat().st_size < 10_000 else ""
        wrapped = re.search(r"exec\s+(\S+/bin/nvcc)", text)
        candidates.append(str(Path(wrapped.group(1)).parents[1]) if wrapped else None)
        candidates.append(str(Path(nvcc).resolve().parents[1]))
    for home in candidates:
        if home and (Path(home) / "include" / "cuda_fp16.h").is_file():
            return Path(home) / "include"
    return None


def rewrite_launches(source: str) -> str:
    """`kernel<...><<<grid, block, 0, stream>>>(args);`
    -> `emu_launch(dim3(grid), dim3(block), [&] { kernel<...>(args); });`"""

    def launch(match: re.Match) -> str:
        config = [part.strip() for part in re.split(r",(?![^<]*>)", match.group(2))]
        return f"emu_launch(dim3({config[0]}), dim3({config[1]}), [&] {{ {match.group(1)}({match.group(3)}); }});"

    rewritten, count = _LAUNCH.subn(launch, source)
    if count == 0:
        raise ValueError("no kernel launch (<<<...>>>) found to rewrite")
    return rewritten.replace('#include "launchers.h"', '#include "shim.h"\n#include "launchers.h"', 1)


def build_harness(build_root: Path, cxx: str | None = None) -> Path:
    """Compile the emulated kernels and the harness (cached by source hash); return the executable."""
    cxx = cxx or shutil.which("g++") or shutil.which("c++")
    include = cuda_include_dir()
    if cxx is None or include is None:
        raise FileNotFoundError("emulation needs a C++20 compiler (g++) and the CUDA headers (cuda_fp16.h)")
    sources = [build.KERNELS_DIR / name for name in build.KERNEL_SOURCES.values()]
    support = [build.KERNELS_DIR / h for h in build.HEADERS] + [EMULATION_DIR / "shim.h", EMULATION_DIR / "harness.cpp"]
    key = build.source_hash(sources + support, cxx)[:16]
    out_dir = Path(build_root) / f"emulation-{key}"
    exe = out_dir / "harness"
    if exe.is_file():
        return exe
    out_dir.mkdir(parents=True, exist_ok=True)
    units = [EMULATION_DIR / "harness.cpp"]
    for source in sources:
        unit = out_dir / f"{source.stem}_emulated.cpp"
        unit.write_text(rewrite_launches(source.read_text()), encoding="utf-8")
        units.append(unit)
    tmp = out_dir / f"harness.{os.getpid()}.tmp"
    command = [cxx, "-std=c++20", "-O1", "-pthread", "-w", "-I", str(include), "-I", str(build.KERNELS_DIR),
               "-I", str(EMULATION_DIR), "-o", str(tmp), *map(str, units)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise build.BuildError(f"emulation build failed:\n{proc.stderr[-3000:]}", proc.stderr)
    os.replace(tmp, exe)
    return exe


def emulate(build_root: Path) -> dict[str, Any]:
    """Build and run the harness; every case must be within the tolerances the GPU verification uses."""
    exe = build_harness(build_root)
    tol = ATTN_TOLERANCE
    args = [tol["float16"]["atol"], tol["float16"]["rtol"], tol["bfloat16"]["atol"], tol["bfloat16"]["rtol"]]
    start = time.perf_counter()
    proc = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"emulation harness failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    cases = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    failures = [
        case for case in cases
        if case["launch"] != 0
        or (case["kernel"] == "sgemm" and not case["rel_err"] <= SGEMM_TOLERANCE)
        or (case["kernel"] == "flash_attn_fwd" and not (case["worst_ratio"] <= 1 and case["lse_max_abs_err"] <= 1e-3))
    ]
    return {
        "status": "passed" if not failures else "failed",
        "cases": cases,
        "failures": failures,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    from frugaltune import paths

    result = emulate(paths.KERNEL_BUILD_DIR)
    for case in result["cases"]:
        print(json.dumps(case))
    print(f"emulation: {result['status']} ({len(result['cases'])} cases, {result['seconds']} s)")
    sys.exit(0 if result["status"] == "passed" else 1)


if __name__ == "__main__":
    main()
