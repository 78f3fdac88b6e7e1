"""Batching, the LoRA training loop on a tiny random llama, prediction, metrics."""

import numpy as np
import pytest
import torch

from frugaltune.metrics import classification_metrics
from frugaltune.models import load_for_classification, load_tokenizer
from frugaltune.classify import classify, collate, sorted_batches
from frugaltune.training.batching import length_grouped_batches
from frugaltune.training.loop import DivergenceError, LoopConfig, count_parameters, plan_steps, train_classifier
from frugaltune.training.methods import apply_lora
from frugaltune.training.optimizer import param_groups
from frugaltune.methods import get as method_named

LABELS = ["negative", "positive"]


def toy_task(tokenizer, n=64):
    """Separable on purpose: the label is in the words, so a few steps must lower the loss."""
    texts, labels = [], []
    for i in range(n):
        positive = i % 2 == 0
        word = "wonderful great lovely" if positive else "awful terrible horrid"
        texts.append(f"{word} {'!' * (i % 7)} day number {i}")
        labels.append(int(positive))
    return tokenizer(texts)["input_ids"], labels


def test_collate_pads_right_to_batch_max():
    batch = collate([[5, 6, 7], [8]], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_length_grouped_batches_cover_every_index_once_and_group_lengths():
    lengths = list(np.random.default_rng(0).integers(1, 100, size=500))
    batches = length_grouped_batches(lengths, 16, torch.Generator().manual_seed(0))
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(500))
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    random = length_grouped_batches(lengths, 16, torch.Generator().manual_seed(0), group_by_length=False)
    padded_random = sum(len(b) * max(lengths[i] for i in b) for b in random)
    assert padded < 0.8 * padded_random  # grouping removes most padding
    again = length_grouped_batches(lengths, 16, torch.Generator().manual_seed(0))
    assert again == batches  # seeded


def test_sorted_batches_longest_first():
    assert sorted_batches([1, 5, 3], 2) == [[1, 2], [0]]


def test_plan_steps_counts_accumulation_and_epochs():
    assert plan_steps(100, LoopConfig.build(lr=1e-3, batch_size=10, grad_accum=2, epochs=1)) == 5
    assert plan_steps(100, LoopConfig.build(lr=1e-3, batch_size=10, epochs=2.5)) == 25
    assert plan_steps(100, LoopConfig.build(lr=1e-3, batch_size=10, max_steps=3)) == 3


