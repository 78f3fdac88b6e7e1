"""Compile the CUDA kernels, cached by source hash and architecture under `frugaltune.paths.KERNEL_BUILD_DIR`.

Two builds, for two situations:

- `compile_cubin(kernel, arch)`: `nvcc -cubin -arch=<arch> -Xptxas -v` on one .cu file. Needs only nvcc (no GPU,
  no CUDA build of torch), so it runs on CPU machines and in CI; its product is the per-kernel ptxas report
  (registers, shared memory, spills) that `reports/kernels.json` records.
- `load_extension(arch)`: the torch extension (bindings.cpp + the .cu files) through torch.utils.cpp_extension,
  for a machine with a CUDA device and a CUDA build of torch.

A cache entry is keyed by the sha256 of the sources and headers, the compiler version, the flags and the
architecture, so an edit to a kernel rebuilds exactly what it affects and nothing else does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

# The CUDA sources stay in the repository's top-level `kernels/` folder (DESIGN.md §1); only their Python is in the
# package, so nothing named `kernels` is installed (Hugging Face's `kernels`, which bitsandbytes imports, owns the
# name). The package is installed editable from the repository, so the sources sit two levels above this file.
KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
KERNEL_SOURCES = {"sgemm": "sgemm.cu", "flash_attn_fwd": "flash_attn_fwd.cu"}
HEADERS = ("launchers.h",)
BINDINGS = "bindings.cpp"
NVCC_FLAGS = ("-O3", "-std=c++17")
ARCH_PATTERN = re.compile(r"^sm_(\d+)([a-z]?)$")


class BuildError(RuntimeError):
    """A compile that failed; `log` holds the compiler's output."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


def find_nvcc() -> str | None:
    """nvcc from $CUDA_HOME, $PATH or /usr/local/cuda, or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    for home in candidates:
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def nvcc_version(nvcc: str) -> str:
    """`13.0.88` from `nvcc --version` (`Cuda compilation tools, release 13.0, V13.0.88`)."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1] if out.strip() else "unknown"


def arch_to_capability(arch: str) -> str:
    """`sm_90` -> `9.0`, `sm_120` -> `12.0` (the form TORCH_CUDA_ARCH_LIST takes)."""
    match = ARCH_PATTERN.match(arch)
    if not match:
        raise ValueError(f"{arch!r} is not a CUDA architecture like `sm_80`")
    digits = match.group(1)
    return f"{digits[:-1]}.{digits[-1]}{match.group(2)}"


def source_hash(files: list[Path], extra: str = "") -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(extra.encode())
    return digest.hexdigest()


# ---- ptxas -v ----------------------------------------------------------------------------------------------------
_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>[^']+)'")
_PROPERTIES = re.compile(r"Function properties for (?P<name>\S.*?)\s*$")
_FRAME = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
)
_USED = re.compile(r"Used (?P<registers>\d+) registers")
_SMEM = re.compile(r"(?P<smem>\d+) bytes smem")


def parse_ptxas(log: str) -> list[dict[str, Any]]:
    """One record per kernel instantiation from `ptxas -v` output, in the order ptxas reports them.

    ptxas prints, per entry function: `Compiling entry function '<name>' for 'sm_80'`, then `Function properties
    for <name>` followed by the stack/spill line, then `Used N registers, ... M bytes smem, ...`.
    """
    records: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    properties_of: str | None = None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            current = {
                "name": match.group("name"),
                "arch": match.group("arch"),
                "registers": None,
                "shared_bytes": 0,
                "stack_bytes": 0,
                "spill_store_bytes": 0,
                "spill_load_bytes": 0,
            }
            records.append(current)
            properties_of = None
        elif match := _PROPERTIES.search(line):
            properties_of = match.group("name")
        elif (match := _FRAME.search(line)) and current is not None and properties_of == current["name"]:
            current["stack_bytes"] = int(match.group("stack"))
            current["spill_store_bytes"] = int(match.group("stores"))
            current["spill_load_bytes"] = int(match.group("loads"))
        elif (match := _USED.search(line)) and current is not None:
            current["registers"] = int(match.group("registers"))
            if smem := _SMEM.search(line):
                current["shared_bytes"] = int(smem.group("smem"))
    for record in records:
        record["name"] = short_kernel_name(record["name"])
    return records


def demangle(name: str) -> str:
    """C++ name of a mangled symbol (`_Z...`) through c++filt; unchanged when it is not mangled or no c++filt."""
    if not name.startswith("_Z") or not shutil.which("c++filt"):
        return name
    out = subprocess.run(["c++filt", name], capture_output=True, text=True, timeout=30).stdout.strip()
    return out or name


