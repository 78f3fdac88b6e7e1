"""The machine decisions: precision, the attention crossover, threads, int8 products, the memory limit.

Library code, no entry point. `decide_machine` makes every machine-dependent setting of a run, here and only
here; the plan (frugaltune.planner.assembly) writes them to reports/plan.json's `machine` section and
frugaltune.resolve reads them for every consumer.
"""

from __future__ import annotations

import os

from frugaltune.methods import TRAINED, get as method_named
from frugaltune.planner.memory import GiB


def measured_on(hardware: dict, kernels_report: dict | None) -> dict | None:
    """The `cpu` section of reports/kernels.json if it was measured on this CPU (`hardware`), else None.

    A measurement from another machine would be a guess: reports in git describe the last machine that ran.
    """
    measured = (kernels_report or {}).get("cpu")
    if measured and measured.get("cpu_model") == hardware.get("cpu", {}).get("model"):
        return measured
    return None


def layer_flops_per_s(measured: dict | None, bf16: bool) -> float | None:
    """This CPU's measured speed (FLOP/s) through one decoder layer's forward ops in the plan's precision: the
    kernels stage's timed linear layers and attention (reports/kernels.json `cpu`), their FLOPs over their
    milliseconds. The plan's ETA before (or without) a calibration; None without that measurement."""
    if not measured or "ops" not in measured or "layer_counts" not in measured:
        return None
    precision = "bf16" if bf16 else "fp32"
    flops = seconds = 0.0
    for name, count in measured["layer_counts"].items():
        op = measured["ops"].get(name, {})
        shape, ms = op.get("shape", {}), op.get(precision, {}).get("ms")
        if not ms:
            return None
        if "tokens" in shape:
            flops += count * 2 * shape["tokens"] * shape["in_features"] * shape["out_features"]
        else:  # attention: the scores and their weighted sum
            flops += count * 4 * shape["batch"] * shape["heads"] * shape["seq_len"] ** 2 * shape["head_dim"]
        seconds += count * ms / 1000
    return flops / seconds if seconds > 0 else None


def recommend_precision(hardware: dict, requested: str, measured: dict | None = None) -> tuple[bool, str]:
    """(bf16?, why) for this machine: what the plan calibrates and training uses.

    `measured` is the `cpu` section of reports/kernels.json: the kernels stage times one decoder layer in fp32 and
    bf16 on this machine and prefers bf16 only when it verified and won by its margin. On a CPU nothing else
    decides: the same flag (avx512_bf16) has measured slower than fp32 on one CPU and twice as fast on another, so a
    flag, a vendor or a number from another machine would be a guess. A CUDA GPU that torch can drive decides by its
    compute capability (bf16 tensor cores from 8.0 on, a property of the architecture).
    """
    if requested != "auto":
        return requested == "bf16", f"{requested} as configured (train.precision)"
    gpus = hardware.get("gpus") or []
    if gpus and hardware.get("torch", {}).get("cuda_available"):
        gpu = gpus[0]
        major, _, minor = str(gpu.get("compute_capability", "0.0")).partition(".")
        if (int(major), int(minor or 0)) >= (8, 0):
            return True, f"bf16: {gpu['name']} (compute capability {gpu['compute_capability']}) has bf16 tensor cores"
        return False, f"fp32: {gpu['name']} has no bf16 tensor cores (compute capability < 8.0)"
    preferred = (measured or {}).get("preferred_precision")
    if preferred in ("bf16", "fp32"):
        return preferred == "bf16", f"{preferred}, measured on this machine by the kernels stage: {measured['reason']}"
    return False, ("fp32: bf16 was not measured on this machine (reports/kernels.json has no `cpu` section; "
                   "`dvc repro kernels` measures it)")


def eager_attention_max_len(measured: dict | None, bf16: bool, gpu: bool = False) -> int:
    """Batches padded to at most this many tokens train with eager attention, longer ones with SDPA (0: SDPA only).

    From the kernels stage's timing of attention forward + backward on this CPU in the chosen precision
    (`training_attention`); nothing measured, or a GPU (its SDPA kernels are another matter): 0.
    """
    if gpu:
        return 0
    timed = (measured or {}).get("training_attention", {}).get("eager_max_len", {})
    return int(timed.get("bf16" if bf16 else "fp32", 0))


