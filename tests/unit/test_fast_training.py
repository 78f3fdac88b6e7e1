"""The CPU speed switches of frugaltune/training/fast.py change speed, not results.

    pytest tests/unit/test_fast_training.py
"""

from __future__ import annotations

import pytest
import torch

from frugaltune.planner import MethodKnobs
from frugaltune.training.fast import SharedDropout, fast_lora_dropout, frozen_weights_in, short_sequence_attention
from frugaltune.training.methods import prepare_model


def test_shared_dropout_drops_at_its_rate_keeps_the_expectation_and_reuses_one_mask_per_input():
    torch.manual_seed(0)
    shared: dict = {}
    first, second = SharedDropout(0.05, shared), SharedDropout(0.05, shared)
    x = torch.ones(400, 1000)
    out = first(x)
    dropped = (out == 0).float().mean().item()
    assert abs(dropped - 0.05) < 0.002, dropped
    assert abs(out.mean().item() - 1.0) < 0.003  # kept values scaled by 1 / (1 - p)
    assert second(x) is out  # the sibling projection reads the same tensor: same dropout, computed once
    other = first(x.clone())
    assert not torch.equal(other, out)  # another input draws a fresh mask
    first.eval()
    assert first(x) is x


def test_shared_dropout_gradient_is_the_mask():
    torch.manual_seed(1)
    x = torch.randn(64, 32, requires_grad=True)
    out = SharedDropout(0.5, {})(x)
    out.sum().backward()
    kept = out.detach() != 0
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 2.0))
    assert torch.all(x.grad[~kept] == 0)


@pytest.fixture()
def lora_model(tiny_model_dir, smol_tokenizer):
    return prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, "lora",
                         MethodKnobs(r=4, alpha=8, dropout=0.1), bf16=False)