def test_loop_config_is_built_by_its_one_builder_only():
    """Every LoopConfig in the library, stages, flows and benchmarks comes from `LoopConfig.build` (through
    training.setup.loop_config or federated.local.client_loop): none is assembled by hand, so a setting added to
    the loop reaches every caller the same way."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    builder = root / "frugaltune" / "training" / "loop_config.py"
    kinds = {"LoopConfig", "Optimization", "Batching", "Checkpoints", "Speed", "Reporting"}
    by_hand = []
    for folder in ("frugaltune", "stages", "flows", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            if path == builder:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    if name in kinds:
                        by_hand.append(f"{path.relative_to(root)}:{node.lineno} {name}(...)")
    assert not by_hand, "built by hand, not by LoopConfig.build: " + "; ".join(by_hand)


def test_loop_config_groups_its_settings_and_round_trips_its_serialized_form(tmp_path):
    """Each setting lands in its group; `to_dict` names every setting once, and `build` takes that form back after
    JSON (what the calibration's process receives) to an equal LoopConfig; an unknown setting is refused by name."""
    import dataclasses
    import json

    cfg = LoopConfig.build(lr=2e-3, head_lr=4e-3, weight_decay=0.01, batch_size=12, micro_batch_size=4,
                           micro_batch_tokens=96, max_steps=30, checkpoint_dir=tmp_path, checkpoint_every=5,
                           resume=False, bf16=True, eager_attention_max_len=64, fused_optimizer=False,
                           log_every=3, head_names=("score", "lm_head"), seed=7)
    assert (cfg.optim.lr, cfg.optim.head_names, cfg.batching.micro_batch_tokens, cfg.checkpoints.checkpoint_dir,
            cfg.speed.bf16, cfg.speed.fused_optimizer, cfg.reporting.log_every, cfg.seed) == (
        2e-3, ("score", "lm_head"), 96, tmp_path, True, False, 3, 7)
    serialized = cfg.to_dict()
    groups = [f.name for f in dataclasses.fields(LoopConfig) if f.name != "seed"]
    names = [f.name for group in groups for f in dataclasses.fields(getattr(cfg, group))] + ["seed"]
    assert sorted(serialized) == sorted(names) and len(set(names)) == len(names)
    again = LoopConfig.build(**json.loads(json.dumps(serialized)))
    assert again == cfg and isinstance(again.checkpoints.checkpoint_dir, type(tmp_path))
    assert LoopConfig.build(lr=1e-3) == LoopConfig.build(**LoopConfig.build(lr=1e-3).to_dict())
    with pytest.raises(TypeError, match="no setting learning_rate"):
        LoopConfig.build(lr=1e-3, learning_rate=1e-3)


def test_lora_training_lowers_the_loss_and_trains_only_adapters_and_head(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_for_classification(tiny_model_dir, LABELS, tokenizer.pad_token_id, seed=0)
    model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainable, total = count_parameters(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n or "score" in n for n in names) and trainable < total
    ids, labels = toy_task(tokenizer)
    cfg = LoopConfig.build(lr=5e-3, head_lr=5e-2, batch_size=8, epochs=6, log_every=4, seed=0, warmup_ratio=0.0)
    result = train_classifier(model, ids, labels, cfg, tokenizer.pad_token_id, progress=False)
    assert result.steps == 48 and result.sequences == 6 * 64
    assert result.tokens == 6 * sum(len(i) for i in ids)
    assert result.history[-1]["loss"] < 0.5 * result.history[0]["loss"]
    predictions = classify(model, ids, tokenizer.pad_token_id, batch_size=16).predictions
    assert (predictions == np.array(labels)).mean() > 0.9


def test_same_seed_same_losses(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids, labels = toy_task(tokenizer, 32)
    runs = []
    for _ in range(2):
        model = apply_lora(load_for_classification(tiny_model_dir, LABELS, tokenizer.pad_token_id, seed=3),
                           4, 8, 0.1, ["q_proj"])
        cfg = LoopConfig.build(lr=1e-2, batch_size=8, max_steps=6, log_every=2, seed=3)
        runs.append([h["loss"] for h in train_classifier(model, ids, labels, cfg, tokenizer.pad_token_id,
                                                         progress=False).history])
    torch.testing.assert_close(runs[0], runs[1])


def test_divergence_stops_with_the_step(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_for_classification(tiny_model_dir, LABELS, tokenizer.pad_token_id, seed=0)
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))
    ids, labels = toy_task(tokenizer, 16)
    with pytest.raises(DivergenceError, match="at step 1"):
        train_classifier(model, ids, labels, LoopConfig.build(lr=1e-3, batch_size=8), tokenizer.pad_token_id,
                         progress=False)


def test_training_into_a_log_prints_progress_lines_at_its_cadence_and_no_bar(tiny_model_dir, capsys):
    """Output into a file or a pipe (pytest's capture: not a terminal): a line every `progress_every_s` seconds with
    the step, loss, tokens/s and ETA, and no bar's `\r` redraws; at the default 30 s a run of seconds prints none."""
    import re

    tokenizer = load_tokenizer(tiny_model_dir)
    ids, labels = toy_task(tokenizer, 32)
    printed = {}
    for every_s in (0.0, 30.0):  # 0: a line after every step
        model = _fresh(tiny_model_dir, tokenizer)
        capsys.readouterr()  # the loop's output alone (loading the weights draws transformers' bar)
        train_classifier(model, ids, labels, LoopConfig.build(lr=1e-3, batch_size=8, progress_every_s=every_s),
                         tokenizer.pad_token_id)
        out, err = capsys.readouterr()
        assert "\r" not in out + err and "train" not in err, err
        printed[every_s] = [line for line in out.splitlines() if line.startswith("train: step ")]
    line = re.compile(r"train: step (\d)/4 \(\d+%\), loss \d+\.\d{4}, \d+ tokens/s, \d+ s in, ETA \d+ s$")
    assert [int(line.match(text).group(1)) for text in printed[0.0]] == [1, 2, 3, 4], printed
    assert printed[30.0] == []


def test_last_layers_adapts_only_the_top_layers_and_the_ones_below_run_forward_only(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_for_classification(tiny_model_dir, LABELS, tokenizer.pad_token_id, seed=0)
    layers = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"train.lora.last_layers: {layers + 1} but the model has {layers}"):
        apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"], last_layers=layers + 1)
    model = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"], last_layers=1)
    adapted = {n.split(".layers.")[1].split(".")[0] for n, p in model.named_parameters()
               if p.requires_grad and "lora_" in n}
    assert adapted == {str(layers - 1)}
    decoder = model.base_model.model.model.layers
    seen = {}
    for index in (0, layers - 1):
        decoder[index].register_forward_hook(
            lambda module, args, out, index=index: seen.__setitem__(index, (out[0] if isinstance(out, tuple)
                                                                             else out).requires_grad))
    ids, labels = toy_task(tokenizer, 8)
    cfg = LoopConfig.build(lr=1e-2, batch_size=8, max_steps=1, seed=0)
    train_classifier(model, ids, labels, cfg, tokenizer.pad_token_id, progress=False)
    # nothing below the adapted layer needs a gradient: autograd records no backward for it
    assert seen == {0: False, layers - 1: True}


def test_lora_plus_gives_b_its_own_rate_and_leaves_a_and_the_head_alone(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    model = apply_lora(load_for_classification(tiny_model_dir, LABELS, tokenizer.pad_token_id, seed=0),
                       4, 8, 0.0, ["q_proj", "v_proj"])
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, LoopConfig.build(lr=1e-3, head_lr=5e-3, lora_plus_ratio=16).optim)
    assert [g["lr"] for g in groups] == [1e-3, pytest.approx(1.6e-2), 5e-3]
    assert [names[id(p)] for p in groups[2]["params"]] == ["base_model.model.score.modules_to_save.default.weight"]
    a_names = [names[id(p)] for p in groups[0]["params"]]
    b_names = [names[id(p)] for p in groups[1]["params"]]
    assert a_names and all(".lora_A." in n for n in a_names)
    assert b_names and all(".lora_B." in n for n in b_names) and len(a_names) == len(b_names)
    plain = param_groups(model, LoopConfig.build(lr=1e-3, head_lr=5e-3).optim)
    assert [g["lr"] for g in plain] == [1e-3, 5e-3]


def test_classification_metrics():
    m = classification_metrics(np.array([0, 0, 1, 1]), np.array([0, 1, 1, 1]), ["a", "b"])
    assert m["accuracy"] == 0.75
    assert m["confusion_matrix"] == [[1, 1], [0, 2]]
    assert m["per_class"]["a"]["precision"] == 1.0 and m["per_class"]["b"]["recall"] == 1.0
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.8) / 2, abs=1e-6)


