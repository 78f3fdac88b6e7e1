"""Which malloc a training process runs on: mimalloc (preloaded) or the system's (glibc).

Library code. `python -m stages.train` and `python -m stages.compare` call `reexec_early()` in their first lines:
when `train.allocator` resolves to mimalloc and this process does not have it yet, the process re-executes itself
(same pid, same argv) with mimalloc preloaded. The planner's calibration steps get the same allocator through
`child_env(choice)`, so that what is calibrated is what trains. `active()` says which one a process has; it is
recorded in `reports/train.json`.

Why (measured with `python benchmarks/memory_by_method.py`; figures in docs/DECISIONS.md): PyTorch's CPU
tensors come from malloc. glibc keeps freed activations in its heap and reuses the holes badly, so RSS keeps growing
for several steps, to 1.5-1.9x the live memory, and by how much depends on the order of allocations (QLoRA, which
dequantizes a weight before every matmul, fragments most: its RSS ended above LoRA's although it holds less).
glibc with `M_MMAP_THRESHOLD` lowered returns every large tensor to the OS and follows live memory, at +40-150%
step time. mimalloc (size-segregated pages) with purging off (`MIMALLOC_PURGE_DELAY=-1`: freed pages stay with the
process for reuse, no page faults per step) keeps RSS within ~10% of live memory at glibc's step time. That makes
peak RSS a property of the method, not of the heap's history, and lets the planner predict it.

Every such process also gets `PROCESS_ENV`, whichever malloc it runs on: bounds on the two caches that oneDNN (the
library behind PyTorch's bf16 products on CPU) keeps per tensor shape. A run meets a new shape with nearly every
batch width, and each cached primitive keeps its own buffers, so with the defaults (1,024 entries each) RSS climbed
for the whole run, past what any short calibration sees. ideep's cache (`LRU_CACHE_CAPACITY`) is kept at 1:
oneDNN's own finds the primitive. oneDNN's (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) keeps 128 (64 and 256 timed alike;
0 re-creates every primitive at every call, many times slower). The default run's peak fell and its step time did
not move (docs/DECISIONS.md, "oneDNN's caches").
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

CHOICES = ("auto", "mimalloc", "system")
# Freed pages stay with the process: reusing them costs nothing, returning them costs a page fault per 4 KiB on
# the next step (docs/DECISIONS.md, "Training runs on mimalloc").
MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": "-1"}
# Read when the caches are first built (the first bf16 product): set before that, in the environment.
PROCESS_ENV = {"LRU_CACHE_CAPACITY": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128"}
_REEXEC_MARK = "FRUGALTUNE_ALLOCATOR_REEXEC"


def mimalloc_library() -> Path | None:
    """`libmimalloc.so` from the `cmeel-mimalloc` wheel (a pinned dependency on Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("libmimalloc.so"):
            path = Path(file.locate()).resolve()
            if path.exists():
                return path
    return None


def active() -> str:
    """'mimalloc' when this process has it mapped, else 'system'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in maps else "system"


def resolve(choice: str) -> str:
    """`train.allocator` -> the allocator a process will get: auto = mimalloc where its library is installed."""
    if choice not in CHOICES:
        raise ValueError(f"train.allocator: {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "system":
        return "system"
    if mimalloc_library() is not None:
        return "mimalloc"
    if choice == "mimalloc":
        raise ValueError("train.allocator: mimalloc is not installed (pip install cmeel-mimalloc, Linux only); "
                         "set train.allocator: auto to fall back to the system allocator")
    return "system"


def _unless_set(env, values: dict[str, str]) -> dict[str, str]:
    """`values` with the ones `env` already has in their place: a value the user set wins."""
    return {k: env.get(k, v) for k, v in values.items()}


def child_env(choice: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process that should run on `choice` (LD_PRELOAD added or removed, and
    `PROCESS_ENV`)."""
    env = dict(os.environ if env is None else env)
    env.update(_unless_set(env, PROCESS_ENV))
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "libmimalloc" not in p]
    if resolve(choice) == "mimalloc":
        preload.insert(0, str(mimalloc_library()))
        env.update(_unless_set(env, MIMALLOC_ENV))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    return env


def reexec_early(params_file: str | Path = "params.yaml") -> None:
    """`reexec_with(train.allocator)` from a stage module's first lines, before torch, datasets and mlflow load.

    Re-executing after those imports would pay for them twice (measured in docs/DECISIONS.md). Reads only the one
    key, with yaml; a file or value it cannot read is left to the stage's full params check, which names it.
    """
    import yaml

    try:
        train = (yaml.safe_load(Path(params_file).read_text(encoding="utf-8")) or {}).get("train") or {}
        choice = train.get("allocator", "auto") if isinstance(train, dict) else "auto"
        if choice in CHOICES:
            reexec_with(choice)
    except (OSError, yaml.YAMLError, ValueError, AttributeError):
        return


def reexec_with(choice: str) -> str:
    """Make this process run on `choice`, re-executing it once if needed; returns the allocator it has.

    Only for a process's entry point (`if __name__ == "__main__"`): exec replaces the whole process. A malloc
    cannot be swapped after start, hence the re-exec. It is tried once (guarded by an environment mark), so a
    library that fails to preload falls back to the system allocator instead of looping.
    """
    wanted = resolve(choice)
    tried = os.environ.pop(_REEXEC_MARK, None)  # popped: this process's own children decide for themselves
    if wanted == active() or tried:
        os.environ.update(_unless_set(os.environ, PROCESS_ENV))  # no re-exec: still before the first product
        return active()
    env = child_env(choice)
    env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    return wanted  # not reached
