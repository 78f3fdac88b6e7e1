"""The CPU speed switches of frugaltune/training/fast.py change speed, not results.

    pytest tests/unit/test_fast_training.py
"""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from frugaltune.planner.memory import MethodKnobs
from frugaltune.training.fast import (SharedDropout, eager_attention, fast_lora_dropout, frozen_weights_in,
                                     short_sequence_attention)
from frugaltune.training.methods import prepare_model
from frugaltune.methods import get as method_named


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
    return prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, method_named("lora"),
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


def test_short_sequence_attention_under_bf16_autocast_gives_the_mask_in_bf16(lora_model):
    """Under autocast the eager path's mask comes in the autocast dtype (no fp32 copy of the scores), the rotary
    embedding stays fp32; the logits stay SDPA's to bf16's precision."""
    torch.manual_seed(4)
    ids = torch.randint(5, 500, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    rotary = next(m for m in lora_model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    attention = next(m for m in lora_model.modules() if type(m).__name__.endswith("Attention"))
    seen: list[torch.dtype] = []
    masks: list[torch.dtype] = []
    hooks = [rotary.register_forward_hook(lambda module, args, out: seen.append(out[0].dtype)),
             attention.register_forward_pre_hook(lambda module, args, kwargs: masks.append(
                 kwargs["attention_mask"].dtype if kwargs.get("attention_mask") is not None else None),
                 with_kwargs=True)]
    lora_model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        reference = lora_model(input_ids=ids, attention_mask=mask).logits.float()
        with short_sequence_attention(lora_model, 64):
            eager = lora_model(input_ids=ids, attention_mask=mask).logits.float()
        with short_sequence_attention(lora_model, 8):  # longer than 8 tokens: SDPA and its own mask
            dispatched = lora_model(input_ids=ids, attention_mask=mask).logits.float()
    for hook in hooks:
        hook.remove()
    assert seen == [torch.float32] * 3
    assert masks[1] == torch.bfloat16 and masks[0] != torch.bfloat16 and masks[2] != torch.bfloat16
    torch.testing.assert_close(eager, reference, atol=0.05, rtol=0.05)
    torch.testing.assert_close(dispatched, reference)


def _attention_step(threads: int, length: int, seed: int, dtype: torch.dtype = torch.bfloat16,
                    attention=eager_attention) -> list[torch.Tensor]:
    """One forward and backward of `attention` at SmolLM2-135M's head shape (9 query heads over 3 key/value heads)
    under a causal mask, on `threads` threads: its output and the three input gradients."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(16, heads, length, 64, generator=generator, dtype=dtype, requires_grad=True)
                   for heads in (9, 3, 3))
        grad = torch.randn(16, length, 9, 64, generator=generator, dtype=dtype)
        causal = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype).triu(1)
        out, _ = attention(SimpleNamespace(num_key_value_groups=3, training=True), q, k, v, causal, 64 ** -0.5)
        out.backward(grad)
        return [out.detach(), q.grad, k.grad, v.grad]
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [37, 44])
def test_the_eager_path_trains_the_same_gradients_on_one_thread_as_on_two(length, dtype):
    """aten's CPU softmax backward summed a row whose length is not a multiple of the vector width in an order that
    depended on the thread count: a run that dropped a thread on a busy machine trained other weights than a quiet
    run of the same seed. (With aten's, fp32 differed on every seed tried; bf16 rounds most of the difference away.)"""
    for seed in range(4):
        ones, twos = _attention_step(1, length, seed, dtype), _attention_step(2, length, seed, dtype)
        assert all(torch.equal(a, b) for a, b in zip(twos, ones))


def test_the_eager_path_is_transformers_eager_attention_forward_bit_for_bit_and_its_gradients_to_rounding():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    ours = _attention_step(2, 21, seed=5)
    theirs = _attention_step(2, 21, seed=5, attention=eager_attention_forward)
    assert torch.equal(ours[0], theirs[0])
    for mine, reference in zip(ours[1:], theirs[1:]):
        torch.testing.assert_close(mine.float(), reference.float(), atol=0.02, rtol=0.02)


def test_short_sequence_attention_off_leaves_the_model_alone(lora_model):
    with short_sequence_attention(lora_model, 0):
        assert lora_model.config._attn_implementation == "sdpa"


def test_kernels_stage_measures_the_attention_crossover_and_the_plan_reads_it_for_its_precision():
    from frugaltune.kernels.cpu import ATTENTION_LENGTHS, ModelShapes, measure_training_attention
    from frugaltune.planner.machine import eager_attention_max_len

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
        model = prepare_model(tiny_model_dir, ["a", "b", "c"], pad, 0, method_named("lora"), knobs, bf16=stored_bf16)
        frozen = {m.weight.dtype for m in model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad}
        assert frozen == {torch.bfloat16 if stored_bf16 else torch.float32}
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        assert model.get_input_embeddings().weight.dtype == torch.float32
        cfg = LoopConfig.build(lr=1e-2, head_lr=2e-2, batch_size=8, epochs=1, seed=0, bf16=True, log_every=1)
        result = train_classifier(model, ids, labels, cfg, pad, progress=False)
        runs[stored_bf16] = ([h["loss"] for h in result.history],
                             {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(runs[True][1][name], tensor) for name, tensor in runs[False][1].items())


def test_lora_in_bf16_leaves_no_tensor_in_the_file_mapping_whose_fp32_pages_it_read(tiny_model_dir, smol_tokenizer,
                                                                                   tmp_path):
    """Converting the frozen projections reads every fp32 page of model.safetensors' mapping; while one tensor
    (embeddings, norms) aliases it, those pages stay in the RSS next to the bf16 copies. prepare_model copies the
    tensors left in it, so that the mapping goes; in fp32 the weights stay where they were loaded."""
    import shutil

    from frugaltune.training.methods import _file_mappings

    # a copy of its own: models other tests of this process still hold map the shared one
    tiny_model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))

    def aliasing(model) -> list[str]:
        ranges = _file_mappings()
        return [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                if any(start <= t.data_ptr() < end for start, end in ranges)]

    knobs = MethodKnobs(r=4, alpha=8, dropout=0.1)
    loaded = prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, method_named("lora"), knobs)
    assert "base_model.model.model.embed_tokens.weight" in aliasing(loaded)  # fp32: loaded zero-copy, left there
    del loaded
    gc.collect()  # peft's model holds reference cycles: without a collection the fp32 model's mapping may outlive `del`
    model = prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, method_named("lora"), knobs, bf16=True)
    assert aliasing(model) == []
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert not any(str(tiny_model_dir) in line for line in Path("/proc/self/maps").read_text().splitlines())