def keep_sdpa_off_cudnn() -> bool:
    """On a CUDA device, take cuDNN out of SDPA's backends for this process (flash and memory-efficient attention
    remain); returns whether it did. Nothing changes on a CPU.

    Why (torch.profiler on a lent GPU, docs/DECISIONS.md "On a lent GPU"): SDPA chose cuDNN, whose attention cost
    milliseconds of host time per call for microseconds on the GPU, most likely a plan built per shape, and dynamic
    padding gives a new length almost every batch. Without cuDNN the same steps reach the same loss faster.
    Process-wide, so evaluation in the same process gets it too."""
    import torch

    if not torch.cuda.is_available():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def decide_machine(hardware: dict, measured: dict | None, precision_setting: str = "auto",
                   int8_setting: str | bool = "auto", methods: tuple[str, ...] = TRAINED,
                   dims: tuple[int, int] | None = None, threads: int | None = None, ranks: int = 1) -> dict:
    """Every machine-dependent setting of a run, decided here and only here (the plan stage writes the result to
    reports/plan.json's `machine` section; frugaltune.resolve reads it for every consumer).

    - precision: `recommend_precision` (the kernels stage's measurement, a GPU's compute capability, or as set);
    - the attention crossover: `eager_attention_max_len`, measured by the kernels stage in that precision;
    - threads: physical cores, split between the ranks on one host (`cores`: how many this machine has, on which
      the federated stage lays out its clients' workers and its server's evaluation);
    - int8 products, per method in `methods`: `frugaltune.int8.decide`, which times int8 products against the
      precision's on this machine now (`dims`: the model's hidden and intermediate sizes; None: no int8). `int8`
      holds the decisions for `int8_setting`; `int8_by_setting` those and what `true` and `false` come to here
      (neither is timed), so that a consumer which sets them explicitly reads its decision too.

    The settings it was decided for (`precision_setting`, `int8_setting`, `threads_setting`, `ranks`) are recorded
    beside the decisions: frugaltune.resolve refuses a plan made for other settings instead of deciding again.
    """
    import torch

    bf16, precision_why = recommend_precision(hardware, precision_setting, measured)
    gpus = hardware.get("gpus") or []
    cores = hardware.get("cpu", {}).get("physical_cores") or os.cpu_count() or 1
    decided = {
        "bf16": bf16, "precision": "bf16" if bf16 else "fp32", "precision_why": precision_why,
        "precision_setting": precision_setting, "cores": cores,
        "eager_attention_max_len": eager_attention_max_len(measured, bf16, bool(gpus)),
        "threads": threads or max(1, cores // ranks),
        "threads_why": ("as configured (train.threads)" if threads else
                        "physical cores: a second hyperthread adds contention, not FLOPs, to these matmuls"
                        + (f"; {ranks} processes share them" if ranks > 1 else "")),
        "threads_setting": threads, "ranks": ranks,
        "int8": {}, "int8_setting": int8_setting_name(int8_setting),
    }
    settings = dict.fromkeys((decided["int8_setting"], "true", "false"))  # the plan's own first: it alone is timed
    decided["int8_by_setting"] = by_setting = {setting: {} for setting in settings}
    if dims and methods:
        from frugaltune import int8

        ratio: dict = {}  # one timing serves every method: it depends on the precision and shapes alone
        for setting in settings:
            for method in methods:
                by_setting[setting][method] = {"on": False, "why": "nothing trains"} if not method_named(method).trained else (
                    int8.decide(setting, method, bf16, dims[0], dims[1], bool(gpus) and torch.cuda.is_available(),
                                ratio))
    decided["int8"] = by_setting[decided["int8_setting"]]
    return decided


def int8_setting_name(setting: str | bool) -> str:
    """`train.int8_products` as the plan records it: "auto", "true" or "false" (params may hold a YAML bool)."""
    return ("true" if setting else "false") if isinstance(setting, bool) else str(setting)


def memory_limit(hardware: dict, limit_gb: float | None) -> tuple[int, str]:
    if limit_gb:
        return int(limit_gb * GiB), f"probe.memory_limit_gb = {limit_gb:g}"
    memory = hardware.get("memory", {})
    cgroup = memory.get("cgroup_limit_bytes")
    if cgroup:
        return int(cgroup), "the cgroup memory limit"
    return int(memory.get("total_bytes", 0)), "the machine's RAM"