def test_lora_layers_get_the_shared_dropout_q_k_v_of_one_layer_share_a_cache(lora_model):
    dropouts = {name: m.lora_dropout["default"] for name, m in lora_model.named_modules()
                if isinstance(getattr(m, "lora_dropout", None), torch.nn.ModuleDict)}
    assert dropouts and all(isinstance(d, SharedDropout) for d in dropouts.values())
    q, k, v, o = (next(d for n, d in dropouts.items() if n.endswith(f"layers.0.self_attn.{p}"))
                  for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert q.shared is k.shared is v.shared is o.shared  # one parent module (self_attn): one cache
    other_layer = next(d for n, d in dropouts.items() if n.endswith("layers.1.self_attn.q_proj"))
    assert other_layer.shared is not q.shared
    assert fast_lora_dropout(lora_model) == 0  # already replaced: nothing left to replace


@pytest.mark.parametrize("padded", [False, True])
def test_short_sequence_attention_gives_sdpa_results_and_restores_the_model(lora_model, padded):
    torch.manual_seed(2)
    ids = torch.randint(5, 500, (3, 12))
    mask = torch.ones_like(ids)
    if padded:  # right padding, as collate pads: the eager mask must hide it like SDPA's
        mask[0, 8:] = 0
        mask[2, 5:] = 0
    lora_model.eval()

    def run():
        lora_model.zero_grad()
        logits = lora_model(input_ids=ids, attention_mask=mask).logits
        logits.sum().backward()
        grads = [p.grad.clone() for p in lora_model.parameters() if p.requires_grad]
        return logits.detach(), grads

    reference, reference_grads = run()
    assert lora_model.config._attn_implementation == "sdpa"
    with short_sequence_attention(lora_model, 64):
        assert lora_model.config._attn_implementation.startswith("frugaltune_short")
        eager, eager_grads = run()
    with short_sequence_attention(lora_model, 8):  # 12 tokens > 8: SDPA through our dispatcher
        dispatched, _ = run()
    assert lora_model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(eager, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dispatched, reference, atol=1e-5, rtol=1e-5)
    for a, b in zip(eager_grads, reference_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_short_sequence_attention_off_leaves_the_model_alone(lora_model):
    with short_sequence_attention(lora_model, 0):
        assert lora_model.config._attn_implementation == "sdpa"


def test_kernels_stage_measures_the_attention_crossover_and_the_plan_reads_it_for_its_precision():
    from frugaltune.kernels.cpu import ATTENTION_LENGTHS, ModelShapes, measure_training_attention
    from frugaltune.planner import eager_attention_max_len

    timed = measure_training_attention(ModelShapes(hidden=64, heads=2), tokens=64, repeats=3, warmup=1)
    for precision in ("fp32", "bf16"):
        assert set(timed["ms"][precision]) == {str(n) for n in ATTENTION_LENGTHS}
        assert timed["eager_max_len"][precision] in (0, *ATTENTION_LENGTHS)
        assert all(ms["sdpa"] > 0 and ms["eager"] > 0 for ms in timed["ms"][precision].values())
    measured = {"training_attention": {"eager_max_len": {"fp32": 0, "bf16": 256}}}
    assert eager_attention_max_len(measured, bf16=True) == 256
    assert eager_attention_max_len(measured, bf16=False) == 0
    assert eager_attention_max_len(measured, bf16=True, gpu=True) == 0
    assert eager_attention_max_len(None, bf16=True) == 0  # not measured on this machine: SDPA, as before


def test_lora_in_bf16_stores_the_frozen_projections_in_bf16_and_trains_exactly_as_autocast_casting_them(
        tiny_model_dir, smol_tokenizer):
    """prepare_model(bf16=True) for LoRA: the frozen projections are bf16 (adapters, head, embeddings, norms stay
    fp32), and training under bf16 autocast gives the same losses and the same trained tensors as fp32 weights that
    autocast casts at every use: the matmuls see the same bf16 operands."""
    from frugaltune.training.loop import LoopConfig, train_classifier

    pad = smol_tokenizer.pad_token_id
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (32,), generator=g)]
    labels = [i % 3 for i in range(32)]
    knobs = MethodKnobs(r=4, alpha=8, dropout=0.1)
    runs = {}
    for stored_bf16 in (False, True):
        model = prepare_model(tiny_model_dir, ["a", "b", "c"], pad, 0, "lora", knobs, bf16=stored_bf16)
        frozen = {m.weight.dtype for m in model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad}
        assert frozen == {torch.bfloat16 if stored_bf16 else torch.float32}
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        assert model.get_input_embeddings().weight.dtype == torch.float32
        cfg = LoopConfig(lr=1e-2, head_lr=2e-2, batch_size=8, epochs=1, seed=0, bf16=True, log_every=1)
        result = train_classifier(model, ids, labels, cfg, pad, progress=False)
        runs[stored_bf16] = ([h["loss"] for h in result.history],
                             {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(runs[True][1][name], tensor) for name, tensor in runs[False][1].items())


def test_frozen_weights_leave_a_head_tied_to_the_embeddings_alone(tiny_model_dir, smol_tokenizer):
    """A causal LM's head shares the embedding matrix: storing it in bf16 would make the residual stream bf16."""
    model = prepare_model(tiny_model_dir, [], smol_tokenizer.pad_token_id, 0, "lora", MethodKnobs(r=4, alpha=8),
                          bf16=True, task="causal_lm")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert any(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 for m in model.modules())
    assert frozen_weights_in(model, torch.bfloat16) == 0  # already done; the tied head is never converted


def _seeded_losses_and_grads(model, ids, labels, pad):
    """One forward and backward in training mode with a fixed dropout seed: the loss and every trainable grad."""
    from frugaltune.training.batching import collate

    model.train()
    model.zero_grad(set_to_none=True)
    batch = collate(ids, pad)
    torch.manual_seed(7)
    loss = model(**batch, labels=torch.tensor(labels)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same_losses_and_grads(ours, plain):
    """`_seeded_losses_and_grads` of a switch against the plain model: the same loss and gradients to rounding."""
    torch.testing.assert_close(ours[0], plain[0], rtol=1e-5, atol=1e-6)
    for name, grad in plain[1].items():
        torch.testing.assert_close(ours[1][name], grad, rtol=1e-4, atol=1e-6)


def test_fused_siblings_gives_the_same_loss_and_gradients_keeps_names_and_restores_the_layers(lora_model,
                                                                                               smol_tokenizer):
    """q/k/v base projections, q/k/v's LoRA A (one shared dropout) and gate/up run as one matmul per group inside
    the block: same loss and gradients as separately, same parameter names (a checkpoint taken meanwhile is the
    same), and on exit the layers run their own forward again on weights that share no storage."""
    from frugaltune.training.fast import fused_siblings

    pad = smol_tokenizer.pad_token_id
    ids, labels = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]], [0, 1, 2]
    names = [name for name, _ in lora_model.named_parameters()]
    plain = _seeded_losses_and_grads(lora_model, ids, labels, pad)
    layers = lora_model.config.num_hidden_layers
    with fused_siblings(lora_model) as fused:
        assert fused == 3 * layers  # per layer: q/k/v base, q/k/v LoRA A, gate/up (not adapted)
        assert [name for name, _ in lora_model.named_parameters()] == names
        attention = lora_model.base_model.model.model.layers[0].self_attn
        assert attention.k_proj.base_layer.weight.data_ptr() == (  # views of one concatenated weight
            attention.q_proj.base_layer.weight.data_ptr() + attention.q_proj.base_layer.weight.numel() * 4)
        fused_run = _seeded_losses_and_grads(lora_model, ids, labels, pad)
    _assert_same_losses_and_grads(fused_run, plain)
    assert "forward" not in attention.q_proj.base_layer.__dict__  # the class's forward again
    pointers = [m.weight.data_ptr() for m in lora_model.modules() if type(m) is torch.nn.Linear]
    assert len(pointers) == len(set(pointers))
    again = _seeded_losses_and_grads(lora_model, ids, labels, pad)
    assert torch.equal(again[0], plain[0])


