"""Kernels on the CPU: the references, ptxas parsing, the build cache, verification and benchmark logic, the
stage's report in every situation, and (where nvcc exists, as on CI) a real compile of both kernels."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from frugaltune.kernels import build, cpu, cuda
from frugaltune.kernels.reference import attention_flops, naive_attention, sgemm_reference, tiled_attention

# ---- references --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seqlen", "head_dim"), [(1, 64), (32, 64), (77, 128), (128, 64)])
def test_tiled_attention_matches_sdpa_in_fp32(seqlen, head_dim, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, seqlen, head_dim) for _ in range(3))
    with cpu.torch_threads(1):
        out, lse = tiled_attention(q, k, v, causal=causal)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        _, expected_lse = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    assert (out - expected).abs().max().item() <= 1e-5
    assert (lse.double() - expected_lse).abs().max().item() <= 1e-5


def test_tiled_attention_does_not_depend_on_the_blocking():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 100, 64) for _ in range(3))
    with cpu.torch_threads(1):
        a, _ = tiled_attention(q, k, v, causal=True, block_m=32, block_n=32)
        b, _ = tiled_attention(q, k, v, causal=True, block_m=16, block_n=64)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_tiled_attention_keeps_low_precision_inputs_in_their_dtype():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 64, 64).to(torch.bfloat16) for _ in range(3))
    out, lse = tiled_attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    expected, _ = naive_attention(q.double(), k.double(), v.double(), causal=True)
    assert (out.double() - expected).abs().max().item() < 2e-2


def test_sgemm_reference_and_flop_counts():
    a, b, c = torch.ones(2, 3), torch.ones(3, 4), torch.full((2, 4), 2.0)
    assert torch.equal(sgemm_reference(a, b, c, alpha=2.0, beta=0.5), torch.full((2, 4), 7.0, dtype=torch.float64))
    assert attention_flops(4, 16, 1024, 64, causal=False) == 4 * 4 * 16 * 1024 * 1024 * 64
    assert attention_flops(4, 16, 1024, 64, causal=True) == 2 * 4 * 16 * 1024 * 1024 * 64


def test_verify_tiled_reference_passes_on_the_scaled_down_grid():
    result = cpu.verify_tiled_reference()
    assert result["status"] == "passed", result["failures"]
    assert result["cases"] == 48 and result["max_abs_err_out"] <= 1e-5 and result["max_abs_err_lse"] <= 1e-5


# ---- ptxas -------------------------------------------------------------------------------------------------------
PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN10frugaltune40_GLOBAL__N__98f6daac_8_sgemm_cu_2e0f624216sgemm_blocktiledILi128ELi128ELi8ELi8ELi8EEEviiifPKfS3_fPf' for 'sm_80'
ptxas info    : Function properties for _ZN10frugaltune40_GLOBAL__N__98f6daac_8_sgemm_cu_2e0f624216sgemm_blocktiledILi128ELi128ELi8ELi8ELi8EEEviiifPKfS3_fPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 111 registers, used 1 barriers, 8192 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 19.184 ms
ptxas info    : Function properties for helper_not_an_entry
    64 bytes stack frame, 64 bytes spill stores, 64 bytes spill loads
ptxas info    : Compiling entry function 'void frugaltune::(anonymous namespace)::flash_attn_fwd_kernel<__nv_bfloat16, 64, false>(__nv_bfloat16 const*, float*, int, float)' for 'sm_90'
ptxas info    : Function properties for void frugaltune::(anonymous namespace)::flash_attn_fwd_kernel<__nv_bfloat16, 64, false>(__nv_bfloat16 const*, float*, int, float)
    8 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 8 bytes cumulative stack size, 16512 bytes smem
"""


def test_parse_ptxas_reads_registers_smem_and_spills_per_instantiation():
    records = build.parse_ptxas(PTXAS_LOG)
    assert [r["arch"] for r in records] == ["sm_80", "sm_90"]
    sgemm, flash = records
    assert sgemm["registers"] == 111 and sgemm["shared_bytes"] == 8192
    assert sgemm["spill_store_bytes"] == 0 and sgemm["stack_bytes"] == 0  # the helper's spills are not its own
    assert flash == {
        "name": "flash_attn_fwd_kernel<__nv_bfloat16, 64, false>", "arch": "sm_90", "registers": 80,
        "shared_bytes": 16512, "stack_bytes": 8, "spill_store_bytes": 12, "spill_load_bytes": 8,
    }
    if build.shutil.which("c++filt"):
        assert sgemm["name"] == "sgemm_blocktiled<128, 128, 8, 8, 8>"