def _fresh(tiny_model_dir, tokenizer, dropout=0.1):
    return apply_lora(load_for_classification(tiny_model_dir, LABELS, tokenizer.pad_token_id, seed=5),
                      4, 8, dropout, ["q_proj", "v_proj"])


def test_sigterm_checkpoints_and_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    import os
    import signal

    from frugaltune.training.signals import TrainingInterrupted

    tokenizer = load_tokenizer(tiny_model_dir)
    ids, labels = toy_task(tokenizer, 48)
    base = dict(lr=1e-2, batch_size=8, epochs=3, log_every=2, seed=5, checkpoint_every=4)
    full = train_classifier(_fresh(tiny_model_dir, tokenizer), ids, labels,
                            LoopConfig.build(**base, checkpoint_dir=tmp_path / "a"), tokenizer.pad_token_id,
                            progress=False)

    def kill_at_step_7(record):
        if record["step"] == 6:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingInterrupted, match=r"SIGTERM at step \d+ of 18.*step-\d+.*dvc repro"):
        train_classifier(_fresh(tiny_model_dir, tokenizer), ids, labels,
                         LoopConfig.build(**base, checkpoint_dir=tmp_path / "b"), tokenizer.pad_token_id,
                         on_log=kill_at_step_7, progress=False)
    resumed = train_classifier(_fresh(tiny_model_dir, tokenizer), ids, labels,
                               LoopConfig.build(**base, checkpoint_dir=tmp_path / "b"), tokenizer.pad_token_id,
                               progress=False)
    assert resumed.resumed_from_step == 6
    assert abs(resumed.final_loss - full.final_loss) < 1e-4
    assert [h["step"] for h in resumed.history] == [h["step"] for h in full.history]
    assert resumed.tokens == full.tokens