def test_fused_siblings_leaves_dora_and_qlora_projections_alone(tiny_model_dir, smol_tokenizer):
    """DoRA reads its base weight in its own forward and QLoRA's base is 4-bit: their q/k/v stay separate (the
    plain gate/up of DoRA still fuse)."""
    from frugaltune.training.fast import fused_siblings

    dora = prepare_model(tiny_model_dir, ["a", "b"], smol_tokenizer.pad_token_id, 0, "dora",
                         MethodKnobs(r=4, alpha=8), bf16=False)
    with fused_siblings(dora) as fused:
        assert fused == dora.config.num_hidden_layers  # gate/up only
    with fused_siblings(dora, enabled=False) as fused:
        assert fused == 0
    qlora = prepare_model(tiny_model_dir, ["a", "b"], smol_tokenizer.pad_token_id, 0, "qlora",
                          MethodKnobs(r=4, alpha=8), bf16=False)
    with fused_siblings(qlora) as fused:
        assert fused == 0  # every projection is 4-bit


@pytest.mark.skipif(not __import__("frugaltune.training.fast", fromlist=["x"]).packing_available(),
                    reason="this torch build has no oneDNN reordered linear weights")
def test_packed_weights_train_bit_identically_and_give_the_dense_weights_back(tiny_model_dir, smol_tokenizer):
    """LoRA in bf16 with the frozen projections on oneDNN-reordered weights (LoopConfig.packed_weights): the same
    losses and trained tensors as the plain bf16 weights, bit for bit (same kernel, same sums); on exit every frozen
    weight is its dense self again and the layers run their own forward."""
    from frugaltune.training.loop import LoopConfig, train_classifier

    pad = smol_tokenizer.pad_token_id
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(5, 500, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (32,), generator=g)]
    labels = [i % 3 for i in range(32)]
    knobs = MethodKnobs(r=4, alpha=8, dropout=0.1,
                        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    runs = {}
    for packed in (False, True):
        model = prepare_model(tiny_model_dir, ["a", "b", "c"], pad, 0, "lora", knobs, bf16=True)
        frozen = {n: m.weight.detach().clone() for n, m in model.named_modules()
                  if type(m) is torch.nn.Linear and not m.weight.requires_grad}
        assert frozen and all(w.dtype == torch.bfloat16 for w in frozen.values())
        cfg = LoopConfig(lr=1e-2, head_lr=2e-2, batch_size=8, epochs=1, seed=0, bf16=True, log_every=1,
                         packed_weights=packed)
        result = train_classifier(model, ids, labels, cfg, pad, progress=False)
        runs[packed] = ([h["loss"] for h in result.history],
                        {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        modules = dict(model.named_modules())
        assert all(torch.equal(modules[n].weight, w) for n, w in frozen.items())
        assert not any("forward" in modules[n].__dict__ for n in frozen)
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(runs[True][1][name], tensor) for name, tensor in runs[False][1].items())


def test_packed_weights_reorder_every_frozen_bf16_projection_inside_the_block(tiny_model_dir, smol_tokenizer):
    from frugaltune.training.fast import packed_frozen_weights, packing_available

    model = prepare_model(tiny_model_dir, ["a", "b"], smol_tokenizer.pad_token_id, 0, "lora", MethodKnobs(r=4),
                          bf16=True)
    frozen = [m for m in model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad]
    with packed_frozen_weights(model) as packed:
        assert packed == (len(frozen) if packing_available() else 0)
    with packed_frozen_weights(model, enabled=False) as packed:
        assert packed == 0
    fp32 = prepare_model(tiny_model_dir, ["a", "b"], smol_tokenizer.pad_token_id, 0, "lora", MethodKnobs(r=4))
    with packed_frozen_weights(fp32) as packed:
        assert packed == 0  # fp32 weights (a machine where fp32 wins): nothing to reorder for the bf16 kernel


def test_bf16_projection_inputs_hand_the_projections_bf16_once_and_train_as_autocast_to_rounding(
        tiny_model_dir, smol_tokenizer):
    """Under bf16 autocast the projections read bf16 from the norms (peft's upcast of LoRA's input off), the loss and
    gradients agree with autocast's own casts to bf16 rounding, a norm outside autocast keeps fp32, and on exit the
    hooks and peft's flag are gone."""
    from frugaltune.training.fast import bf16_projection_inputs

    model = prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, "lora",
                          MethodKnobs(r=4, alpha=8, dropout=0.1), bf16=True)
    pad = smol_tokenizer.pad_token_id
    ids, labels = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]], [0, 1, 2]
    seen: list[torch.dtype] = []
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    layer.base_layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))

    def bf16_run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _seeded_losses_and_grads(model, ids, labels, pad)

    cast_by_autocast = bf16_run()
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())  # transformers' own, if any
    assert seen[-1] == torch.float32  # the fp32 residual stream: autocast casts it in each projection
    with bf16_projection_inputs(model) as norms:
        assert norms == 2 * model.config.num_hidden_layers
        handed = bf16_run()
        assert seen[-1] == torch.bfloat16
        norm = next(m for n, m in model.named_modules() if n.endswith("layers.0.input_layernorm"))
        assert norm(torch.randn(2, 3, model.config.hidden_size)).dtype == torch.float32  # no autocast: left alone
    torch.testing.assert_close(handed[0], cast_by_autocast[0], rtol=2e-2, atol=2e-2)
    for name, grad in cast_by_autocast[1].items():
        if not grad.any():  # LoRA's A at initialization: B = 0 gives it no gradient either way
            assert not handed[1][name].any(), name
            continue
        assert torch.nn.functional.cosine_similarity(handed[1][name].flatten(), grad.flatten(), dim=0) > 0.99, name
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before
    lora = [m for m in model.modules() if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)]
    assert lora and all(m.cast_input_dtype_enabled for m in lora)  # peft's own setting back
    assert torch.equal(bf16_run()[0], cast_by_autocast[0])  # exactly the autocast path again


