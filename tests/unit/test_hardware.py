"""Hardware facts: /proc/cpuinfo parsing, the NVML path against a fake NVML, bf16 support, the probe stage."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from frugaltune import hardware
from frugaltune.hardware import parse_cpuinfo, probe


def cpuinfo_block(processor: int, core: int, flags: str, model: str = "Intel(R) Xeon(R) Platinum 8480+") -> str:
    return (
        f"processor\t: {processor}\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\n"
        f"physical id\t: 0\ncore id\t\t: {core}\ncpu cores\t: 2\nflags\t\t: {flags}\n"
    )


SAPPHIRE_FLAGS = "fpu sse avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"
# Two cores with two hyperthreads each: four logical processors.
SAPPHIRE = "\n".join(cpuinfo_block(p, p // 2, SAPPHIRE_FLAGS) for p in range(4))
OLD_XEON = "\n".join(cpuinfo_block(p, p, "fpu sse avx avx2 fma", model="Intel(R) Xeon(R) E5-2680 v4") for p in range(2))
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes\n\nprocessor\t: 1\nFeatures\t: fp asimd\n"


def test_cpuinfo_gives_model_cores_and_flags():
    facts = parse_cpuinfo(SAPPHIRE)
    assert facts["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert facts["logical_cores"] == 4
    assert facts["physical_cores"] == 2  # distinct (physical id, core id) pairs, not processors
    assert facts["flags"] == {flag: True for flag in hardware.CPU_FLAGS}


def test_one_generic_name_on_two_cpu_generations_is_two_machines():
    # A VM shows "AMD EPYC" for Zen 4 (family 25, model 17) and Zen 5 (family 26, model 2): their bf16 and int8
    # speeds differ, so the measurements and plan of one must not pass for the other's.
    def generic(family: int, model: int) -> str:
        return "".join(f"processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                       "model name\t: AMD EPYC\nflags\t\t: avx2 avx512f avx512_bf16 avx512_vnni\n\n" for i in range(2))

    zen4, zen5 = parse_cpuinfo(generic(25, 17)), parse_cpuinfo(generic(26, 2))
    assert zen4["model"] == "AMD EPYC (family 25 model 17)" and zen5["model"] == "AMD EPYC (family 26 model 2)"
    assert zen4["flags"] == zen5["flags"]


def test_cpuinfo_without_bf16_flags():
    flags = parse_cpuinfo(OLD_XEON)["flags"]
    assert flags["avx2"] is True
    assert not any(flags[f] for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile"))


def test_cpuinfo_without_core_ids_falls_back_to_psutil():
    assert parse_cpuinfo(ARM)["physical_cores"] is None
    facts = hardware.cpu_facts(ARM)
    assert facts["logical_cores"] == 2
    assert facts["physical_cores"] >= 1
    assert facts["model"]  # platform.processor() / machine() when cpuinfo names none
    assert facts["flags"]["avx2"] is False


class FakeNVML:
    """The pynvml functions `nvml_gpus` calls, answering for the devices given."""

    def __init__(self, devices: list[dict]):
        self.devices = devices
        self.shutdown = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        handles = [SimpleNamespace(**d) for d in self.devices]
        for name, fn in {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: setattr(self, "shutdown", True),
            "nvmlSystemGetDriverVersion": lambda: b"550.54.15",
            "nvmlSystemGetCudaDriverVersion": lambda: 12040,
            "nvmlDeviceGetCount": lambda: len(handles),
            "nvmlDeviceGetHandleByIndex": lambda i: handles[i],
            "nvmlDeviceGetName": lambda h: h.name,
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=h.memory, free=1, used=2),
            "nvmlDeviceGetCudaComputeCapability": lambda h: h.cc,
            "nvmlDeviceGetMaxClockInfo": lambda h, kind: h.clock,
        }.items():
            monkeypatch.setattr(pynvml, name, fn)


def test_nvml_lists_gpus_with_memory_and_capability(monkeypatch):
    fake = FakeNVML([
        {"name": b"NVIDIA H100 80GB HBM3", "memory": 85_520_809_984, "cc": (9, 0), "clock": 1980},
        {"name": "NVIDIA GeForce RTX 2050", "memory": 4_294_967_296, "cc": (8, 6), "clock": 1477},
    ])
    fake.install(monkeypatch)
    gpus, note, driver = hardware.nvml_gpus()
    assert note is None
    assert driver == {"version": "550.54.15", "cuda_version": "12.4"}
    assert gpus[0] == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85_520_809_984,
                       "compute_capability": "9.0", "arch": "sm_90", "max_sm_clock_mhz": 1980}
    assert gpus[1]["name"] == "NVIDIA GeForce RTX 2050" and gpus[1]["arch"] == "sm_86"
    assert fake.shutdown
    assert "free" not in json.dumps(gpus)  # stable facts only


def test_nvml_without_driver_says_so(monkeypatch):
    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    gpus, note, driver = hardware.nvml_gpus()
    assert gpus == [] and driver is None
    assert note.startswith("no NVIDIA GPU: ") and "Not Found" in note


def test_nvml_with_zero_devices(monkeypatch):
    FakeNVML([]).install(monkeypatch)
    gpus, note, _ = hardware.nvml_gpus()
    assert gpus == [] and note == "no NVIDIA GPU: NVML reports 0 devices"


def test_probe_without_nvml_records_why_there_are_no_gpus():
    hw = probe(use_nvml=False, cpuinfo_text=SAPPHIRE)
    assert set(hw) == {"cpu", "memory", "platform", "torch", "gpus", "gpu_note", "nvidia_driver"}
    assert hw["gpus"] == [] and hw["gpu_note"] == "no NVIDIA GPU: not probed (probe.nvml is false)"
    assert hw["memory"]["total_bytes"] > 0
    assert hw["torch"]["build"] == "cpu" or hw["torch"]["build"].startswith("cuda ")


def test_probe_stage_writes_stable_facts_and_reads_another_machine(tmp_path, monkeypatch):
    from frugaltune.config import parse_params
    from stages import probe as probe_stage

    monkeypatch.chdir(tmp_path)
    params = parse_params({"probe": {"nvml": False}})
    probe_stage.run(params)
    first = (tmp_path / "reports/hardware.json").read_bytes()
    probe_stage.run(params)
    assert (tmp_path / "reports/hardware.json").read_bytes() == first  # unchanged facts: byte-identical file
    hw = json.loads(first)
    assert hw["cpu"]["logical_cores"] >= 1 and hw["gpus"] == []
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["hardware.json"]  # no temp files left
    volatile = [key for key in _keys(hw) if any(word in key for word in ("free", "used", "percent", "load"))]
    assert volatile == []

    other = tmp_path / "cpuinfo"
    other.write_text(ZEN4_CPUINFO)
    monkeypatch.setenv("FRUGALTUNE_CPUINFO", str(other))
    probe_stage.run(params)
    moved = json.loads((tmp_path / "reports/hardware.json").read_text())
    assert moved["cpu"]["model"] == "AMD EPYC 9R14 96-Core Processor" and moved["cpu"]["flags"]["avx512_bf16"]
    monkeypatch.setenv("FRUGALTUNE_CPUINFO", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="FRUGALTUNE_CPUINFO"):
        probe_stage.run(params)


ZEN4_CPUINFO = "".join(
    f"processor\t: {i}\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
    f"physical id\t: 0\ncore id\t: {i}\ncpu cores\t: 2\n"
    "flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512_bf16 avx512_vnni\n\n" for i in range(2))


def test_plan_stage_calibrates_in_the_precision_this_machine_measured(tmp_path, monkeypatch, tiny_model_dir):
    import shutil

    from datasets import Dataset, DatasetDict

    from frugaltune.config import parse_params
    from stages import plan as plan_stage
    from stages import probe as probe_stage

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, tmp_path / "models/base")
    (tmp_path / "data/splits").mkdir(parents=True)
    (tmp_path / "data/splits/labels.json").write_text(json.dumps({"labels": ["negative", "neutral", "positive"]}))
    DatasetDict({"train": Dataset.from_dict({"input_ids": [[1, 2, 3] * (1 + i % 5) for i in range(40)],
                                             "labels": [i % 3 for i in range(40)]})}).save_to_disk("data/tokenized")
    params = parse_params({"probe": {"nvml": False, "calibrate": False},
                           "train": {"batch_size": 8, "int8_products": False}})
    probe_stage.run(params)
    model = json.loads((tmp_path / "reports/hardware.json").read_text())["cpu"]["model"]

    def plan_with(kernels_cpu: dict | None) -> dict:
        report = tmp_path / "reports/kernels.json"
        report.unlink(missing_ok=True)
        if kernels_cpu is not None:
            report.write_text(json.dumps({"cpu": kernels_cpu}))
        return plan_stage.run(params)

    unmeasured = plan_with(None)
    assert unmeasured["run"] == {"method": "lora", "precision": "fp32", "micro_batch_size": 8,
                                 "gradient_checkpointing": False, "eager_attention_max_len": 0,
                                 "int8_products": False}
    assert "not measured" in unmeasured["precision_why"]
    assert unmeasured["methods"]["lora"]["largest_batch"] == {"sequences": 8, "length": 15}
    measured = plan_with({"preferred_precision": "bf16", "reason": "bf16 2.29x fp32", "cpu_model": model,
                          "training_attention": {"eager_max_len": {"bf16": 192, "fp32": 96}}})
    assert measured["run"]["precision"] == measured["methods"]["lora"]["precision"] == "bf16"
    assert measured["run"]["eager_attention_max_len"] == 192  # the crossover timed in the precision chosen
    assert "measured on this machine" in measured["precision_why"]
    # A measurement of another CPU (reports in git come from the last machine) is not this machine's.
    elsewhere = plan_with({"preferred_precision": "bf16", "reason": "x", "cpu_model": "Some Other CPU"})
    assert elsewhere["run"]["precision"] == "fp32"
    configured = plan_stage.run(parse_params({"probe": {"nvml": False, "calibrate": False},
                                              "train": {"batch_size": 8, "precision": "bf16"}}))
    assert configured["run"]["precision"] == "bf16" and "as configured" in configured["precision_why"]
    assert json.loads((tmp_path / "reports/plan.json").read_text())["run"] == configured["run"]


def _keys(tree) -> list[str]:
    if isinstance(tree, dict):
        return [k for key, value in tree.items() for k in (key, *_keys(value))]
    if isinstance(tree, list):
        return [k for item in tree for k in _keys(item)]
    return []


def test_cpu_peak_flops_spells_out_cores_clock_and_flops_per_cycle(monkeypatch):
    from frugaltune import hardware

    monkeypatch.setattr(hardware, "cpu_clock_hz", lambda: (2.0e9, "test clock"))
    intel = {"cpu": {"model": "Intel(R) Xeon(R)", "physical_cores": 2, "flags": {"avx512f": True, "avx2": True}}}
    peak, formula = hardware.cpu_peak_flops(intel)
    assert peak == 2 * 2.0e9 * 64
    assert "2 cores x 2.00 GHz (test clock) x 64 FLOPs/cycle" in formula and "256 GFLOP/s" in formula
    zen4 = {"cpu": {"model": "AMD Ryzen 7 7840U", "physical_cores": 8, "flags": {"avx512f": True}}}
    assert hardware.cpu_flops_per_cycle(zen4)[0] == 32
    assert hardware.cpu_flops_per_cycle({"cpu": {"flags": {"avx2": True}}})[0] == 32
    assert hardware.cpu_flops_per_cycle({"cpu": {"flags": {}}})[0] == 8
    assert hardware.cpu_peak_flops(intel, cores=1)[0] == 2.0e9 * 64


def test_cpu_clock_is_read_from_this_machine():
    from frugaltune.hardware import cpu_clock_hz

    clock, source = cpu_clock_hz()
    assert clock > 1e8 and source != "unknown"


def test_bitsandbytes_hub_kernel_notice_is_dropped_and_nothing_named_kernels_is_installed(caplog):
    import logging

    import frugaltune  # noqa: F401  (installs the filter)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "offline")
        logger.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]
    # Only `frugaltune` is installed: outside the repository (-I: no cwd, no PYTHONPATH) nothing named `kernels`
    # (Hugging Face's package, which bitsandbytes imports), `stages` or `flows` comes from this project.
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[2])
    script = ("import importlib.util as u, sys; root = sys.argv[1]; found = [u.find_spec(n) for n in "
              "('kernels', 'stages', 'flows')]; print([s.name for s in found if s and any(str(p).startswith(root) "
              "for p in [s.origin, *(s.submodule_search_locations or [])])])")
    done = subprocess.run([sys.executable, "-I", "-c", script, root], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