def test_arch_names():
    assert build.arch_to_capability("sm_80") == "8.0"
    assert build.arch_to_capability("sm_120") == "12.0"
    with pytest.raises(ValueError, match="sm_80"):
        build.arch_to_capability("ampere")


# ---- build cache, with a stand-in nvcc ---------------------------------------------------------------------------
FAKE_NVCC = """\
import os, re, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("Cuda compilation tools, release 13.0, V13.0.88"); sys.exit(0)
with open(os.environ["FAKE_NVCC_CALLS"], "a") as f:
    f.write(" ".join(args) + "\\n")
if os.environ.get("FAKE_NVCC_FAIL"):
    print("sgemm.cu(12): error: identifier \\"bogus\\" is undefined", file=sys.stderr); sys.exit(2)
arch = next(a.split("=", 1)[1] for a in args if a.startswith("-arch="))
open(args[args.index("-o") + 1], "wb").write(b"cubin")
print(f"ptxas info    : Compiling entry function 'void k<1>(float*)' for '{arch}'", file=sys.stderr)
print("ptxas info    : Function properties for void k<1>(float*)", file=sys.stderr)
print("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", file=sys.stderr)
print("ptxas info    : Used 42 registers, used 1 barriers, 1024 bytes smem", file=sys.stderr)
"""


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch) -> SimpleNamespace:
    script = tmp_path / "bin" / "nvcc"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n{FAKE_NVCC}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_NVCC_CALLS", str(calls))
    return SimpleNamespace(path=str(script), calls=lambda: calls.read_text().splitlines() if calls.exists() else [])


