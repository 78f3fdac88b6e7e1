"""int8 products with frozen weights (frugaltune/int8.py): the same products to int8's precision, gradients included.

    pytest tests/unit/test_int8.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from frugaltune import int8
from frugaltune.planner.memory import MethodKnobs
from frugaltune.training.loop import count_parameters
from frugaltune.training.methods import prepare_model
from frugaltune.methods import get as method_named

pytestmark = pytest.mark.skipif(not hasattr(torch, "_int_mm"), reason="this torch has no torch._int_mm")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def frozen_linear(k: int, n: int, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=bias)
    linear.weight.requires_grad_(False)
    return linear


@pytest.mark.slow  # compiles quantize and rescale (inductor) on first use
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_input_gradient_match_fp32_to_int8_precision(bias):
    linear = frozen_linear(96, 160, bias)
    quantized = int8.Int8FrozenLinear(linear)
    int8._prepare_steps()
    x = torch.randn(3, 37, 96, requires_grad=True)
    reference = linear(x)
    grad = torch.randn_like(reference)
    reference.backward(grad)
    expected = x.grad.clone()
    x.grad = None
    out = quantized(x)
    out.backward(grad)
    assert out.shape == reference.shape and out.dtype == torch.float32  # no autocast: the input's dtype
    assert relative(out, reference) < 0.02, relative(out, reference)
    assert relative(x.grad, expected) < 0.02, relative(x.grad, expected)
    assert linear.weight.grad is None  # the weight stays frozen
    broken = int8.Int8FrozenLinear(frozen_linear(96, 160, bias))
    broken.s_rows.mul_(2)  # a wrong scale is caught by the same bound
    assert relative(broken(x), reference) > 0.5


@pytest.mark.slow
def test_autocast_gives_bf16_and_the_gradient_keeps_the_input_dtype():
    quantized = int8.Int8FrozenLinear(frozen_linear(64, 32))
    int8._prepare_steps()
    x = torch.randn(5, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = quantized(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32


@pytest.mark.slow
def test_one_input_is_quantized_once_and_a_changed_input_again():
    first, second = int8.Int8FrozenLinear(frozen_linear(64, 32)), int8.Int8FrozenLinear(frozen_linear(64, 48))
    int8._prepare_steps()
    x = torch.randn(7, 64)
    with torch.no_grad():
        a = first(x)
        assert int8._SHARED["input"] is x
        b = second(x)  # q's quantized input reused for k
        assert relative(b, x @ second.weight.t()) < 0.02
        x.mul_(2)  # in place: a new version, so quantized anew
        assert relative(first(x), 2 * a) < 1e-5
        assert relative(first(x.clone()), 2 * a) < 1e-5  # another tensor: its own quantization


@pytest.mark.slow
def test_to_int8_replaces_only_frozen_linears_and_lora_still_trains_and_saves(tiny_model_dir, smol_tokenizer,
                                                                              tmp_path):
    from frugaltune.training.methods import load_trained, save_trained

    model = prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, method_named("lora"),
                          MethodKnobs(r=4, alpha=8, dropout=0.0), bf16=False)
    frozen = sum(1 for m in model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad)
    assert int8.to_int8(model, keep_weights=False) == frozen > 0
    assert all(m.weight.is_meta for m in model.modules() if isinstance(m, int8.Int8FrozenLinear))
    assert not any(type(m) is torch.nn.Linear and not m.weight.requires_grad for m in model.modules())
    assert any(type(m) is torch.nn.Linear and m.weight.requires_grad for m in model.modules())  # the head
    ids = torch.randint(5, 500, (4, 10))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.nn.functional.cross_entropy(out, torch.tensor([0, 1, 2, 0])).backward()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.grad is not None for p in lora_b)
    assert sum(p.grad.abs().sum().item() for p in lora_b) > 0  # gradients reach the adapters through int8 products
    with torch.no_grad():
        lora_b[0].add_(1.0)
    save_trained(model, method_named("lora"), tmp_path)  # the adapter alone: the meta weights are not part of it
    fresh = prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, method_named("none"), MethodKnobs(),
                          bf16=False)
    loaded = dict(load_trained(fresh, tmp_path).named_parameters())
    name = next(n for n, p in model.named_parameters() if p is lora_b[0])
    assert torch.equal(loaded[name].detach(), lora_b[0].detach())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["qlora", "dora", "lora"])
def test_qlora_and_dora_train_through_int8_products_close_to_their_own(tiny_model_dir, smol_tokenizer, method):
    """QLoRA's NF4 Linear4bit layers become int8 (copies of their dequantized blocks, the 4-bit weights dropped, also
    after bitsandbytes repacked them); DoRA's Linears keep their weights for the norm it reads; LoRA's are dropped.
    Each stays close to its own model and still trains."""
    model = prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, method_named(method),
                          MethodKnobs(r=4, alpha=8, dropout=0.0), bf16=False)
    model.eval()
    ids = torch.randint(5, 500, (4, 10))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():  # in eval without grad bitsandbytes repacks its NF4 weights for its CPU kernel
        before = model(**batch).logits.float()
    frozen = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    counts = count_parameters(model)
    decision = int8.apply(model, {"on": True, "why": "test"}, method_named(method))
    assert count_parameters(model) == counts  # the reports' trainable % stays the model's (4-bit packed or not)
    assert decision["modules"] == len(frozen) > 0
    swapped = [m for m in model.modules() if isinstance(m, int8.Int8FrozenLinear)]
    assert len(swapped) == len(frozen)
    assert all(m.weight.is_meta for m in swapped) == (method != "dora")
    assert not any(int8._is_4bit(m) for m in model.modules())  # none of bitsandbytes' NF4 layers left
    after = model(**batch).logits.float()
    assert ((after - before).norm() / before.norm()).item() < 0.05  # int8's per-row precision, not another model
    torch.nn.functional.cross_entropy(after, torch.tensor([0, 1, 2, 0])).backward()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and sum(p.grad.abs().sum().item() for p in lora_b) > 0  # through the int8 products


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "dora"])
def test_grouped_siblings_compute_what_each_product_alone_does(tiny_model_dir, smol_tokenizer, method):
    """q/k/v and gate/up as one int8 product each: the same logits and adapter gradients as the products one by
    one (forward: the same scales; backward: each output gradient keeps its own), and no second copy of a weight."""
    def build(grouped: bool):
        torch.manual_seed(3)
        model = prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, method_named(method),
                              MethodKnobs(r=4, alpha=8, dropout=0.0), bf16=False)
        decision = int8.apply(model, {"on": True, "why": "test"}, method_named(method), grouped=grouped)
        torch.manual_seed(4)  # the first int8 model compiles its steps on random tensors
        with torch.no_grad():  # B starts at zero: A's gradients would be zero, whatever the products did
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1)
        ids = torch.randint(5, 500, (4, 10))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
        torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 0])).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}
        return model, decision, logits, grads

    alone, decision_alone, logits_alone, grads_alone = build(False)
    grouped, decision, logits, grads = build(True)
    layers = grouped.config.num_hidden_layers
    assert decision_alone["groups"] == 0 and decision["groups"] == 2 * layers  # q/k/v and gate/up per layer
    assert torch.equal(logits, logits_alone)
    assert grads.keys() == grads_alone.keys() and len(grads) > 0
    for name, grad in grads.items():  # an fp32 sum in another order: rounding, nothing more
        assert grad.abs().sum() > 0 and relative(grad, grads_alone[name]) < 1e-3, name
    q = next(m for n, m in grouped.named_modules() if n.endswith("q_proj.base_layer"))
    assert q.group is not None and q.w_rows.data_ptr() == q.group.w_rows.data_ptr()  # a view of the stacked rows
    assert not q.group.pending  # every member served: nothing held after the forward


def test_decide_follows_the_setting_the_device_and_the_method():
    assert int8.decide(False, "lora", True, 64, 128, False)["on"] is False
    assert int8.decide(True, "dora", True, 64, 128, False)["on"] is True
    assert int8.decide(True, "lora", True, 64, 128, True)["on"] is False  # a GPU keeps its tensor cores
    assert int8.decide("auto", "full", True, 64, 128, False)["on"] is False  # auto covers what was measured
    assert int8.decide("auto", "prelayer", True, 64, 128, False)["on"] is False
    assert int8.decide("auto", "qlora", True, 64, 128, False)["on"] is False  # measured, lost quality: true only
    measured = int8.decide("auto", "lora", True, 64, 128, False)
    assert measured["on"] == (measured["gemm_ratio"] >= int8.MIN_GEMM_RATIO)
    assert f"{measured['gemm_ratio']:.2f}x bf16" in measured["why"]
    fp32 = int8.decide("auto", "lora", False, 64, 128, False)  # fp32 training: they lost quality there
    assert fp32["on"] is False and "fp32" in fp32["why"] and "gemm_ratio" not in fp32


def test_the_gemm_ratio_reads_the_machine_through_busy_moments(monkeypatch):
    """A shared machine's busy moments slow whichever timing they hit: here every third timing is 10x slower, on
    either side. The fastest of each side's alternated timings gives the ratio of the model's products as a whole
    (4 ms plain against 3 ms int8 over both shapes), whichever timings the busy moments hit."""
    calls = []
    plain_ms = {576: 1.0, 1536: 3.0}  # by the plain product's inner size: int8 wins on one shape only
    int8_ms = {576: 2.0, 1536: 1.0}

    def timed(product, repeats):
        out = product()
        inner = 576 if out.shape[1] == 1536 else 1536
        ms = (int8_ms if out.dtype == torch.int32 else plain_ms)[inner]
        calls.append(out.dtype)
        return ms * (10 if len(calls) % 3 == 0 else 1) / 1e3

    monkeypatch.setattr(int8, "_seconds", timed)
    assert int8.gemm_ratio(576, 1536, bf16=False, rows=8) == pytest.approx(4.0 / 3.0)
    # alternated: each round times the plain product, then the int8 one, shape by shape
    assert calls[:4] == [torch.float32, torch.int32, torch.float32, torch.int32]


@pytest.mark.slow
def test_without_a_compiler_quantize_and_rescale_run_eager(tmp_path):
    """A real compiler failure (a C++ compiler that does not exist, no cached kernels): same products, eager."""
    code = (
        "import torch, torch._inductor.config as c\n"
        "c.cpp.cxx = ('/nonexistent/c++',)\n"
        "from frugaltune import int8\n"
        "lin = torch.nn.Linear(32, 16).requires_grad_(False)\n"
        "m = int8.Int8FrozenLinear(lin); int8._prepare_steps()\n"
        "x = torch.randn(4, 32)\n"
        "err = ((m(x) - lin(x)).norm() / lin(x).norm()).item()\n"
        "print(int8.status()['compiled'], err < 0.02)\n"
    )
    env = dict(os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("setting", [True, False])
def test_the_plans_decision_is_applied_and_recorded(tiny_model_dir, smol_tokenizer, setting):
    from frugaltune.planner.machine import decide_machine
    from frugaltune.training.distributed import World
    from frugaltune.training.setup import apply_int8

    decided = decide_machine({}, None, "fp32", setting, ("lora",), (32, 64))
    model = prepare_model(tiny_model_dir, ["a", "b"], smol_tokenizer.pad_token_id, 0, method_named("lora"), MethodKnobs(r=4),
                          bf16=False)
    decision = apply_int8(model, decided["int8"]["lora"], method_named("lora"), World())
    swapped = sum(isinstance(m, int8.Int8FrozenLinear) for m in model.modules())
    assert decision["on"] is setting and swapped == decision.get("modules", 0)
    assert (swapped > 0) is setting
    if setting and any(shutil.which(cxx) for cxx in ("g++", "clang++", "c++")):
        assert decision["compiled"] is True  # a compiler is here: the fast path, not the fallback


@pytest.mark.slow  # compiles quantize and rescale (inductor)
def test_one_compiled_graph_per_input_dtype_in_a_bf16_step():
    """torch.compile guards on grad mode, autocast, requires_grad and strides; a bf16 LoRA step calls the steps in
    forward (autocast on) and backward, with inputs that do and do not require grad, in fp32 (after a norm) and bf16
    (o_proj's, down_proj's input), at each batch's length. Every recompilation is seconds of a run's first steps:
    10 graphs in the loop before this was pinned down, where only the input's and the output's dtype must differ."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    int8._STEPS.clear()
    int8._prepare_steps()  # 2 graphs: quantize and rescale as fp32 training calls them (autocast off)
    before = counters["stats"]["unique_graphs"]
    first, second = int8.Int8FrozenLinear(frozen_linear(96, 160)), int8.Int8FrozenLinear(frozen_linear(160, 96))
    for length in (37, 21, 50):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = torch.randn(2, length, 96)  # the first layer's input: no gradient wanted
            h = torch.randn(2, length, 96, requires_grad=True)
            out = second(first(x).float().relu() + first(h).float())  # second's input in fp32, first's output bf16
            out = out + second(first(h).to(torch.bfloat16).float())  # a bf16 input would go the same way
            hb = torch.randn(2, length, 160, dtype=torch.bfloat16, requires_grad=True)
            out = out + second(hb)
        out.float().sum().backward()
    # quantize: fp32 and bf16 inputs; rescale: to bf16 (forward) and to fp32 (an fp32 input's gradient), a bf16
    # input's gradient in bf16 sharing the forward's graph; and one more of rescale that torch 2.13 makes at its
    # second call whatever the layouts (a guard failing on "'NoneType' object has no attribute 'size'"). 7 before.
    assert counters["stats"]["unique_graphs"] - before <= 5, counters["stats"]
