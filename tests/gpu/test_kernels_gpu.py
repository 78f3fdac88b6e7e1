"""The CUDA kernels on a CUDA device: build for it, verify over the grid of issue 6, benchmark within physics.

Run on a CUDA machine with:  pytest -m gpu tests/gpu -v -s      (-s prints the benchmark tables)
Elsewhere every test is skipped with the reason. The first run builds the torch extension (a minute or two); the
build is cached under build/kernels by source hash and architecture.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from frugaltune.kernels import build, cuda
from frugaltune.kernels.reference import tiled_attention
from frugaltune import paths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason=f"no CUDA device (torch {torch.__version__}, build {torch.version.cuda or 'cpu'})",
    ),
]


@pytest.fixture(scope="module")
def device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@pytest.fixture(scope="module")
def ext(device_arch):
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found: the torch extension cannot be built")
    module, record = build.load_extension(device_arch, paths.KERNEL_BUILD_DIR)
    print(f"\nextension for {device_arch}: {record}")
    return module


@pytest.fixture(scope="module")
def peaks():
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    from frugaltune.hardware import nvml_gpus

    gpus, _, _ = nvml_gpus()
    nvml_clock = max((g.get("max_sm_clock_mhz") or 0 for g in gpus), default=0)
    clock = max(nvml_clock, getattr(props, "clock_rate", 0) / 1000)
    result = cuda.device_peaks((props.major, props.minor), props.multi_processor_count, clock, props.name)
    print(f"\n{props.name}: {result}")
    return result


def flash_fn(ext):
    def run(q, k, v, causal):
        out, lse = ext.flash_attn_fwd(q, k, v, causal)
        return out, lse

    return run


def test_flash_attention_against_sdpa_smoke(ext):
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=dtype) for _ in range(3))
        for causal in (False, True):
            out, lse = ext.flash_attn_fwd(q, k, v, causal)
            expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            tol = cuda.ATTN_TOLERANCE["float16" if dtype == torch.float16 else "bfloat16"]
            torch.testing.assert_close(out.float(), expected, **tol)
            _, ref_lse = tiled_attention(q, k, v, causal=causal)
            torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)


def test_flash_attention_verifies_over_the_full_grid(ext):
    result = cuda.verify_attention(flash_fn(ext))
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}, indent=1))
    assert result["status"] == "passed", json.dumps(result["failures"], indent=1)


def test_flash_attention_rejects_what_it_does_not_support(ext):
    q = torch.randn(1, 2, 64, 96, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        ext.flash_attn_fwd(q, q, q, False)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ext.flash_attn_fwd(q[..., :64].float(), q[..., :64].float(), q[..., :64].float(), False)
    # Messages that carry numbers: these segfaulted on the H100 image before bindings.cpp stopped using
    # `ostream << int` (see shape_str there).
    a = torch.randn(64, 64, device="cuda")
    with pytest.raises(RuntimeError, match="config 99 out of range"):
        ext.sgemm(a, a, None, 1.0, 0.0, 99)
    with pytest.raises(RuntimeError, match=r"shapes \[64, 64\] and \[32, 64\] do not multiply"):
        ext.sgemm(a, a[:32], None, 1.0, 0.0, 0)


def test_sgemm_verifies_for_every_tile_configuration(ext):
    configs = [list(c) for c in ext.sgemm_configs()]
    result = cuda.verify_sgemm(ext.sgemm, configs)
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}, indent=1))
    assert result["status"] == "passed", json.dumps(result["failures"], indent=1)


def test_benchmarks_stay_below_the_device_peak(ext, peaks):
    timer = cuda.cuda_timer()
    rows = cuda.benchmark_attention(flash_fn(ext), peaks, timer)  # raises MeasurementError above peak
    for row in rows:
        line = "  ".join(f"{name} {row[name].get('ms', '-')} ms {row[name].get('tflops', '-')} TF"
                         for name in ("frugaltune", "sdpa_flash", "naive"))
        print(f"{row['dtype']} b{row['batch']} h{row['heads']} n{row['seqlen']} d{row['head_dim']} "
              f"causal={row['causal']}: {line}")
        assert 0 < row["frugaltune"]["pct_of_peak"] <= 100
    configs = [list(c) for c in ext.sgemm_configs()]
    gemm = cuda.benchmark_sgemm(ext.sgemm, configs, peaks, timer)
    for row in gemm["shapes"]:
        print(f"sgemm {row['shape']}: best {row['best_tile']} {row['frugaltune']} vs cuBLAS {row['torch_matmul']}")
    assert gemm["autotuned_tile"] in configs


def test_registered_attention_matches_sdpa_in_a_model(ext):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from frugaltune.kernels.attention import NAME, register

    calls = []

    def flash(q, k, v, causal, scale):
        calls.append(q.shape)
        return ext.flash_attn_fwd(q, k, v, causal, scale or 0.0)

    register(flash)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(1, 128, (4, 100), device="cuda")
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        expected = model(ids).logits.float()
        model.set_attn_implementation(NAME)
        got = model(ids).logits.float()
    assert len(calls) == 2  # one call per layer: the kernel ran, not the fallback
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


def test_stage_on_this_device(tmp_path, monkeypatch):
    """`python -m stages.kernels` end to end on this GPU: built, verified, benchmarked, a decision recorded."""
    from frugaltune.hardware import probe
    from stages import kernels as stage
    from frugaltune.config import parse_params

    build_dir = paths.KERNEL_BUILD_DIR.resolve()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(paths, "KERNEL_BUILD_DIR", build_dir)  # reuse the extension built above
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports/hardware.json").write_text(json.dumps(probe()))
    report = stage.run(parse_params({}))
    assert report["mode"] == "cuda"
    for kernel in report["kernels"].values():
        assert kernel["build"]["status"] == "built", kernel["build"]
        assert kernel["verify"]["status"] == "passed", kernel["verify"]
        assert kernel["benchmark"]["status"] == "done", kernel["benchmark"]
    # The kernel is used only with the margin over SDPA in every dtype, so noise near 1x cannot flip the choice.
    shapes = report["kernels"]["flash_attn_fwd"]["benchmark"]["model_shapes"]
    margin = all(row["speedup"] >= shapes["min_speedup"] for row in shapes["dtypes"].values())
    assert report["kernels"]["flash_attn_fwd"]["used"] == margin, shapes
    print(report["summary"])