def test_compile_cubin_caches_by_source_and_arch(fake_nvcc, tmp_path):
    root = tmp_path / "build"
    first = build.compile_cubin("sgemm", "sm_80", root, fake_nvcc.path)
    assert first["cached"] is False and first["functions"] == {
        "k<1>": {"registers": 42, "shared_bytes": 1024, "stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}
    }
    again = build.compile_cubin("sgemm", "sm_80", root, fake_nvcc.path)
    assert again["cached"] is True and again["functions"] == first["functions"]
    build.compile_cubin("sgemm", "sm_90", root, fake_nvcc.path)  # another arch: another entry
    assert len(fake_nvcc.calls()) == 2
    assert "-Xptxas -v" in fake_nvcc.calls()[0] and "-arch=sm_80" in fake_nvcc.calls()[0]


def test_compile_cubin_failure_carries_the_compiler_output(fake_nvcc, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    with pytest.raises(build.BuildError, match="identifier") as info:
        build.compile_cubin("flash_attn_fwd", "sm_90", tmp_path / "build", fake_nvcc.path)
    assert "bogus" in info.value.log
    assert not list((tmp_path / "build").rglob("build.json"))  # a failed build leaves no cache entry


# ---- verification and benchmark logic, with the PyTorch references standing in for the kernels ------------------
SMALL_GRID = {"batch": (1, 2), "heads": (2,), "seqlen": (40, 64), "head_dim": (64,), "causal": (False, True)}


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(cuda, "DEVICE", "cpu")
    with cpu.torch_threads(1):
        yield


def reference_flash(q, k, v, causal):
    return tiled_attention(q, k, v, causal=causal)


def torch_sgemm(a, b, c, alpha, beta, config):
    out = alpha * (a @ b)
    return out + beta * c if beta != 0 else out


def wall_timer(fn) -> float:
    start = time.perf_counter()
    fn()
    return max((time.perf_counter() - start) * 1e3, 1e-3)


def test_verify_attention_passes_a_correct_kernel(on_cpu):
    result = cuda.verify_attention(reference_flash, grid=SMALL_GRID)
    assert result["status"] == "passed", result["failures"]
    assert result["dtypes"]["bfloat16"]["cases"] == 8 and result["failed_cases"] == 0
    assert result["dtypes"]["float16"]["max_abs_err"] <= cuda.ATTN_TOLERANCE["float16"]["atol"] * 4


def test_verify_attention_reports_a_wrong_kernel(on_cpu):
    def off_by_one_percent(q, k, v, causal):
        out, lse = tiled_attention(q, k, v, causal=causal)
        return out * 1.05, lse

    result = cuda.verify_attention(off_by_one_percent, grid=SMALL_GRID)
    assert result["status"] == "failed" and result["failed_cases"] == 16
    assert {"dtype", "seqlen", "causal", "max_abs_err"} <= set(result["failures"][0])


def test_verify_sgemm_catches_a_kernel_that_reads_c_when_beta_is_zero(on_cpu):
    shapes = ((33, 68, 12), (64, 64, 64))
    assert cuda.verify_sgemm(torch_sgemm, [[64, 64, 8, 8, 8]], shapes=shapes)["status"] == "passed"

    def reads_c(a, b, c, alpha, beta, config):
        return alpha * (a @ b) + beta * c  # 0 * NaN = NaN

    result = cuda.verify_sgemm(reads_c, [[64, 64, 8, 8, 8]], shapes=shapes)
    assert result["status"] == "failed" and all(f["beta"] == 0.0 for f in result["failures"])


def test_device_peaks_match_datasheets():
    h100 = cuda.device_peaks((9, 0), sm_count=132, clock_mhz=1830)
    assert h100["fp32_tflops"] == pytest.approx(61.8, abs=0.1)
    assert h100["fp16_tensor_tflops"] == pytest.approx(989.4, abs=0.5)  # H100 SXM dense fp16: 989 TFLOP/s
    a100 = cuda.device_peaks((8, 0), sm_count=108, clock_mhz=1410)
    assert a100["fp32_tflops"] == pytest.approx(19.5, abs=0.1)
    assert a100["fp16_tensor_tflops"] == pytest.approx(312, abs=1)
    unknown = cuda.device_peaks((9, 5), sm_count=100, clock_mhz=2000)
    assert "upper bound" in unknown["source"] and unknown["fp16_tensor_tflops"] > 0


def test_a_figure_above_peak_is_a_measurement_error(on_cpu):
    # The reference study: 0.72 ms for 4 x 16 x 1024 x 64 fp16 attention on an RTX 2050 (sm_86, 16 SMs, 1477 MHz):
    # 23.9 TFLOP/s, twice the card's 12.1 TFLOP/s of fp16 tensor math with fp32 accumulation.
    rtx2050 = cuda.device_peaks((8, 6), sm_count=16, clock_mhz=1477, name="NVIDIA GeForce RTX 2050")
    assert rtx2050["fp16_tensor_tflops"] == pytest.approx(12.1, abs=0.1)
    claimed = attention_flops(4, 16, 1024, 64, causal=False) / 0.72e-3 / 1e12
    assert claimed == pytest.approx(23.9, abs=0.1)
    with pytest.raises(cuda.MeasurementError, match="exceeds the device peak"):
        cuda.check_peak(claimed, rtx2050["fp16_tensor_tflops"], "reference study")
    tiny = {"fp32_tflops": 1e-9, "fp16_tensor_tflops": 1e-9}
    case = ({"batch": 1, "heads": 2, "seqlen": 64, "head_dim": 64, "causal": True},)
    with pytest.raises(cuda.MeasurementError):
        cuda.benchmark_attention(reference_flash, tiny, wall_timer, cases=case, dtypes={"bfloat16": torch.bfloat16})


def test_benchmarks_report_ms_tflops_and_percent_of_peak(on_cpu):
    huge = {"fp32_tflops": 1e6, "fp16_tensor_tflops": 1e6}
    case = ({"batch": 1, "heads": 2, "seqlen": 64, "head_dim": 64, "causal": False},)
    rows = cuda.benchmark_attention(reference_flash, huge, wall_timer, cases=case, dtypes={"bfloat16": torch.bfloat16})
    assert rows[0]["frugaltune"]["peak"] == "fp32_tflops" and rows[0]["naive"]["peak"] == "fp16_tensor_tflops"
    assert {"ms", "tflops", "pct_of_peak"} <= set(rows[0]["frugaltune"]) and rows[0]["gflop"] > 0
    configs = [[64, 64, 8, 8, 8], [128, 128, 8, 8, 8]]
    gemm = cuda.benchmark_sgemm(torch_sgemm, configs, huge, wall_timer, shapes=((64, 64, 64), (128, 128, 128)))
    assert gemm["autotuned_tile"] in configs and len(gemm["shapes"][0]["tiles"]) == 2
    assert gemm["shapes"][1]["torch_matmul"]["tflops"] > 0


# ---- CPU precision -----------------------------------------------------------------------------------------------
def _ops(fp32_ms: float, bf16_ms: float, bf16_ok: bool = True) -> dict:
    return {op: {"fp32": {"ms": fp32_ms, "verified": True}, "bf16": {"ms": bf16_ms, "verified": bf16_ok}}
            for op in cpu.LAYER_COUNTS}


@pytest.mark.parametrize(
    ("ops", "expected"),
    [(_ops(10, 5), "bf16"), (_ops(10, 9.5), "fp32"), (_ops(10, 15), "fp32"), (_ops(10, 5, bf16_ok=False), "fp32")],
)
def test_choose_precision(ops, expected):
    choice = cpu.choose_precision(ops, min_speedup=1.1)
    assert choice["preferred_precision"] == expected
    assert choice["bf16_speedup"] == pytest.approx(10 / ops["attention"]["bf16"]["ms"], rel=1e-3)


def test_measure_precisions_verifies_and_times_both_dtypes():
    shapes = cpu.ModelShapes(batch=1, seq_len=16, hidden=64, heads=1, intermediate=128)
    ops = cpu.measure_precisions(shapes, repeats=3, warmup=1)
    assert set(ops) == set(cpu.LAYER_COUNTS)
    for op in ops.values():
        assert op["fp32"]["verified"] and op["bf16"]["verified"]
        assert op["fp32"]["ms"] > 0 and op["bf16"]["ms"] > 0
        assert op["bf16"]["max_abs_err"] > op["fp32"]["max_abs_err"]  # bf16 is measured, not assumed


# ---- the stage ---------------------------------------------------------------------------------------------------
SMALL_SHAPES = {"bench_batch": 1, "bench_seq_len": 16, "model_hidden": 128, "model_heads": 2,
                "model_intermediate": 256, "timing_repeats": 3}


def stage_params(**kernels):
    from frugaltune.config import parse_params

    return parse_params({"kernels": {**SMALL_SHAPES, **kernels}})


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    hw = {"cpu": {"flags": {"avx512_bf16": False}}, "gpus": [], "gpu_note": "no NVIDIA GPU: test"}
    (tmp_path / "reports/hardware.json").write_text(json.dumps(hw))
    return tmp_path


def run_stage(params) -> dict:
    from stages import kernels as stage

    stage.run(params)
    return json.loads(Path("reports/kernels.json").read_text())


def test_stage_without_nvcc_skips_cuda_and_still_measures_the_cpu(project, monkeypatch):
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    report = run_stage(stage_params())
    assert report["mode"] == "no-nvcc"
    for kernel in ("sgemm", "flash_attn_fwd"):
        assert report["kernels"][kernel]["build"] == {"status": "skipped", "reason": "nvcc not found"}
        assert report["kernels"][kernel]["used"] is False and "PyTorch" in report["kernels"][kernel]["reason"]
    assert report["reference"]["tiled_attention_vs_sdpa"]["status"] == "passed"
    assert report["cpu"]["preferred_precision"] in ("fp32", "bf16") and report["cpu"]["threads"] >= 1
    assert "PyTorch's kernels" in report["summary"]


def test_stage_disabled(project):
    report = run_stage(stage_params(enabled=False))
    assert report["mode"] == "disabled"
    assert report["kernels"]["sgemm"]["build"]["reason"] == "kernels.enabled is false"


def test_stage_with_nvcc_and_no_gpu_records_ptxas_figures(project, fake_nvcc, monkeypatch):
    monkeypatch.setattr(build, "find_nvcc", lambda: fake_nvcc.path)
    report = run_stage(stage_params())
    assert report["mode"] == "nvcc" and "built for sm_80, sm_90 and not run" in report["summary"]
    flash = report["kernels"]["flash_attn_fwd"]
    assert flash["build"]["status"] == "built" and set(flash["build"]["archs"]) == {"sm_80", "sm_90"}
    assert flash["build"]["archs"]["sm_90"]["functions"]["k<1>"]["registers"] == 42
    assert flash["verify"]["status"] == "not run" and flash["used"] is False


def test_stage_without_a_gpu_runs_no_emulation(project, fake_nvcc, monkeypatch):
    """No GPU can run the kernels here: the stage builds them (ptxas figures) and runs none of their code on the
    CPU. The emulator checks their logic in the tests below and by hand, not on every machine's pipeline run."""
    monkeypatch.setattr(build, "find_nvcc", lambda: fake_nvcc.path)
    # every other `kernels.*` key at its default, as params.yaml runs it; what ran is in the report, not timed (a
    # busy machine would fail a timed assertion)
    report = run_stage(stage_params())
    for kernel in report["kernels"].values():
        assert "emulated_on_cpu" not in kernel["verify"], kernel["verify"]
        assert kernel["verify"]["status"] == "not run" and "frugaltune.kernels.emulate" in kernel["verify"]["reason"]
    assert not list(Path("build/kernels").glob("emulation-*")) and "emulator" not in report["summary"]
    assert report["device"] == {"cuda": False, "reason": "no NVIDIA GPU: test"}
    assert report["cpu"]["preferred_precision"] in ("fp32", "bf16")  # what the plan reads is still measured


def test_stage_records_a_failed_build_and_does_not_raise(project, fake_nvcc, monkeypatch):
    monkeypatch.setattr(build, "find_nvcc", lambda: fake_nvcc.path)
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    report = run_stage(stage_params())
    sgemm = report["kernels"]["sgemm"]
    assert sgemm["build"]["status"] == "failed" and "identifier" in sgemm["build"]["archs"]["sm_80"]["error"]
    assert sgemm["used"] is False and "PyTorch" in sgemm["reason"]
    assert "NOT all built" in report["summary"]


@pytest.fixture
def fake_cuda_machine(project, monkeypatch, on_cpu):
    """The CUDA path of the stage, run on the CPU: a fake device, the references as the 'extension'."""
    from frugaltune.kernels import report

    hw = {"cpu": {"flags": {}}, "gpus": [{"name": "Fake GPU", "arch": "sm_90", "compute_capability": "9.0",
                                          "max_sm_clock_mhz": 1980}], "gpu_note": None}
    (project / "reports/hardware.json").write_text(json.dumps(hw))
    props = SimpleNamespace(name="Fake GPU", major=9, minor=0, multi_processor_count=132, clock_rate=1_980_000)
    monkeypatch.setattr(report, "usable_cuda_device", lambda hw: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    ext = SimpleNamespace(
        flash_attn_fwd=lambda q, k, v, causal: list(tiled_attention(q, k, v, causal=causal)),
        sgemm=torch_sgemm,
        sgemm_configs=lambda: [[64, 64, 8, 8, 8]],
    )
    monkeypatch.setattr(build, "load_extension", lambda arch, root: (ext, {"seconds": 0.0, "cached": True}))
    monkeypatch.setattr(cuda, "cuda_timer", lambda: wall_timer)
    monkeypatch.setattr(cuda, "GPU_GRID", {"batch": (1,), "heads": (2,), "seqlen": (40,), "head_dim": (64,),
                                           "causal": (False, True)})
    monkeypatch.setattr(cuda, "ATTN_BENCH_CASES", ({"batch": 1, "heads": 2, "seqlen": 64, "head_dim": 64,
                                                    "causal": True},))
    monkeypatch.setattr(cuda, "SGEMM_VERIFY_SHAPES", ((33, 68, 12),))
    monkeypatch.setattr(cuda, "SGEMM_BENCH_SHAPES", ((64, 64, 64),))
    return props


def test_stage_on_a_cuda_machine_verifies_benchmarks_and_decides_use(fake_cuda_machine):
    report = run_stage(stage_params())
    assert report["mode"] == "cuda" and report["device"]["arch"] == "sm_90" and report["device"]["cuda"] is True
    assert report["device"]["peaks"]["fp16_tensor_tflops"] == pytest.approx(1070.5, abs=0.5)
    flash, sgemm = report["kernels"]["flash_attn_fwd"], report["kernels"]["sgemm"]
    assert flash["verify"]["status"] == "passed" and flash["benchmark"]["status"] == "done"
    assert flash["used"] == flash["benchmark"]["model_shapes"]["faster"]
    assert sgemm["verify"]["status"] == "passed" and sgemm["benchmark"]["autotuned_tile"] == [64, 64, 8, 8, 8]
    assert sgemm["used"] is False


def test_stage_on_a_cuda_machine_survives_a_crashing_kernel(fake_cuda_machine, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    ext = SimpleNamespace(flash_attn_fwd=crash, sgemm=crash, sgemm_configs=lambda: [[64, 64, 8, 8, 8]])
    monkeypatch.setattr(build, "load_extension", lambda arch, root: (ext, {"seconds": 0.0, "cached": True}))
    report = run_stage(stage_params())
    for kernel in report["kernels"].values():
        assert kernel["verify"]["status"] == "failed" and "illegal memory access" in kernel["verify"]["error"]
        assert kernel["benchmark"]["status"] == "not run" and kernel["used"] is False


def test_stage_fails_on_a_timing_above_peak_after_writing_the_report(fake_cuda_machine, monkeypatch):
    from stages import kernels as stage

    slow_device = {"fp32_tflops": 1e-9, "fp16_tensor_tflops": 1e-9}  # every real timing beats this "peak"
    monkeypatch.setattr(cuda, "device_peaks", lambda *args, **kwargs: slow_device)
    with pytest.raises(SystemExit, match="measurement error"):
        stage.run(stage_params())
    report = json.loads(Path("reports/kernels.json").read_text())
    assert report["summary"].startswith("kernels: measurement error") and report["kernels"]["sgemm"]["used"] is False


# ---- the real compile (CI has nvcc) ------------------------------------------------------------------------------
@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not found: the compile check runs where CUDA is installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_both_kernels_compile_with_ptxas_figures(arch, tmp_path):
    for kernel in build.KERNEL_SOURCES:
        record = build.compile_cubin(kernel, arch, tmp_path)
        assert record["cached"] is False and Path(record["cubin"]).stat().st_size > 0
        functions = record["functions"]
        expected = 6 if kernel == "sgemm" else 8  # tile configs; fp16/bf16 x head dim 64/128 x causal/not
        assert len(functions) == expected, functions
        for name, figures in functions.items():
            assert name.startswith(("sgemm_blocktiled<", "flash_attn_fwd_kernel<"))
            assert 0 < figures["registers"] <= 255 and figures["shared_bytes"] <= 48 * 1024


# ---- the kernels' own code, run on the CPU by the emulator -------------------------------------------------------
def test_launches_are_rewritten_for_the_emulator():
    from frugaltune.kernels.emulate import rewrite_launches

    source = '#include "launchers.h"\n  k<T, 64>\n      <<<grid, Tile<1, 2>::kThreads, 0, stream>>>(a, b);\n'
    out = rewrite_launches(source)
    assert "emu_launch(dim3(grid), dim3(Tile<1, 2>::kThreads), [&] { k<T, 64>(a, b); });" in out
    assert out.index('"shim.h"') < out.index('"launchers.h"')


@pytest.mark.slow
@pytest.mark.skipif(build.find_nvcc() is None, reason="the emulator needs the CUDA headers")
def test_kernels_run_on_the_cpu_emulator_and_match_float64(tmp_path):
    from frugaltune.kernels.emulate import emulate

    result = emulate(tmp_path)
    assert result["status"] == "passed", json.dumps(result["failures"], indent=1)
    assert {c["kernel"] for c in result["cases"]} == {"sgemm", "flash_attn_fwd"} and len(result["cases"]) == 20