def test_truncated_checkpoint_is_skipped_with_a_warning(tiny_model_dir, tmp_path):
    from frugaltune.training import checkpoint

    tokenizer = load_tokenizer(tiny_model_dir)
    ids, labels = toy_task(tokenizer, 32)
    cfg = LoopConfig.build(lr=1e-2, batch_size=8, max_steps=9, seed=1, checkpoint_every=3, keep_checkpoints=5,
                           checkpoint_dir=tmp_path)
    train_classifier(_fresh(tiny_model_dir, tokenizer), ids, labels, cfg, tokenizer.pad_token_id, progress=False)
    steps = [c.step for c in checkpoint.list_checkpoints(tmp_path)]
    assert steps == [3, 6]
    newest = tmp_path / "step-6" / "trainable.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-6: trainable.safetensors does not match"):
        found = checkpoint.latest_complete(tmp_path)
    assert found.step == 3
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        result = train_classifier(_fresh(tiny_model_dir, tokenizer), ids, labels, cfg, tokenizer.pad_token_id,
                                  progress=False)
    assert result.resumed_from_step == 3


def test_injected_oom_halves_micro_batch_and_keeps_the_effective_batch(tiny_model_dir, monkeypatch):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids, labels = toy_task(tokenizer, 32)
    cfg = LoopConfig.build(lr=1e-2, batch_size=8, max_steps=4, seed=2, log_every=1)
    # No dropout: chunks draw different dropout masks than whole batches, which is not what is tested here.
    clean = train_classifier(_fresh(tiny_model_dir, tokenizer, 0.0), ids, labels, cfg, tokenizer.pad_token_id,
                             progress=False)
    monkeypatch.setenv("FRUGALTUNE_TEST_OOM_AT_STEPS", "2")
    halved = train_classifier(_fresh(tiny_model_dir, tokenizer, 0.0), ids, labels, cfg, tokenizer.pad_token_id,
                              progress=False)
    assert halved.micro_batch_size == 4
    assert any("micro-batch 8 -> 4, gradient accumulation 1 -> 2 (effective batch 8 unchanged)" in e
               for e in halved.events)
    assert halved.sequences == clean.sequences == 32
    # Same data and effective batch: the losses agree up to float summation order.
    torch.testing.assert_close([h["loss"] for h in halved.history], [h["loss"] for h in clean.history],
                               rtol=1e-4, atol=1e-4)


def test_oom_at_batch_one_fails_clearly(tiny_model_dir, monkeypatch):
    from frugaltune.training.oom import OutOfMemoryAtBatchOne

    tokenizer = load_tokenizer(tiny_model_dir)
    ids, labels = toy_task(tokenizer, 8)
    monkeypatch.setenv("FRUGALTUNE_TEST_OOM_AT_STEPS", "1")
    cfg = LoopConfig.build(lr=1e-2, batch_size=1, max_steps=2, seed=2)
    with pytest.raises(OutOfMemoryAtBatchOne, match="one sequence per micro-batch"):
        train_classifier(_fresh(tiny_model_dir, tokenizer), ids, labels, cfg, tokenizer.pad_token_id,
                         progress=False)


@pytest.mark.parametrize("method", ["none", "full", "lora", "dora", "prelayer", "qlora"])
def test_every_method_trains_what_it_should_and_reloads_identically(method, tiny_model_dir, tmp_path):
    from frugaltune.models import qlora_quantization
    from frugaltune.training.methods import freeze_for, load_trained, prepare_qlora, save_trained

    tokenizer = load_tokenizer(tiny_model_dir)
    pad = tokenizer.pad_token_id
    if method == "qlora":
        model = load_for_classification(tiny_model_dir, LABELS, pad, seed=0,
                                        quantization_config=qlora_quantization())
        model = prepare_qlora(model, 4, 8, 0.0, ["q_proj", "v_proj"])
        assert any("Linear4bit" in type(m).__name__ for m in model.modules())
    elif method in ("lora", "dora"):
        model = apply_lora(load_for_classification(tiny_model_dir, LABELS, pad, seed=0), 4, 8, 0.0,
                           ["q_proj", "v_proj"], use_dora=method == "dora")
    else:
        model = freeze_for(method_named(method), load_for_classification(tiny_model_dir, LABELS, pad, seed=0))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if method == "none":
        assert not trainable
    elif method == "full":
        assert trainable == {n for n, _ in model.named_parameters()}
    elif method == "prelayer":
        assert trainable == {"model.embed_tokens.weight", "score.weight"}
    else:
        assert trainable and all("lora_" in n or "score" in n for n in trainable)
        if method == "dora":
            assert any("lora_magnitude_vector" in n for n in trainable)
    ids, labels = toy_task(tokenizer, 16)
    if method != "none":
        train_classifier(model, ids, labels, LoopConfig.build(lr=1e-3, batch_size=8, max_steps=2, seed=0), pad,
                         progress=False)
    save_trained(model, method_named(method), tmp_path)
    expected = classify(model, ids, pad).predictions if method != "qlora" else None
    reloaded = load_trained(load_for_classification(tiny_model_dir, LABELS, pad, seed=99), tmp_path)
    got = classify(reloaded, ids, pad).predictions
    if expected is not None:  # qlora's adapter is applied to the full-precision base, so outputs differ slightly
        np.testing.assert_array_equal(got, expected)