def _mapping_rss_kb(path: Path) -> int:
    """Resident KiB of this process's mapping of `path` (/proc/self/smaps)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ")[0] and len(line.split()) >= 5:  # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1])
    return rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_a_replaced_weight_gives_back_its_file_pages_and_its_neighbours_keep_theirs(tmp_path):
    """frozen_weights_in's release (drop_file_pages): the fp32 pages of a converted weight leave the RSS at once,
    not when the last weight is converted; the rest of the mapping stays resident, and the file still reads the same
    (the pages come back from the file)."""
    import mmap

    from frugaltune.training.methods import _file_mappings, drop_file_pages

    path = tmp_path / "weights.safetensors"
    values = torch.arange(2 * 1024 * 1024, dtype=torch.float32)  # two 4 MiB tensors side by side
    path.write_bytes(values.numpy().tobytes())
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    whole = torch.frombuffer(mapped, dtype=torch.float32)
    first, second = whole[: 1024 * 1024], whole[1024 * 1024:]
    assert whole.sum().item() == values.sum().item()  # every page read: resident
    before = _mapping_rss_kb(path)
    assert before >= 8 * 1024 - 8
    drop_file_pages(first, _file_mappings())
    after = _mapping_rss_kb(path)
    assert before - after >= 4 * 1024 - 8 and after >= 4 * 1024 - 8  # first's pages gone, second's kept
    drop_file_pages(torch.zeros(1024 * 1024), _file_mappings())  # a tensor outside any mapping: nothing happens
    assert _mapping_rss_kb(path) == after
    assert torch.equal(first, values[: 1024 * 1024]) and torch.equal(second, values[1024 * 1024:])
    del whole, first, second


def test_frozen_weights_leave_a_head_tied_to_the_embeddings_alone(tiny_model_dir, smol_tokenizer):
    """A causal LM's head shares the embedding matrix: storing it in bf16 would make the residual stream bf16."""
    model = prepare_model(tiny_model_dir, [], smol_tokenizer.pad_token_id, 0, method_named("lora"), MethodKnobs(r=4, alpha=8),
                          bf16=True, task="causal_lm")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert any(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 for m in model.modules())
    assert frozen_weights_in(model, torch.bfloat16) == 0  # already done; the tied head is never converted