def test_bf16_projection_inputs_leave_dora_alone(tiny_model_dir, smol_tokenizer):
    from frugaltune.training.fast import bf16_projection_inputs

    model = prepare_model(tiny_model_dir, ["a", "b"], smol_tokenizer.pad_token_id, 0, "dora",
                          MethodKnobs(r=4, alpha=8), bf16=True)
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    with bf16_projection_inputs(model) as norms:
        assert norms == 0
        assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before


def test_lora_addmm_gives_the_same_loss_and_gradients_and_restores_peft_forward(lora_model, tiny_model_dir,
                                                                               smol_tokenizer):
    """Vanilla LoRA layers add B's product inside one addmm, scaling the rank-r activations: in fp32 the same loss
    and gradients as peft's forward (to rounding), with B non-zero so that the adapters' path counts; DoRA is left
    to peft; on exit peft's own forward again."""
    from frugaltune.training.fast import lora_addmm

    with torch.no_grad():  # B starts at zero, which would hide a wrong scaling or a missing add
        torch.manual_seed(1)
        for name, param in lora_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    pad = smol_tokenizer.pad_token_id
    ids, labels = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]], [0, 1, 2]
    plain = _seeded_losses_and_grads(lora_model, ids, labels, pad)
    adapted = sum(1 for m in lora_model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer"))
    with lora_addmm(lora_model) as layers:
        assert layers == adapted > 0
        ours = _seeded_losses_and_grads(lora_model, ids, labels, pad)
    _assert_same_losses_and_grads(ours, plain)
    assert not any("forward" in vars(m) for m in lora_model.modules())
    with lora_addmm(lora_model, enabled=False) as layers:
        assert layers == 0
    dora = prepare_model(tiny_model_dir, ["a", "b"], pad, 0, "dora", MethodKnobs(r=4, alpha=8), bf16=False)
    with lora_addmm(dora) as layers:
        assert layers == 0  # DoRA computes on its base weight in its own forward


def test_compiled_norms_give_the_same_loss_and_gradients_and_leave_the_model_as_it_was(lora_model, smol_tokenizer):
    """Every RMSNorm (two a decoder layer, one at the top) runs its forward compiled inside the block: the same loss
    and gradients as eager to rounding, nothing of the model's random state consumed (the next test run's dropout
    masks stay the same), and on exit the class's forward again."""
    import shutil

    from frugaltune.training.fast import compiled_norms, norm_status

    pad = smol_tokenizer.pad_token_id
    ids, labels = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]], [0, 1, 2]
    plain = _seeded_losses_and_grads(lora_model, ids, labels, pad)
    with compiled_norms(lora_model) as norms:
        compiled = norm_status()["compiled"]
        assert norms == (2 * lora_model.config.num_hidden_layers + 1 if compiled else 0)
        ours = _seeded_losses_and_grads(lora_model, ids, labels, pad)
    if any(shutil.which(cxx) for cxx in ("g++", "clang++", "c++")):
        assert compiled is True, norm_status()
    _assert_same_losses_and_grads(ours, plain)
    assert not any("forward" in vars(m) for m in lora_model.modules())
    with compiled_norms(lora_model, enabled=False) as norms:
        assert norms == 0