def test_qlora_releases_the_safetensors_mapping_so_the_fp32_file_is_not_resident(tiny_model_dir):
    # transformers loads zero-copy from an mmap of model.safetensors; while one unquantized tensor aliases it,
    # every page that quantization read stays in RSS next to the 4-bit copy
    from frugaltune.models import qlora_quantization
    from frugaltune.training.methods import prepare_qlora

    pad = load_tokenizer(tiny_model_dir).pad_token_id
    model = prepare_qlora(load_for_classification(tiny_model_dir, LABELS, pad, seed=0,
                                                  quantization_config=qlora_quantization()), 4, 8, 0.0, ["q_proj"])
    spans = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) > 5 and fields[5].endswith("model.safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu"]
    aliased = [t.shape for t in tensors if any(a <= t.data_ptr() < b for a, b in spans)]
    assert not aliased
    assert any(type(p).__name__ == "Params4bit" for p in model.parameters())


def test_a_4bit_load_never_maps_the_checkpoint_and_quantizes_the_same_weights(tiny_model_dir):
    """QLoRA's load reads the checkpoint with pread (frugaltune.models._from_pretrained): under transformers' mmap
    every shard page it read stayed mapped until the load ended, so a 1.7 B fp32 checkpoint counted 6.5 GiB in the
    peak RSS of a run planned under 4 GiB. A thread watches /proc/self/maps for the whole load; the 4-bit weights
    are those of transformers' own (mmap) load of the same files."""
    import threading

    from transformers import AutoModelForSequenceClassification

    from frugaltune.models import qlora_quantization

    pad = load_tokenizer(tiny_model_dir).pad_token_id

    def mapped() -> set[str]:  # the address ranges mapping a safetensors file
        return {line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith(".safetensors")}

    before = mapped()  # models of earlier tests in this process may still hold their (unquantized) mappings
    seen, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            seen.update(mapped() - before)
            done.wait(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        model = load_for_classification(tiny_model_dir, LABELS, pad, seed=0, quantization_config=qlora_quantization())
    finally:
        done.set()
        watcher.join()
    assert not seen, sorted(seen)[:2]
    reference = AutoModelForSequenceClassification.from_pretrained(
        str(tiny_model_dir), num_labels=len(LABELS), quantization_config=qlora_quantization())
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    packed = [name for name, param in ours.items() if type(param).__name__ == "Params4bit"]
    assert packed and all(torch.equal(ours[name].data, theirs[name].data) for name in packed)
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])


def test_checkpoint_rng_state_round_trips_through_weights_only_loading_and_pickles_are_refused(tmp_path):
    """Checkpoint files load with torch.load(weights_only=True): data, never code (the fault table's security row)."""
    import pickle
    import random

    import numpy as np

    from frugaltune.training import checkpoint

    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.standard_normal(4), [random.random() for _ in range(3)])
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.standard_normal(4), expected[1])
    assert [random.random() for _ in range(3)] == expected[2]

    class RunsCode:
        def __reduce__(self):
            return (print, ("this would run on load",))

    (tmp_path / "evil").mkdir()
    with open(tmp_path / "evil" / "optim.pt", "wb") as fh:
        pickle.dump({"optimizer": RunsCode()}, fh)
    with pytest.raises(checkpoint.CheckpointRefused, match="optim.pt: holds objects other than tensors"):
        checkpoint._load_tensors_only(tmp_path / "evil" / "optim.pt")
