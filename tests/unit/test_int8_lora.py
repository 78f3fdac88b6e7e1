"""LoRA over int8 products as one autograd node per product (frugaltune/training/fast.py).

    pytest tests/unit/test_int8_lora.py
"""

from __future__ import annotations

import pytest
import torch

from frugaltune import int8
from frugaltune.planner.memory import MethodKnobs
from frugaltune.classify import collate
from frugaltune.training.fast import fused_int8_lora
from frugaltune.training.methods import prepare_model
from frugaltune.methods import get as method_named

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS, LABELS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]], [0, 1, 2]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def int8_lora(tiny_model_dir, smol_tokenizer, method="lora", dropout=0.1, targets=SEVEN, grouped=True):
    torch.manual_seed(3)
    model = prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, method_named(method),
                          MethodKnobs(r=4, alpha=8, dropout=dropout, target_modules=targets), bf16=False)
    with torch.no_grad():  # a frozen bias (Qwen2's q/k/v) starts at zero, which would hide a missing add
        for module in model.modules():
            if type(module) is torch.nn.Linear and module.bias is not None and not module.bias.requires_grad:
                module.bias.normal_(std=0.5)
    int8.apply(model, {"on": True, "why": "test"}, method_named(method), grouped=grouped)
    with torch.no_grad():  # B starts at zero, which would hide a wrong scaling, a missing add or A's gradients
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return model


def losses_and_grads(model, pad, bf16=False):
    """One training forward and backward with a fixed dropout seed: the loss and every trainable gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    batch = collate(IDS, pad)
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch, labels=torch.tensor(LABELS)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_as_peft(ours, plain):
    """fp32: the same loss and the same (non-zero) gradient for every trainable tensor, to rounding."""
    torch.testing.assert_close(ours[0], plain[0], rtol=1e-5, atol=1e-6)
    assert plain[1].keys() == ours[1].keys() and len(plain[1]) > 0
    for name, grad in plain[1].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(ours[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory, smol_tokenizer):
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), smol_tokenizer, architecture="qwen2")


@pytest.mark.parametrize("grouped", [True, False])
def test_fused_int8_lora_adds_the_frozen_q_k_v_biases_of_qwen2_as_peft(tiny_qwen2_dir, smol_tokenizer, grouped):
    """Qwen2's q/k/v carry frozen biases: they run in the fused node too (one per group or lone layer, none left to
    peft's forward), with peft's loss and gradients."""
    model = int8_lora(tiny_qwen2_dir, smol_tokenizer, grouped=grouped)
    assert model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.bias.abs().sum() > 0
    pad = smol_tokenizer.pad_token_id
    plain = losses_and_grads(model, pad)
    with fused_int8_lora(model) as nodes:
        assert nodes == (4 if grouped else 7) * model.config.num_hidden_layers
        ours = losses_and_grads(model, pad)
    assert_same_as_peft(ours, plain)


@pytest.mark.parametrize(("dropout", "grouped"), [(0.1, True), (0.0, True), (0.1, False)])
def test_fused_int8_lora_trains_as_peft_with_the_same_dropout_masks_and_restores_peft(tiny_model_dir, smol_tokenizer,
                                                                                       dropout, grouped):
    """fp32: the same loss and gradients as peft's layers over the same int8 products (the same masks: the same
    random draws in the same order), one node per q/k/v and gate/up group and per lone o/down (per layer without
    grouping); nothing held after the forward; on exit peft's forward again, and evaluation without grad never
    enters the fused path."""
    model = int8_lora(tiny_model_dir, smol_tokenizer, dropout=dropout, grouped=grouped)
    pad = smol_tokenizer.pad_token_id
    plain = losses_and_grads(model, pad)
    with fused_int8_lora(model) as nodes:
        assert nodes == (4 if grouped else 7) * model.config.num_hidden_layers  # q/k/v, o, gate/up, down
        ours = losses_and_grads(model, pad)
        with torch.no_grad():  # evaluation: peft's forward, the same logits as outside the block
            model.eval()
            inside = model(**collate(IDS, pad)).logits
    assert_same_as_peft(ours, plain)
    assert not any("forward" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**collate(IDS, pad)).logits, inside)
    again = losses_and_grads(model, pad)
    assert torch.equal(again[0], plain[0])


def test_fused_int8_lora_in_bf16_is_as_close_to_fp32_as_peft_in_bf16(tiny_model_dir, smol_tokenizer):
    """Under bf16 autocast both paths round, differently (one rounding of each sum instead of two): the fused
    loss and gradients are as close to the fp32 run's as peft's bf16 ones are (1-4% per tensor on the tiny model),
    far from what a wrong scale, mask or missing term gives (the order of the values themselves)."""
    model = int8_lora(tiny_model_dir, smol_tokenizer)
    pad = smol_tokenizer.pad_token_id
    fp32 = losses_and_grads(model, pad)
    plain = losses_and_grads(model, pad, bf16=True)
    with fused_int8_lora(model):
        ours = losses_and_grads(model, pad, bf16=True)
    assert relative(ours[0], fp32[0]) < 2e-3
    peft_worst = max(relative(plain[1][name], grad) for name, grad in fp32[1].items())
    ours_worst = max(relative(ours[1][name], grad) for name, grad in fp32[1].items())
    assert ours_worst < 1.5 * peft_worst and ours_worst < 0.1, (ours_worst, peft_worst)


def test_fused_int8_lora_takes_only_vanilla_lora_over_int8_products(tiny_model_dir, smol_tokenizer):
    """DoRA (its own forward reads the base weight), LoRA without int8 products and a group whose members are not
    all adapted stay with peft's forward."""
    dora = int8_lora(tiny_model_dir, smol_tokenizer, method="dora")
    with fused_int8_lora(dora) as nodes:
        assert nodes == 0
    plain = prepare_model(tiny_model_dir, ["a", "b"], smol_tokenizer.pad_token_id, 0, method_named("lora"),
                          MethodKnobs(r=4, alpha=8, target_modules=SEVEN), bf16=False)
    with fused_int8_lora(plain) as nodes:
        assert nodes == 0
    qv = int8_lora(tiny_model_dir, smol_tokenizer, targets=("q_proj", "v_proj", "o_proj"))  # k: int8, not adapted
    with fused_int8_lora(qv) as nodes:
        assert nodes == qv.config.num_hidden_layers  # o_proj alone; q/v's group has a plain member
    with fused_int8_lora(qv, enabled=False) as nodes:
        assert nodes == 0


def test_fused_int8_lora_trains_a_causal_lm_as_peft_under_gradient_checkpointing(tiny_model_dir, smol_tokenizer):
    """Generative fine-tuning (the causal_lm task: the model's own LM head) with gradient checkpointing: the
    recomputed forward of each layer draws the same dropout masks from the restored generator, so the loss and the
    gradients are peft's, in fp32, to rounding."""
    pad = smol_tokenizer.pad_token_id
    torch.manual_seed(3)
    model = prepare_model(tiny_model_dir, [], pad, 0, method_named("lora"), MethodKnobs(r=4, alpha=8, dropout=0.1,
                                                                          target_modules=SEVEN),
                          bf16=False, gradient_checkpointing=True, task="causal_lm")
    int8.apply(model, {"on": True, "why": "test"}, method_named("lora"), grouped=True)
    with torch.no_grad():
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])

    def step():
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = step()
    with fused_int8_lora(model) as nodes:
        assert nodes == 4 * model.config.num_hidden_layers
        ours = step()
    assert_same_as_peft(ours, plain)