def short_kernel_name(name: str) -> str:
    """`void frugaltune::(anonymous namespace)::sgemm_blocktiled<128, 128, 8, 8, 8>(int, ...)` ->
    `sgemm_blocktiled<128, 128, 8, 8, 8>`; works on mangled names too (demangles first)."""
    name = demangle(name)
    match = re.search(r"(\w+(?:<[^()]*>)?)\(", name)
    return match.group(1) if match else name


# ---- nvcc -cubin -------------------------------------------------------------------------------------------------
def compile_cubin(kernel: str, arch: str, build_root: Path, nvcc: str | None = None) -> dict[str, Any]:
    """Compile one kernel source for one architecture; return its ptxas figures. Cached.

    Raises BuildError (with the compiler output) when nvcc fails, FileNotFoundError when there is no nvcc.
    """
    if kernel not in KERNEL_SOURCES:
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNEL_SOURCES)}")
    arch_to_capability(arch)  # validates the name before nvcc sees it
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    source = KERNELS_DIR / KERNEL_SOURCES[kernel]
    version = nvcc_version(nvcc)
    key = source_hash([source, *(KERNELS_DIR / h for h in HEADERS)], f"{version}|{' '.join(NVCC_FLAGS)}|{arch}")
    entry = Path(build_root) / f"{kernel}-{arch}-{key[:16]}"
    meta_path = entry / "build.json"
    if meta_path.is_file():
        record = json.loads(meta_path.read_text(encoding="utf-8"))
        record["cached"] = True
        return record

    entry.mkdir(parents=True, exist_ok=True)
    cubin = entry / f"{kernel}.cubin"
    # A private temporary output: two processes building the same entry never see each other's half file.
    fd, tmp_cubin = tempfile.mkstemp(dir=entry, suffix=".cubin.tmp")
    os.close(fd)
    command = [nvcc, "-cubin", f"-arch={arch}", *NVCC_FLAGS, "-Xptxas", "-v", "-I", str(KERNELS_DIR),
               "-o", tmp_cubin, str(source)]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
    seconds = round(time.perf_counter() - start, 2)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        Path(tmp_cubin).unlink(missing_ok=True)
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise BuildError(f"nvcc failed for {kernel} on {arch} (exit {proc.returncode}):\n{tail}", log)
    os.replace(tmp_cubin, cubin)
    (entry / "ptxas.log").write_text(log, encoding="utf-8")
    record = {
        "arch": arch,
        "nvcc": version,
        "flags": list(NVCC_FLAGS),
        "source_hash": key[:16],
        "seconds": seconds,
        "cubin": str(cubin),
        # Keyed by instantiation, so that `dvc metrics diff` shows a change in registers or spills per kernel.
        "functions": {f["name"]: {k: v for k, v in f.items() if k not in ("name", "arch")} for f in parse_ptxas(log)},
    }
    tmp_meta = entry / f".build.json.{os.getpid()}.tmp"
    tmp_meta.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp_meta, meta_path)  # written last: its presence marks a complete entry
    record["cached"] = False
    return record


# ---- torch extension -------------------------------------------------------------------------------------------
_LOADED: dict[str, Any] = {}  # one import per module name and process: a second import of the .so is not safe


def load_extension(arch: str, build_root: Path, verbose: bool = False) -> tuple[Any, dict[str, Any]]:
    """Build (or load from the cache) the torch extension for `arch`; return (module, build record).

    Needs a CUDA build of torch, nvcc of a matching major version and ninja; torch.utils.cpp_extension raises with
    its own message when one is missing, and the caller records that message.
    """
    import torch
    from torch.utils import cpp_extension

    sources = [KERNELS_DIR / BINDINGS, *(KERNELS_DIR / s for s in KERNEL_SOURCES.values())]
    key = source_hash(
        [*sources, *(KERNELS_DIR / h for h in HEADERS)], f"{torch.__version__}|{torch.version.cuda}|{arch}"
    )[:16]
    # The hash is in the module name too: Python cannot reload a changed extension under an old name.
    name = f"frugaltune_kernels_{key}"
    build_dir = Path(build_root).resolve() / f"extension-{arch}-{key}"
    if name in _LOADED:
        return _LOADED[name], {"arch": arch, "seconds": 0.0, "cached": True, "build_dir": str(build_dir),
                               "source_hash": key}
    build_dir.mkdir(parents=True, exist_ok=True)
    cached = any(build_dir.glob(f"{name}*.so"))
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_to_capability(arch)
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_include_paths=[str(KERNELS_DIR)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    finally:
        if previous is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous
    _LOADED[name] = module
    record = {
        "arch": arch,
        "seconds": round(time.perf_counter() - start, 2),
        "cached": cached,
        "build_dir": str(build_dir),
        "source_hash": key,
    }
    return module, record
