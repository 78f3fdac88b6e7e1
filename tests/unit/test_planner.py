"""The planner: exact shapes on the meta device, the memory model, the run's batches, calibration, the fit check."""

import json
import math
import re

import pytest
import torch
from transformers import LlamaConfig

from frugaltune.methods import METHODS, get as method_named
from frugaltune.planner.assembly import HEADROOM, PlanError, RunSpec, check_fits, common_prompt_prefix, make_plan
from frugaltune.planner.calibration import calibrate, fit_memory
from frugaltune.planner.machine import decide_machine, keep_sdpa_off_cudnn, measured_on
from frugaltune.planner.measure import _SavedBytes, _cpu_share
from frugaltune.planner.memory import (CPU_RUNTIME_BYTES, CUDA_CONTEXT_BYTES, Constants, MethodKnobs, ModelShape,
                                       activation_bytes_per_token, memory_estimate, model_shape, planned_batches,
                                       planned_order, weight_bytes)
from frugaltune.planner.render import render
from frugaltune.models import load_tokenizer
from frugaltune.training.loop import LoopConfig, _EpochOrder, plan_steps, train_classifier
from frugaltune.training.methods import prepare_model

LABELS = ["negative", "neutral", "positive"]
GiB, MiB = 2**30, 2**20


def smollm2_config() -> LlamaConfig:
    """SmolLM2-135M's shapes (the default model), built on the meta device only: no weights are read."""
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                       max_position_embeddings=8192, pad_token_id=2)


def cpu_hardware(ram_gb: float = 24.0) -> dict:
    return {"cpu": {"model": "test CPU", "physical_cores": 2, "flags": {"avx512_bf16": True, "amx_bf16": False}},
            "memory": {"total_bytes": int(ram_gb * GiB), "cgroup_limit_bytes": None}, "gpus": [],
            "gpu_note": "no NVIDIA GPU: test"}


def run_spec(method="lora", lengths=(30,) * 64 + (128,) * 16, **kw) -> RunSpec:
    base = dict(method=method, batch_size=16, grad_accum=1, epochs=1.0, max_steps=None, seq_len=128,
                lengths=tuple(lengths), seed=42)
    return RunSpec(**{**base, **kw})


def shapes(config, methods=("none", "full", "lora", "qlora", "prelayer", "dora")):
    return {m: model_shape(config, len(LABELS), m) for m in methods}


# every method of the registry but one on a 4-bit base, whose packed weights count half their values in numel()
@pytest.mark.parametrize("method", [name for name, m in METHODS.items() if not m.quantized_base])
def test_meta_shapes_count_exactly_what_the_real_model_trains(method, tiny_model_dir):
    """The meta-device count equals the count of the real model wrapped by the same method code."""
    tokenizer = load_tokenizer(tiny_model_dir)
    knobs = MethodKnobs(r=4, target_modules=("q_proj", "v_proj"))
    shape = model_shape(tiny_model_dir, len(LABELS), method, knobs)
    model = prepare_model(tiny_model_dir, LABELS, tokenizer.pad_token_id, 0, method_named(method), knobs)
    assert shape.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.total_params == sum(p.numel() for p in model.parameters())


def test_smollm2_shapes_match_the_default_run_reports():
    """What reports/train.json recorded for the default LoRA run: 923,328 trainable of 135,440,064 on q/k/v/o (until
    2026-11-28), 2,443,968 of 136,960,704 on all seven linear layers (the default since)."""
    shape = model_shape(smollm2_config(), 3, "lora")
    assert (shape.trainable_params, shape.total_params) == (923_328, 135_440_064)
    seven = MethodKnobs(target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                        "down_proj"))
    shape = model_shape(smollm2_config(), 3, "lora", seven)
    assert (shape.trainable_params, shape.total_params) == (2_443_968, 136_960_704)


def test_memory_model_orders_qlora_below_lora_below_full_and_checkpointing_saves_activations():
    config = smollm2_config()
    peak = {m: memory_estimate(s, m, bf16=False, micro_batch=16, seq_len=128, gradient_checkpointing=False)
            for m, s in shapes(config, ("full", "lora", "qlora")).items()}
    assert peak["qlora"]["weights"] < 0.35 * peak["full"]["weights"]  # fp32 embeddings stay
    assert peak["lora"]["weights"] == pytest.approx(peak["full"]["weights"], rel=0.01)  # + the adapters
    assert peak["qlora"]["peak"] < peak["lora"]["peak"] < peak["full"]["peak"]
    # full: gradients + AdamW states = 3x the weights on top of them
    assert peak["full"]["gradients"] + peak["full"]["optimizer"] == 3 * peak["full"]["weights"]
    lora = shapes(config, ("lora",))["lora"]
    ckpt = memory_estimate(lora, "lora", bf16=False, micro_batch=16, seq_len=128, gradient_checkpointing=True)
    bf16 = memory_estimate(lora, "lora", bf16=True, micro_batch=16, seq_len=128, gradient_checkpointing=False)
    assert ckpt["activations"] < peak["lora"]["activations"] / 5
    assert bf16["activations"] < peak["lora"]["activations"]


def test_gradients_of_a_part_alone_in_its_step_overlap_the_activations_backward_frees():
    """Backward frees each layer's saved tensors as it allocates that layer's weight gradients: a part alone in its
    optimizer step peaks at the larger of the two; a part after another of its step (accumulation) at their sum."""
    full = shapes(smollm2_config(), ("full",))["full"]
    kw = dict(bf16=False, seq_len=64, gradient_checkpointing=False)
    for micro in (16, 1):  # activations above the gradients, then below them
        summed = memory_estimate(full, "full", micro_batch=micro, **kw)
        alone = memory_estimate(full, "full", micro_batch=micro, gradients_overlap=True, **kw)
        held = summed["activations"] + summed["logits"]
        assert alone["peak"] == summed["peak"] - min(summed["gradients"], held)
        assert alone["peak"] - summed["runtime"] - summed["weights"] - summed["optimizer"] == max(
            held, summed["gradients"])
    # The plan: 16 rows of 64 alone in their step, whose activations outweigh the gradients; under a 512-token cap
    # the same batch runs as two parts of 8, the second with all of the step's gradients allocated.
    lengths = [64] * 32
    alone = make_plan(run_spec("full", lengths=lengths, micro_batch_tokens=1024), cpu_hardware(24),
                      shapes(smollm2_config()), Constants())["methods"]["full"]
    split = make_plan(run_spec("full", lengths=lengths, micro_batch_tokens=512), cpu_hardware(24),
                      shapes(smollm2_config()), Constants())["methods"]["full"]
    assert alone["largest_batch"] == {"sequences": 16, "length": 64}
    assert split["largest_batch"] == {"sequences": 8, "length": 64}
    assert alone["components_mb"]["gradients"] == 0
    assert split["components_mb"]["gradients"] == round(4 * full.trainable_params / MiB, 1)


def test_nf4_weights_are_about_an_eighth_of_fp32_for_the_linear_layers():
    shape = shapes(smollm2_config(), ("qlora",))["qlora"]
    rest = shape.total_params - shape.quantizable_params
    nf4 = weight_bytes(shape, "qlora") - 4 * rest
    assert 0.5 < nf4 / shape.quantizable_params < 0.53  # 4 bits + double-quantized block constants
    single = weight_bytes(shape, "qlora", MethodKnobs(double_quant=False)) - 4 * rest
    assert single > nf4


def test_weight_bytes_are_the_bytes_of_the_model_each_method_trains(tiny_model_dir, smol_tokenizer):
    """LoRA in bf16 keeps its frozen decoder projections in bf16 (training/fast.frozen_weights_in): counted as
    4 bytes each, the calibration's fit put the difference into the runtime, which the other methods' estimates
    then carried."""
    from frugaltune.training.methods import prepare_model

    knobs = MethodKnobs(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    for method, bf16 in (("lora", True), ("lora", False), ("full", True)):
        model = prepare_model(tiny_model_dir, ["a", "b", "c"], smol_tokenizer.pad_token_id, 0, method_named(method), knobs, bf16=bf16)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        shape = model_shape(tiny_model_dir, 3, method, knobs)
        # the projections' biases (this tiny model has some; SmolLM2 none) go to bf16 too, uncounted
        assert weight_bytes(shape, method, knobs, bf16) == pytest.approx(held, rel=1e-4), (method, bf16)


def test_planned_batches_are_the_training_loops_batches():
    lengths = [5 + (i * 37) % 120 for i in range(300)]
    cfg = LoopConfig.build(lr=1e-3, batch_size=8, grad_accum=2, epochs=1.5, seed=7)
    steps, batches = planned_batches(lengths, 8, 2, 1.5, None, 7)
    assert steps == plan_steps(len(lengths), cfg)
    order = _EpochOrder(lengths, cfg)
    expected = [(len(order[i]), max(lengths[j] for j in order[i])) for i in range(steps * 2)]
    assert batches == expected


def test_plan_keeps_the_effective_batch_and_turns_on_checkpointing_only_when_needed():
    config = smollm2_config()
    roomy = make_plan(run_spec(), cpu_hardware(24), shapes(config), Constants())
    lora = roomy["methods"]["lora"]
    assert lora["fits"] and lora["micro_batch_size"] == 16 and not lora["gradient_checkpointing"]
    tight = make_plan(run_spec(), cpu_hardware(24), shapes(config), Constants(), limit_gb=2.5)
    lora = tight["methods"]["lora"]
    assert lora["fits"] and lora["micro_batch_size"] < 16
    assert lora["micro_batch_size"] * lora["grad_accum"] == 16  # the effective batch is kept
    assert lora["predicted_peak_bytes"] <= tight["budget_bytes"]
    cramped = make_plan(run_spec(), cpu_hardware(24), shapes(config), Constants(), limit_gb=1.25)
    assert cramped["methods"]["lora"]["fits"] and cramped["methods"]["lora"]["gradient_checkpointing"]
    assert "gradient checkpointing on" in cramped["methods"]["lora"]["why"]
    assert "lora*" in render(cramped)


def test_a_shared_prompt_prefix_is_counted_once_per_batch_in_the_eta():
    ids = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50 + i, 0] for i in range(4)]
    labels = [[-100] * 11 + [0]] * 4
    assert common_prompt_prefix(ids, labels) == 10
    assert common_prompt_prefix(ids, [[-100] * 8 + [9, 10, 50, 0]] * 4) == 0  # 7 < the loop's 8
    assert common_prompt_prefix(ids[:1], labels[:1]) == 0
    constants = Constants(seconds_per_token=0.01, step_overhead_s=0.0)
    config = smollm2_config()
    whole = make_plan(run_spec(), cpu_hardware(24), shapes(config), constants)["methods"]["lora"]
    shared = make_plan(run_spec(shared_prefix=10), cpu_hardware(24), shapes(config),
                       constants)["methods"]["lora"]
    assert whole["shared_prefix"] == 0 and shared["shared_prefix"] == 10
    assert whole["padded_tokens"] - shared["padded_tokens"] == 5 * (16 - 1) * 10  # 5 batches of 16, one part each
    assert whole["eta_seconds"] - shared["eta_seconds"] == pytest.approx(5 * 15 * 10 * 0.01)
    cramped = make_plan(run_spec(shared_prefix=10), cpu_hardware(24), shapes(config), constants,
                        limit_gb=1.25)["methods"]["lora"]
    assert cramped["gradient_checkpointing"] and cramped["shared_prefix"] == 0  # checkpointing cannot share


def test_ranks_on_one_cpu_split_its_cores_and_share_its_memory():
    config = smollm2_config()
    one = make_plan(run_spec(), cpu_hardware(24), shapes(config, ("lora",)), Constants())
    two = make_plan(run_spec(ranks=2), cpu_hardware(24), shapes(config, ("lora",)), Constants())
    assert (one["threads"], two["threads"], two["ranks"]) == (2, 1, 2)
    solo, pair = one["methods"]["lora"], two["methods"]["lora"]
    # each rank computes half of each batch, and each holds its own model: the host holds both
    assert pair["largest_batch"]["sequences"] == solo["largest_batch"]["sequences"] // 2
    assert pair["predicted_peak_bytes"] < solo["predicted_peak_bytes"]
    assert pair["predicted_peak_all_ranks_mb"] == pytest.approx(2 * pair["predicted_peak_mb"], abs=1)
    # a limit one process fits in but two do not: the plan shrinks the ranks' micro-batch rather than overcommit
    limit_gb = solo["predicted_peak_bytes"] / GiB / HEADROOM * 1.01
    tight = make_plan(run_spec(ranks=2), cpu_hardware(24), shapes(config, ("lora",)), Constants(),
                      limit_gb=limit_gb)["methods"]["lora"]
    assert tight["predicted_peak_all_ranks_mb"] * MiB <= limit_gb * GiB * HEADROOM + MiB


def test_impossible_full_finetuning_is_rejected_naming_the_limit_and_a_configuration_that_fits():
    """Full fine-tuning needs weights + gradients + AdamW (~2 GiB for 135M params): a 1.5 GiB limit cannot hold it."""
    plan = make_plan(run_spec("full"), cpu_hardware(24), shapes(smollm2_config()), Constants(),
                     limit_gb=1.5)
    assert not plan["fits"] and not plan["methods"]["full"]["fits"]
    with pytest.raises(PlanError) as error:
        check_fits(plan)
    message = str(error.value)
    assert "train.method = full cannot fit" in message
    assert "1.50 GiB" in message and "probe.memory_limit_gb = 1.5" in message
    fitting = plan["methods_that_fit"]
    assert fitting and any(f"train.method: {m} fits" in message for m in fitting)
    suggested = next(m for m in fitting if f"train.method: {m} fits" in message)
    assert check_fits(plan, suggested)["fits"]


def test_nothing_fits_says_what_to_lower():
    plan = make_plan(run_spec("lora"), cpu_hardware(24), shapes(smollm2_config()), Constants(),
                     limit_gb=0.5)
    with pytest.raises(PlanError, match="no method fits: lower tokenize.max_length or train.batch_size"):
        check_fits(plan)


def test_gpu_plans_against_the_gpu_memory_with_a_cuda_context():
    hardware = {**cpu_hardware(64), "torch": {"cuda_available": True},
                "gpus": [{"name": "Fake GPU 8GB", "memory_total_bytes": 8 * GiB, "compute_capability": "8.6"}]}
    plan = make_plan(run_spec("full"), hardware, shapes(smollm2_config(), ("full",)), Constants())
    assert plan["device"]["kind"] == "cuda" and plan["memory_limit_bytes"] == 8 * GiB
    assert plan["precision"] == "bf16" and plan["gpus_note"] is None
    turing = {**hardware, "gpus": [{**hardware["gpus"][0], "compute_capability": "7.5"}]}
    assert make_plan(run_spec("full"), turing, shapes(smollm2_config(), ("full",)),
                     Constants())["precision"] == "fp32"
    # A GPU that this torch build cannot drive (CPU wheel) trains on the CPU: its capability decides nothing.
    undriven = {**hardware, "torch": {"cuda_available": False}}
    assert "not measured" in make_plan(run_spec("full"), undriven, shapes(smollm2_config(), ("full",)),
                                       Constants())["precision_why"]
    assert plan["methods"]["full"]["components_mb"]["runtime"] >= (CPU_RUNTIME_BYTES
                                                                   + CUDA_CONTEXT_BYTES) / 2**20 - 1


def test_cpu_precision_follows_this_machines_measurement_never_its_flags():
    """The same flags (avx512_bf16, no AMX) measured 0.7x fp32 on one Xeon and 2.3x on a Zen 4."""
    hardware = cpu_hardware()
    unmeasured = make_plan(run_spec(), hardware, shapes(smollm2_config(), ("lora",)), Constants())
    assert unmeasured["precision"] == "fp32" and "not measured" in unmeasured["precision_why"]
    assert "no NVIDIA GPU" in unmeasured["gpus_note"]
    for preferred in ("bf16", "fp32"):
        measured = {"preferred_precision": preferred, "reason": "measured", "cpu_model": hardware["cpu"]["model"]}
        plan = make_plan(run_spec(), hardware, shapes(smollm2_config(), ("lora",)), Constants(),
                         measured_precision=measured_on(hardware, {"cpu": measured}))
        assert plan["precision"] == plan["run"]["precision"] == plan["methods"]["lora"]["precision"] == preferred
    other = {"cpu": {"preferred_precision": "bf16", "reason": "x", "cpu_model": "another CPU"}}
    assert measured_on(hardware, other) is None


def train_tiny_lora(model_dir, tokenizer, ids, labels, **loop):
    """A rank-4 LoRA without dropout (no masks drawn per part) on the tiny model, batches of 8, seed 1."""
    model = prepare_model(model_dir, LABELS, tokenizer.pad_token_id, 0, method_named("lora"), MethodKnobs(r=4, dropout=0.0))
    return train_classifier(model, ids, labels, LoopConfig.build(lr=1e-2, batch_size=8, seed=1, log_every=1, **loop),
                            tokenizer.pad_token_id, progress=False)


def test_split_micro_batches_compute_the_same_training(tiny_model_dir):
    """micro_batch_size < batch_size: each batch runs in parts and accumulates; same losses, same data."""
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = [tokenizer(f"text number {i} {'!' * (i % 5)}")["input_ids"] for i in range(32)]
    labels = [i % 3 for i in range(32)]
    whole, parts = (train_tiny_lora(tiny_model_dir, tokenizer, ids, labels, max_steps=3, micro_batch_size=micro)
                    for micro in (None, 2))
    assert parts.micro_batch_size == 2 and whole.micro_batch_size == 8
    assert parts.micro_batches == 4 * whole.micro_batches
    torch.testing.assert_close([h["loss"] for h in parts.history], [h["loss"] for h in whole.history],
                               rtol=1e-4, atol=1e-4)


def test_a_token_cap_splits_only_the_wide_batches_and_computes_the_same_training(tiny_model_dir):
    """micro_batch_tokens: a batch whose rows x longest row exceed the cap runs in equal parts; narrow ones whole."""
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = [tokenizer(f"text number {i}" + " word" * (40 if i < 8 else 0))["input_ids"] for i in range(32)]
    labels = [i % 3 for i in range(32)]
    wide, narrow = max(len(x) for x in ids[:8]), max(len(x) for x in ids[8:])
    cap = max(8 * narrow, 2 * wide)  # a batch of 8 short rows fits; the 8 long rows take 2-4 parts

    whole, capped = (train_tiny_lora(tiny_model_dir, tokenizer, ids, labels, epochs=1, micro_batch_tokens=tokens)
                     for tokens in (None, cap))
    assert whole.micro_batches == 4
    parts = math.ceil(8 / (cap // wide))
    assert parts > 1 and capped.micro_batches == 3 + parts  # length grouping keeps the long rows in one batch
    torch.testing.assert_close([h["loss"] for h in capped.history], [h["loss"] for h in whole.history],
                               rtol=1e-4, atol=1e-4)


def test_gradient_checkpointing_gives_the_same_loss(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    batch = tokenizer(["a short one", "a somewhat longer sentence here"], padding=True, return_tensors="pt")
    target = torch.tensor([0, 2])
    losses, grads = [], []
    for ckpt in (False, True):
        model = prepare_model(tiny_model_dir, LABELS, tokenizer.pad_token_id, 0, method_named("lora"),
                              MethodKnobs(r=4, dropout=0.0), gradient_checkpointing=ckpt)
        model.train()
        loss = model(**batch, labels=target).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_a_pick_the_measured_memory_moved_is_calibrated_again_at_its_micro_batch(tmp_path, monkeypatch,
                                                                               tiny_model_dir):
    """The plan calibrates at its analytic pick; where the calibrated memory moves the pick to another micro-batch
    (the scale ladder: SmolLM2-1.7B QLoRA at 4 GiB calibrated at 1, trained at 2, ETA +43 %), `at_the_pick` times
    the run again at the new micro-batch, since a step's fixed cost per micro-batch does not scale with its tokens.
    An unmoved pick is left as it is, with no second calibration."""
    from functools import partial

    from frugaltune.config import load_params
    from frugaltune.planner.recalibration import at_the_pick, calibrate_at, pooled_memory
    from tests import tiny_project

    monkeypatch.chdir(tmp_path)
    tiny_project.plan_inputs(tmp_path, tiny_model_dir, LABELS,
                             "train: {batch_size: 8, method: lora, threads: 1}\nprobe: {nvml: false}\n")
    params = load_params(tmp_path / "params.yaml")
    lengths = [8 + (i * 7) % 25 for i in range(64)]
    rows = [[5 + j % 50 for j in range(n)] for n in lengths]
    steps, order = planned_order(lengths, 8, 1, 1.0, None, seed=0)
    decided = {"bf16": False, "eager_attention_max_len": 0, "int8": {}, "threads": 1}
    timed = partial(calibrate_at, params, "lora", decided, tiny_model_dir, LABELS,
                    load_tokenizer(tiny_model_dir).pad_token_id, {}, model_shape(tiny_model_dir, 3, "lora"), rows,
                    [i % 3 for i in range(64)], order, stop_when_busy=False)  # make test runs two workers

    def entry(micro: int) -> dict:
        return {"micro_batch_size": micro, "gradient_checkpointing": False, "fits": True, "steps": steps,
                "padded_tokens": sum(lengths)}

    def replan(constants, calibration):
        return {"methods": {"lora": entry(8)}, "constants": constants, "calibration": calibration}

    constants, first = timed(entry(2), [], None, {})
    lines = []
    unmoved = {"methods": {"lora": entry(2)}}
    assert at_the_pick(unmoved, "lora", entry(2), constants, first, timed, replan, lines.append) is unmoved
    assert not lines
    ran = []
    plan = at_the_pick({"methods": {"lora": entry(8)}}, "lora", entry(2), constants, first,
                       lambda *a: ran.append(timed(*a)) or ran[-1], replan, lines.append)
    second = plan["calibration"]
    assert "calibrating lora again at the pick" in lines[0]
    assert second["first"] == {"micro_batch_size": 2, "gradient_checkpointing": False, "seconds": first["seconds"]}
    assert second["seconds"] > first["seconds"]
    # its steps ran parts of 8 rows, not 2
    assert max(s["part_tokens"] for s in second["steps"]) > max(s["part_tokens"] for s in first["steps"])
    assert plan["constants"].seconds_per_token > 0 and plan["constants"] is not constants
    # the run's memory is fitted through both calibrations' peaks (where they grow with the tokens), not the
    # second's alone: that one, read within one micro-batch, can move the pick past what the first measured
    forward = pooled_memory(constants, first["memory_points"], ran[0][0], ran[0][1]["memory_points"])
    assert ("memory_from" in second) == bool(forward)
    own = forward or {"activation_scale": ran[0][0].activation_scale, "runtime_bytes": ran[0][0].runtime_bytes}
    assert (plan["constants"].activation_scale, plan["constants"].runtime_bytes) == (
        own["activation_scale"], own["runtime_bytes"])
    # the memory measured at the new pick sends it back (it did not fit there): the run is the first calibration's
    # micro-batch, and so is its time; the memory is the second's

    def back_to_2(constants, calibration):
        return {"methods": {"lora": entry(2)}, "constants": constants, "calibration": calibration}

    seen = []
    back = at_the_pick({"methods": {"lora": entry(8)}}, "lora", entry(2), constants, first,
                       lambda *a: seen.append(timed(*a)) or seen[-1], back_to_2, lines.append)
    assert back["calibration"]["timed_at"] == "first" and "does not fit as measured" in lines[-1]
    assert (back["constants"].seconds_per_token, back["constants"].step_overhead_s) == (
        constants.seconds_per_token, constants.step_overhead_s)
    # and its memory through both calibrations' peaks where they grow with the tokens (a tiny model's may not)
    pooled = pooled_memory(constants, first["memory_points"], seen[0][0], seen[0][1]["memory_points"])
    assert ("memory_from" in back["calibration"]) == bool(pooled)
    own = pooled or {"activation_scale": seen[0][0].activation_scale, "runtime_bytes": seen[0][0].runtime_bytes}
    assert (back["constants"].activation_scale, back["constants"].runtime_bytes) == (
        own["activation_scale"], own["runtime_bytes"])


def test_the_pooled_memory_fit_goes_through_both_calibrations_largest_parts():
    """Where a second calibration's pick moves back to the first's micro-batch, the memory fit runs through both
    largest parts' measured peaks (each calibration's own fit holds near its micro-batch only); it is left out where
    the two calibrations are not alike or the peaks do not grow."""
    from dataclasses import replace

    from frugaltune.planner.recalibration import pooled_memory

    per_token, static = 1e5, 2e9
    # the second calibration ran at micro-batch 16: its own fit (scale 0.5) through its largest part's peak
    second_points = [(4000, 2e9 + 4e8 + 0.5 * per_token * 4000), (8000, 2e9 + 4e8 + 0.5 * per_token * 8000)]
    second = Constants(runtime_bytes=int(4e8), activation_scale=0.5, calibrated_method="qlora",
                       calibrated_per_token=per_token)
    # the first, at micro-batch 4: its largest part peaked above what the second's fit says there
    first_points = [(1000, 2.55e9), (2000, 2.6e9)]
    first = Constants(runtime_bytes=int(9e8), activation_scale=0.2, calibrated_method="qlora",
                      calibrated_per_token=per_token)
    pooled = pooled_memory(first, first_points, second, second_points)

    def peak(constants: dict, tokens: int) -> float:
        return static + constants["runtime_bytes"] + constants["activation_scale"] * per_token * tokens

    assert peak({"runtime_bytes": 4e8, "activation_scale": 0.5}, 2000) < 2.6e9  # the second's own fit under-predicts
    assert peak(pooled, 2000) == pytest.approx(2.6e9, rel=1e-4)  # the scale is rounded to 4 places
    assert peak(pooled, 8000) == pytest.approx(second_points[-1][1], rel=1e-4)
    assert pooled_memory(first, first_points, replace(second, calibrated_checkpointing=True), second_points) == {}
    assert pooled_memory(first, first_points, replace(second, calibrated_method="lora"), second_points) == {}
    assert pooled_memory(first, [(1000, 2.9e9), (2000, 3e9)], second, second_points) == {}  # no growth


@pytest.mark.parametrize("case", ["back_inside", "between"])
def test_a_pick_calibrated_again_keeps_what_the_first_calibration_measured_over_the_limit(case):
    """The ladder on a Zen 4, QLoRA: a first calibration measured its micro-batch over the limit (Llama-3.2-1B at
    4 GiB: 4; SmolLM2-1.7B at 8 GiB: 16), so the plan calibrated again at 2. The second calibration's own fit, read
    within micro-batch 2, hardly grew with the tokens and put 16 under the limit: the 1 B run went far over. Fitted
    through both calibrations' peaks, the first's micro-batch stays over the limit as measured, and the pick is 2
    (timed there), or one neither calibration ran (the 1.7 B: 8 here), timed once more at it: the second's time,
    with 8 fixed costs per micro-batch a step, was +43.6 % on a run of 4."""
    from frugaltune.planner.recalibration import at_the_pick

    per_token, static, limit = 1e5, 2e9, 3.6e9

    def peak(constants: Constants, micro: int) -> float:  # the largest part of micro-batch m: 1,000 tokens a row
        return static + constants.runtime_bytes + constants.activation_scale * per_token * 1000 * micro

    def entry(micro: int) -> dict:
        return {"micro_batch_size": micro, "gradient_checkpointing": False, "fits": True, "steps": 20,
                "padded_tokens": 40000}

    def replan(constants, calibration):  # the largest micro-batch whose peak fits, as the plan picks
        micro = next(m for m in (16, 8, 4, 2, 1) if peak(constants, m) <= limit)
        return {"methods": {"qlora": entry(micro)}, "constants": constants, "calibration": calibration}

    def timing(seconds_per_token: float, step_overhead_s: float, **memory) -> Constants:
        return Constants(calibrated_method="qlora", calibrated_per_token=per_token,
                         seconds_per_token=seconds_per_token, step_overhead_s=step_overhead_s, **memory)

    first_micro, first_points, run = {"back_inside": (4, [(3000, 3.4e9), (4000, 3.7e9)], 2),
                                      "between": (16, [(12000, 3.9e9), (16000, 4.2e9)], 8)}[case]
    first = timing(1e-3, 1.0, runtime_bytes=int(5e8), activation_scale=3.0)
    second = timing(2e-3, 0.5, runtime_bytes=int(1.1e9), activation_scale=0.005)
    third = timing(1.5e-3, 0.7)
    calibrations = {2: (second, [(1000, peak(second, 1)), (2000, peak(second, 2))]), 8: (third, [])}
    assert replan(second, {})["methods"]["qlora"]["micro_batch_size"] == 16  # the second's fit alone: 16
    ran = []

    def timed(pick, others, worker, timeout):
        ran.append(pick["micro_batch_size"])
        constants, points = calibrations[pick["micro_batch_size"]]
        return constants, {"stopped": None, "seconds": 10.0, "memory_points": points}

    plan = at_the_pick({"methods": {"qlora": entry(2)}}, "qlora", entry(first_micro), first,
                       {"stopped": None, "seconds": 20.0, "memory_points": first_points}, timed, replan,
                       lambda line: None)
    assert plan["methods"]["qlora"]["micro_batch_size"] == run and ran == sorted({2, run})
    assert plan["calibration"]["memory_from"] == "both calibrations' peaks"
    assert peak(plan["constants"], first_micro) == pytest.approx(first_points[-1][1], rel=1e-3)  # over, as measured
    timed_at = calibrations[run][0]  # the run's time is measured at its own micro-batch
    assert (plan["constants"].seconds_per_token, plan["constants"].step_overhead_s) == (
        timed_at.seconds_per_token, timed_at.step_overhead_s)
    assert plan["calibration"]["seconds"] == 20.0 + 10.0 * len(ran)


def test_the_calibrations_process_receives_the_runs_loop_config_whole(tmp_path):
    """What calibrate hands its process names the run's LoopConfig in its serialized form, JSON-safe, and
    LoopConfig.build takes it back to the same settings (the process then sets only its own: steps, logging,
    no checkpoints or warm-up)."""
    from frugaltune.planner.calibration import _prepare

    loop = LoopConfig.build(lr=3e-3, head_lr=6e-3, lora_plus_ratio=4.0, batch_size=8, micro_batch_size=4,
                            micro_batch_tokens=64, bf16=True, eager_attention_max_len=48, checkpoint_dir=tmp_path,
                            scheduler="cosine", seed=9)
    lengths = [6 + i % 9 for i in range(24)]
    prepared = _prepare("models/none", LABELS, 0, "lora", MethodKnobs(), rows=[[5] * n for n in lengths],
                        targets=[i % 3 for i in range(24)], order=[list(range(i, i + 8)) for i in range(0, 24, 8)],
                        loop=loop, int8={"on": False, "why": "test"}, gradient_checkpointing=False, threads=1,
                        seed=0, time_samples=3, allocator="system", task="classification", inference_rows=None,
                        inference_batch=8, others=None, others_share=None, planned=None,
                        rows_file=tmp_path / "rows.json")
    assert prepared.spec["rows_file"] == str(tmp_path / "rows.json")
    assert LoopConfig.build(**json.loads(json.dumps(prepared.spec))["loop"]) == loop


def test_a_calibration_that_fails_while_it_writes_its_rows_leaves_no_file(tiny_model_dir, tmp_path, monkeypatch):
    """The rows file the calibration's process reads is named before it is written: an exit that lands while it is
    written (a SIGTERM of `frugaltune plan`, here a value JSON cannot write) still removes it. It was created
    first and named after: a SIGTERM in between left it in $TMPDIR (the fault test of a plan by shape, in CI)."""
    import tempfile

    from frugaltune.training.loop import LoopConfig

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shape = model_shape(tiny_model_dir, len(LABELS), "lora")
    rows = [[5 + j for j in range(8 + i)] for i in range(16)]
    _, order = planned_order([len(r) for r in rows], 8, 1, 1.0, None, seed=0)
    with pytest.raises(TypeError, match="not JSON serializable"):
        calibrate(tiny_model_dir, LABELS, 0, "lora", MethodKnobs(), shape, rows=rows, targets=[object()] * 16,
                  order=order, loop=LoopConfig.build(lr=1e-3, batch_size=8), int8={"on": False, "why": "test"},
                  gradient_checkpointing=False, threads=1, time_samples=2)
    assert not list(tmp_path.iterdir())


def test_calibration_times_the_runs_own_loop_and_gives_an_eta(tiny_model_dir):
    """The calibration runs training's own loop (LoopConfig, token cap) over the run's own micro-batches: the sampled
    sizes smallest first (the smallest's first step is the warm-up) and the part that sets the peak last; then again
    under the peak, all but the largest (the dearest step; two sizes are left for the time fit)."""

    from frugaltune.training.loop import LoopConfig

    tokenizer = load_tokenizer(tiny_model_dir)
    shape = model_shape(tiny_model_dir, len(LABELS), "lora")
    lengths = [8 + (i * 7) % 25 for i in range(64)]
    rows = [[5 + j % 50 for j in range(n)] for n in lengths]
    steps, order = planned_order(lengths, 8, 1, 1.0, None, seed=0)
    loop = LoopConfig.build(lr=1e-3, batch_size=8, micro_batch_tokens=96)
    constants, calibration = calibrate(
        tiny_model_dir, LABELS, tokenizer.pad_token_id, "lora", MethodKnobs(), shape, rows=rows,
        targets=[i % 3 for i in range(64)], order=order, loop=loop, int8={"on": False, "why": "test"},
        gradient_checkpointing=False, threads=1, time_samples=4)
    steps = calibration["steps"]
    # the smallest (warm-up), two sizes between, the largest part; then the three smaller again under the peak
    assert len(steps) == 4 + 3
    timed, again = steps[:4], steps[4:]
    assert timed[-1]["part_tokens"] == max(s["part_tokens"] for s in steps) <= 96
    assert all(s["seconds"] > 0 and s["peak_rss_bytes"] > 100 * 2**20 for s in steps)
    assert [s["padded_tokens"] for s in timed[:-1]] == sorted(s["padded_tokens"] for s in timed[:-1])
    assert timed[0]["padded_tokens"] == min(s["padded_tokens"] for s in steps)
    assert [s["padded_tokens"] for s in again] == [s["padded_tokens"] for s in timed[:-1]]
    assert [s["under_peak"] for s in steps] == [False] * 4 + [True] * 3
    # the peak kept for the largest part is the process's, over both passes
    assert calibration["memory_points"][-1][1] == max(s["peak_rss_bytes"] for s in steps)
    assert constants.seconds_per_token > 0 and constants.step_overhead_s >= 0 and constants.startup_s >= 0
    assert constants.runtime_bytes > 100 * 2**20  # a Python process with torch loaded
    assert constants.calibrated_method == "lora" and "the run's own loop" in constants.source
    assert calibration["allocator"] in ("mimalloc", "system") and 0 < calibration["cpu_share"] <= 1.5
    # where the calibration's time went, the worker's imports among it (paid before the spec when started early)
    assert {"imports_s", "waited_s", "build_s", "steps_s", "total_s"} <= set(calibration["phases"])
    assert calibration["phases"]["imports_s"] > 0 and calibration["phases"]["steps_s"] > 0
    plan = make_plan(run_spec("lora", lengths=lengths, seq_len=32), cpu_hardware(),
                     {"lora": shape, "full": model_shape(tiny_model_dir, 3, "full")}, constants)
    lora, full = plan["methods"]["lora"], plan["methods"]["full"]
    padded = lora["padded_tokens"]
    expected = constants.startup_s + lora["steps"] * constants.step_overhead_s + padded * constants.seconds_per_token
    assert lora["eta_seconds"] == pytest.approx(expected, abs=0.1)
    assert "x 1.50" in full["eta_note"]
    json.dumps(plan)  # the plan is written as JSON: nothing in it may be unserialisable


def test_every_method_the_plan_lists_gets_its_own_timed_estimate(tiny_model_dir):
    """The methods the plan does not calibrate are each built and timed on one of the run's micro-batches in the
    calibration's process: their ETA is the calibrated step times their own measured cost, not a copy of lora's; a
    method that cannot be built keeps the FLOPs estimate and says so."""

    tokenizer = load_tokenizer(tiny_model_dir)
    shape = model_shape(tiny_model_dir, len(LABELS), "lora")
    lengths = [8 + (i * 7) % 25 for i in range(48)]
    rows = [[5 + j % 50 for j in range(n)] for n in lengths]
    _, order = planned_order(lengths, 8, 1, 1.0, None, seed=0)
    off = {"on": False, "why": "test"}
    constants, calibration = calibrate(
        tiny_model_dir, LABELS, tokenizer.pad_token_id, "lora", MethodKnobs(), shape, rows=rows,
        targets=[i % 3 for i in range(48)], order=order, loop=LoopConfig.build(lr=1e-3, batch_size=8),
        int8=off, gradient_checkpointing=False, threads=1, time_samples=3,
        others=[{"method": "prelayer", "knobs": MethodKnobs(), "int8": off},
                {"method": "full", "knobs": MethodKnobs(), "int8": off},
                {"method": "dora", "knobs": MethodKnobs(target_modules=("no_such_module",)), "int8": off}],
        others_share=None)
    assert set(constants.method_cost) == {"prelayer", "full"}
    assert all(cost > 0 for cost in constants.method_cost.values())
    # each timed twice on the same rows (the faster counts), against lora's two steps on them taken in turn
    for method in ("prelayer", "full"):
        timed = calibration["others"]["methods"][method]
        assert len(timed["steps_s"]) == 2 and timed["seconds"] == min(timed["steps_s"])
        assert len(timed["calibrated_steps_s"]) == 2 and timed["calibrated_seconds"] == min(timed["calibrated_steps_s"])
        assert constants.method_cost[method] == round(timed["seconds"] / timed["calibrated_seconds"], 3)
    last = calibration["steps"][-2:]
    assert all(s["under_peak"] and s["padded_tokens"] == calibration["others"]["padded_tokens"] for s in last)
    assert calibration["others"]["calibrated_step_s"] == pytest.approx(min(s["seconds"] for s in last), abs=1e-4)
    assert calibration["others"]["calibrated_step_s"] > 0 and calibration["others"]["padded_tokens"] > 0
    assert "no_such_module" in calibration["others"]["methods"]["dora"]["error"]
    methods = ("lora", "prelayer", "full", "dora")
    plan = make_plan(run_spec("lora", lengths=lengths, seq_len=32, batch_size=8), cpu_hardware(),
                     {m: model_shape(tiny_model_dir, 3, m) for m in methods}, constants)
    lora, prelayer = plan["methods"]["lora"], plan["methods"]["prelayer"]
    cost = constants.method_cost["prelayer"]
    assert prelayer["eta_seconds"] == pytest.approx(constants.startup_s + (lora["eta_seconds"] - constants.startup_s)
                                                    * cost, abs=0.1)
    assert "timed here" in prelayer["eta_note"] and f"x {cost:.2f}" in prelayer["eta_note"]
    # FLOPs: the same as lora's, and it says why
    assert "not timed: " in plan["methods"]["dora"]["eta_note"] and "no_such_module" in plan["methods"]["dora"]["eta_note"]
    # what each saved for backward on the same rows, against lora's: prelayer's frozen linear layers keep no inputs
    # for weight gradients, full's keep them all
    ratio = constants.activation_ratio
    assert set(ratio) == {"prelayer", "full"} and 0 < ratio["prelayer"] < ratio["full"]
    assert calibration["others"]["calibrated_saved_bytes"] > 0
    assert f"x {ratio['prelayer']:.2f}" in prelayer["peak_note"] and "analytic" in plan["methods"]["dora"]["peak_note"]
    shape_prelayer = model_shape(tiny_model_dir, 3, "prelayer")
    estimate = memory_estimate(shape_prelayer, "prelayer", bf16=False, micro_batch=4, seq_len=16,
                               gradient_checkpointing=False, constants=constants)
    assert estimate["activations"] + estimate["logits"] == pytest.approx(
        constants.activation_scale * 64 * ratio["prelayer"] * constants.calibrated_per_token, abs=2)
    # measured without checkpointing: a checkpointed run keeps the analytic bytes
    checkpointed = memory_estimate(shape_prelayer, "prelayer", bf16=False, micro_batch=4, seq_len=16,
                                   gradient_checkpointing=True, constants=constants)
    assert checkpointed["activations"] == int(constants.activation_scale * 64 * activation_bytes_per_token(
        shape_prelayer, False, True))
    json.dumps(plan)
    # a calibration that already cost more than its share of this (tiny) run times no other method, and says so
    constants, calibration = calibrate(
        tiny_model_dir, LABELS, tokenizer.pad_token_id, "lora", MethodKnobs(), shape, rows=rows,
        targets=[i % 3 for i in range(48)], order=order, loop=LoopConfig.build(lr=1e-3, batch_size=8),
        int8=off, gradient_checkpointing=False, threads=1, time_samples=2,
        others=[{"method": "prelayer", "knobs": MethodKnobs(), "int8": off}])
    assert constants.method_cost == {} and "budget" in calibration["others"]["methods"]["prelayer"]["skipped"]
    assert "budget" in constants.not_timed["prelayer"]


def test_saved_bytes_count_the_last_step_alone_and_stop_counting_after_it():
    """What a method saves for backward is counted in its last step only (each storage once, parameters left out),
    and the hooks are off once counted: the calibration's other methods run in the same process after it."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    saved = _SavedBytes(model)
    on_log = saved.last_step_of(3)
    for step in range(3):
        x = torch.randn(8 + step, 16)  # a different width each step: only the last one's is counted
        model(x).sum().backward()
        on_log({"step": step + 1})
    # the last step (10 rows): the first layer's input, the tanh's output, the second layer's input (the same
    # storage: counted once); the weights the products saved are the model's parameters and are not counted
    assert saved.total() == 10 * 16 * 4 + 10 * 32 * 4
    model(torch.randn(64, 16)).sum().backward()  # after it: the hooks are off
    assert saved.total() == 10 * 16 * 4 + 10 * 32 * 4
    # a sparse operand, saved for the dense one's gradient, has no storage: not counted, and backward still runs
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
    dense = torch.randn(2, 3, requires_grad=True)
    counter = _SavedBytes(torch.nn.Linear(1, 1))
    with counter.hooks:
        product = torch.sparse.mm(sparse, dense)
    product.sum().backward()
    assert counter.total() == 0 and dense.grad is not None


def test_bf16_weight_casts_are_counted_apart_from_what_grows_with_the_tokens():
    """Under bf16 autocast a linear layer whose input needs a gradient keeps its weight's bf16 copy for backward: a
    fixed cost per step. Counted with the activations it made full fine-tuning's activation ratio against lora 1.8
    where the tokens' share is 1.3, and its from-lora peak 57% high. A method's estimate from another's calibration
    adds its casts beyond the calibrated method's as bytes, not as a ratio."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    casts, grows = [], []
    for rows in (8, 24):
        saved = _SavedBytes(model)
        with saved.hooks, torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(rows, 16, requires_grad=True)).float().sum()
        out.backward()
        casts.append(saved.cast_total())
        grows.append(saved.total())
    # both weights' bf16 copies (the first layer's is saved for its input's gradient, the second's too), each once
    assert casts == [2 * (16 * 32 + 32 * 4)] * 2
    # what is left grows with the rows: the inputs' bf16 copies, the tanh's output, the second layer's input
    assert grows[0] > 0 and grows[1] == 3 * grows[0]
    # fp32: the products save the parameters themselves, which are not counted at all
    saved = _SavedBytes(model)
    with saved.hooks:
        model(torch.randn(8, 16)).sum().backward()
    assert saved.cast_total() == 0 and saved.total() == 8 * 16 * 4 + 8 * 32 * 4
    # in an estimate from another method's calibration: the ratio scales the per-token part, the casts are added
    shape = ModelShape(total_params=10_000, trainable_params=10_000, quantizable_params=8_000,
                       matmul_params=9_000, layers=2, hidden=16, intermediate=32, heads=2, kv_heads=2,
                       num_labels=3, adapted_modules_per_layer=0, adapter_rank=0, dora=False)
    constants = Constants(calibrated_method="lora", calibrated_per_token=1000.0, activation_ratio={"full": 1.0})
    plain = memory_estimate(shape, "full", bf16=True, micro_batch=2, seq_len=8, gradient_checkpointing=False,
                            constants=constants)
    with_casts = memory_estimate(shape, "full", bf16=True, micro_batch=2, seq_len=8,
                                 gradient_checkpointing=False, constants=Constants(
                                             **{**constants.__dict__, "extra_cast_bytes": {"full": 20_000}}))
    assert with_casts["activations"] == plain["activations"] + 20_000


def test_the_memory_fit_keeps_the_largest_parts_measured_peak():
    """Full fine-tuning's high-water mark grew at every step, the small ones too (optimizer state, the allocator):
    the slope overshot, and a runtime clamped at zero put the largest part 29% above its own measured peak. These
    are the points of that calibration (part tokens, peak RSS; SmolLM2-135M, full, fp32)."""
    points = [(576, 2_851_332_096), (624, 3_430_359_040), (640, 3_650_584_576), (784, 3_738_689_536)]
    per_token, static = 1_950_000.0, 2_151_000_000.0
    scale, runtime = fit_memory(points, static, per_token, loaded_rss=629_174_272)
    assert runtime >= 0 and scale >= 0
    assert static + runtime + scale * per_token * 784 == pytest.approx(3_738_689_536, rel=1e-9)
    # A clean line (activations alone grow) keeps its slope and passes through the largest point too.
    line = [(t, int(static + 300e6 + 1.2 * per_token * t)) for t in (200, 400, 800)]
    scale, runtime = fit_memory(line, static, per_token, loaded_rss=600_000_000)
    assert scale == pytest.approx(1.2, rel=1e-6) and runtime == pytest.approx(300e6, rel=1e-6)


def test_the_calibration_reads_from_its_peaks_whether_the_gradients_overlap_the_activations():
    """Qwen2.5-0.5B's shape, full, bf16 (the ladder at 16 GiB, a Zen 4): the calibration's peaks stood on the
    weights, the optimizer state and the gradients, with the activations on top (the allocator kept backward's
    freed pages for the sizes that freed them). Read as overlapping, their runtime took in the gradients (2.4 GB
    against the 0.5 GB held before the first step), and the run, whose wide batches run as two parts of one step,
    was planned with the gradients counted again: +15.6 %. Peaks that do not stand on the gradients read as
    overlapping."""
    from frugaltune.planner.calibration import _fit_peaks
    from frugaltune.training.loop_config import LoopConfig

    from transformers import AutoConfig

    from frugaltune.shapes import SHAPES_DIR

    facts = json.loads((SHAPES_DIR / "Qwen2.5-0.5B.json").read_text())
    shape = model_shape(AutoConfig.for_model(**{k: v for k, v in facts.items() if not k.startswith("_")}), 3, "full")
    loop = LoopConfig.build(lr=1e-4, bf16=True)
    fixed = memory_estimate(shape, "full", bf16=True, micro_batch=0, seq_len=1, gradient_checkpointing=False,
                            constants=Constants(runtime_bytes=0))
    loaded = 535_302_144
    measured = [(192, 8_967_540_736), (544, 10_039_754_752), (1024, 11_313_606_656)]  # that calibration's
    steps = [{"part_tokens": t, "peak_rss_bytes": rss} for t, rss in measured]
    points, _, _, runtime, overlap = _fit_peaks(steps, steps, shape, "full", MethodKnobs(), loop, False, loaded)
    assert not overlap and abs(runtime - loaded) < 0.1 * loaded and points == measured
    # the same growth without the gradients under it: they took the freed pages
    lower = [{"part_tokens": t, "peak_rss_bytes": rss - fixed["gradients"]} for t, rss in measured]
    *_, runtime, overlap = _fit_peaks(lower, lower, shape, "full", MethodKnobs(), loop, False, loaded)
    assert overlap and abs(runtime - loaded) < 0.1 * loaded


def test_the_plan_predicts_the_part_the_loop_runs_under_the_token_cap():
    """train.micro_batch_tokens splits wide batches in the loop; the plan's peak is that part's, not the batch's."""
    lengths = [128] * 16 + [20] * 48
    capped = make_plan(run_spec("lora", lengths=lengths, micro_batch_tokens=1024), cpu_hardware(24),
                       shapes(smollm2_config()), Constants())
    whole = make_plan(run_spec("lora", lengths=lengths), cpu_hardware(24), shapes(smollm2_config()),
                      Constants())
    assert capped["methods"]["lora"]["largest_batch"] == {"sequences": 8, "length": 128}
    assert whole["methods"]["lora"]["largest_batch"] == {"sequences": 16, "length": 128}
    assert capped["methods"]["lora"]["predicted_peak_bytes"] < whole["methods"]["lora"]["predicted_peak_bytes"]


def test_resolve_run_refuses_before_loading_and_reads_every_decision_from_the_plan(tmp_path, monkeypatch):
    from frugaltune import paths, resolve
    from frugaltune.config import Params

    monkeypatch.chdir(tmp_path)
    decided = decide_machine(cpu_hardware(24), None, int8_setting="true", dims=(576, 1536))
    plan = make_plan(run_spec("full"), cpu_hardware(24), shapes(smollm2_config()), Constants(),
                     limit_gb=1.5, decided=decided)
    paths.PLAN.parent.mkdir(parents=True)
    paths.PLAN.write_text(json.dumps(plan))
    params = Params.model_validate({"train": {"method": "full"}})
    with pytest.raises(PlanError, match="cannot fit"):
        resolve.resolve_run(params, use_plan=True)
    lora = Params.model_validate({"train": {"method": "lora", "int8_products": True}})  # as the plan was made
    resolved = resolve.resolve_run(lora, use_plan=True)
    assert resolved.method is METHODS["lora"]  # the registry's entry, looked up once for the run
    assert resolved.micro_batch_size == plan["methods"]["lora"]["micro_batch_size"]
    assert resolved.gradient_checkpointing == plan["methods"]["lora"]["gradient_checkpointing"]
    assert resolved.threads == 2 and resolved.bf16 is False
    assert resolved.int8["on"] is True  # the plan's decision for lora (train.int8_products: true there)
    # Explicit values win over the plan; without using the plan's entry, auto = as configured.
    forced = Params.model_validate({"train": {"method": "lora", "micro_batch_size": 4, "gradient_checkpointing": True}})
    assert resolve.resolve_run(forced, use_plan=True).micro_batch_size == 4
    assert resolve.resolve_run(forced, use_plan=True).gradient_checkpointing is True
    assert resolve.resolve_run(params, use_plan=False).micro_batch_size == 16
    assert math.isclose(resolved.predicted_peak_mb, plan["methods"]["lora"]["predicted_peak_mb"])


def test_a_caller_gets_the_int8_products_it_set_whatever_the_plan_was_made_with(tmp_path, monkeypatch):
    """resolve.machine reads the plan's int8 decision for the caller's setting: the plan's own (timed), or what an
    explicit true / false comes to here, recorded by the plan beside it; nothing is decided at the caller's."""
    from frugaltune import int8, resolve

    monkeypatch.chdir(tmp_path)  # no reports here: the machine's facts are the empty defaults
    made_on = decide_machine(cpu_hardware(24), None, int8_setting=True, dims=(576, 1536))
    assert made_on["int8_setting"] == "true" and made_on["int8"]["lora"]["on"] is True
    plan = {"machine": made_on}
    monkeypatch.setattr(int8, "decide", lambda *a, **k: pytest.fail("decided at the consumer's"))
    assert resolve.machine("auto", "lora", "true", plan)["int8"]["on"] is True  # the plan's
    off = resolve.machine("auto", "lora", False, plan)["int8"]
    assert off == {"on": False, "why": "train.int8_products is false"}
    assert resolve.machine("auto", "lora", plan=plan)["int8"]["on"] is False  # int8 not asked for: none
    with pytest.raises(PlanError, match=r"train.int8_products is auto.*dvc repro plan"):  # auto would be timed
        resolve.machine("auto", "lora", "auto", plan)


def test_resolve_decides_nothing_it_reads_the_plan_or_says_to_make_it(tmp_path, monkeypatch):
    """No plan, a plan from another CPU or an older planner, or one made for another precision or thread setting:
    one PlanError naming the file or the setting and `dvc repro plan`, never a decision made again here."""
    from frugaltune import int8, paths, resolve
    from frugaltune.config import Params
    from frugaltune.federated.plans import machine_precision

    monkeypatch.chdir(tmp_path)
    lora = Params.model_validate({"train": {"method": "lora", "int8_products": False}})
    with pytest.raises(PlanError, match=r"reports/plan.json is missing.*`dvc repro plan`"):
        resolve.resolve_run(lora)
    paths.PLAN.parent.mkdir(parents=True)
    (tmp_path / "reports/hardware.json").write_text(json.dumps(cpu_hardware(24)))
    decided = decide_machine(cpu_hardware(24), None, "auto", "false", ("lora",), (576, 1536), threads=1)
    plan = make_plan(run_spec("lora"), cpu_hardware(24), shapes(smollm2_config()), Constants(), decided=decided)
    monkeypatch.setattr(int8, "decide", lambda *a, **k: pytest.fail("decided at the consumer's"))
    paths.PLAN.write_text(json.dumps({**plan, "device": {"kind": "cpu", "name": "Another CPU"}}))
    with pytest.raises(PlanError, match="made on 'Another CPU'.*dvc repro plan"):
        resolve.resolve_run(lora)
    older = {**plan, "machine": {k: v for k, v in decided.items() if k != "int8_by_setting"}}
    paths.PLAN.write_text(json.dumps(older))
    with pytest.raises(PlanError, match="no machine.int8_by_setting.*dvc repro plan"):
        resolve.resolve_run(lora)
    paths.PLAN.write_text(json.dumps(plan))  # made for train.threads = 1, train.precision auto (fp32 here)
    with pytest.raises(PlanError, match=r"train.threads is null.*train.threads = 1.*dvc repro plan"):
        resolve.resolve_run(lora)
    assert resolve.resolve_run(lora.model_copy(update={"train": lora.train.model_copy(update={"threads": 1})}))
    explicit = Params.model_validate({"train": {"int8_products": False, "threads": 3, "precision": "fp32"}})
    assert resolve.resolve_run(explicit).threads == 3  # as set: not a decision; fp32 is the plan's precision
    with pytest.raises(PlanError, match=r"federated.precision is bf16, the plan decided fp32.*dvc repro plan"):
        machine_precision(Params.model_validate({"train": {"int8_products": False},
                                                 "federated": {"precision": "bf16"}}))
    assert machine_precision(Params.model_validate({"train": {"int8_products": False}})) == (False, 0, False)


def test_the_federation_lays_out_its_workers_on_the_cores_the_plan_counted(tmp_path, monkeypatch):
    """The plan's machine decisions hold the cores (from the probe's report), and the federated stage reads them
    there; a plan written before they were decided is made again."""
    from frugaltune import paths
    from frugaltune.federated.plans import machine_cores

    monkeypatch.chdir(tmp_path)
    twelve = {**cpu_hardware(24), "cpu": {**cpu_hardware(24)["cpu"], "physical_cores": 12}}
    decided = decide_machine(twelve, None, "auto")
    assert decided["cores"] == 12 and decided["threads"] == 12
    assert decide_machine(twelve, None, "auto", ranks=4)["cores"] == 12  # ranks share cores, not count them
    paths.PLAN.parent.mkdir(parents=True)
    paths.PLAN.write_text(json.dumps({"machine": decided}))
    assert machine_cores() == 12  # the plan's count, not this machine's
    paths.PLAN.write_text(json.dumps({"machine": {key: value for key, value in decided.items() if key != "cores"}}))
    with pytest.raises(PlanError, match="no machine.cores.*dvc repro plan"):
        machine_cores()


def test_sdpa_keeps_cudnn_on_a_cpu_only_machine():
    """The GPU switch (cuDNN out of SDPA's backends) must leave a CPU machine's process as it was."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert keep_sdpa_off_cudnn() is torch.cuda.is_available()
    assert torch.backends.cuda.cudnn_sdp_enabled() is (before and not torch.cuda.is_available())


@pytest.mark.slow  # compiles the int8 steps (inductor) into an empty cache
def test_a_cold_compile_is_timed_again_warm_as_the_run_will_find_it(tiny_model_dir, tmp_path, monkeypatch):
    """Graphs compiled afresh during the calibration's first step are cached on disk; the run finds them there. The
    calibration says so per step and takes the start-up from a second process, which finds them too."""

    from frugaltune.training.loop import LoopConfig

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    tokenizer = load_tokenizer(tiny_model_dir)
    shape = model_shape(tiny_model_dir, len(LABELS), "lora")
    lengths = [8 + (i * 7) % 25 for i in range(32)]
    rows = [[5 + j % 50 for j in range(n)] for n in lengths]
    _, order = planned_order(lengths, 8, 1, 1.0, None, seed=0)

    def calibrate_once():  # one call: a second would find the cache warm
        return calibrate(
            tiny_model_dir, LABELS, tokenizer.pad_token_id, "lora", MethodKnobs(), shape, rows=rows,
            targets=[i % 3 for i in range(32)], order=order, loop=LoopConfig.build(lr=1e-3, batch_size=8),
            int8={"on": True, "why": "test"}, gradient_checkpointing=False, threads=1, time_samples=2)

    constants, cold = calibrate_once()
    compiled = [s["compiled_graphs"] for s in cold["steps"]]
    assert compiled[0] > 0 and not any(compiled[1:])  # dynamic shapes: the first step compiles for every size
    assert cold["int8_products"] and cold["startup_from"].startswith("a second process")
    assert constants.startup_s == pytest.approx(cold["startup_s"], abs=0.01) and cold["startup_cold_s"] >= 0


def test_a_cold_compile_does_not_read_as_a_busy_machine():
    # (elapsed, peak, cumulative compiled graphs, process time, wall clock) per step, from cpu 0.0 / wall 0.0:
    # the first step compiles 12 graphs in worker processes (this process's clock sees 2 of its 9 s), the next
    # two keep both cores busy
    marks = [(9.0, 0, 12, 2.0, 9.0), (11.0, 0, 12, 5.9, 11.0), (13.0, 0, 12, 9.8, 13.0)]
    assert _cpu_share(marks, 0.0, 0.0, 2) == pytest.approx(7.8 / 8)
    # a machine shared with another job: the warm steps get one core of two
    shared = [(9.0, 0, 12, 2.0, 9.0), (11.0, 0, 12, 4.0, 11.0), (13.0, 0, 12, 6.0, 13.0)]
    assert _cpu_share(shared, 0.0, 0.0, 2) == pytest.approx(0.5)
    # every step compiled: the whole span counts
    assert _cpu_share([(4.0, 0, 3, 6.0, 4.0)], 0.0, 0.0, 2) == pytest.approx(0.75)


def test_the_table_marks_an_eta_the_calibration_did_not_time():
    constants = Constants(step_overhead_s=0.1, seconds_per_token=1e-4, calibrated_method="lora",
                          method_cost={"dora": 1.3}, not_timed={"qlora": "the calibration's budget is spent"})
    plan = make_plan(run_spec(), cpu_hardware(24), shapes(smollm2_config()), constants)
    rows = {line.split()[0]: line for line in render(plan).splitlines() if line.split()[:1]}
    marked = lambda row: re.search(r" ~\d+(\.\d)? (s|min|h) ", row)  # noqa: E731 (the ETA column, not the why's "~33%")
    assert plan["methods"]["qlora"]["eta_seconds"] and marked(rows["qlora"])
    assert not marked(rows["lora*"]) and not marked(rows["dora"]) and marked(rows["qlora"].replace("~", "")) is None
    assert "~ not timed here (qlora: the calibration's budget is spent)" in render(plan)


def measured_layer_speed() -> dict:
    """The kernels stage's `cpu` section for a small layer, measured here (frugaltune.kernels.cpu)."""
    from frugaltune.kernels import cpu

    ops = cpu.measure_precisions(cpu.ModelShapes(batch=2, seq_len=32, hidden=64, heads=4, intermediate=128), repeats=3)
    return {**cpu.choose_precision(ops, 1.1), "ops": ops}


def test_without_calibration_the_eta_is_the_runs_flops_at_the_layer_speed_the_kernels_stage_measured():
    from frugaltune.planner.machine import layer_flops_per_s
    from frugaltune.planner.memory import training_flops_per_token

    measured = measured_layer_speed()
    ops = measured["ops"]
    layer_flops = 4 * 2 * 64 * 64 * 64 + 3 * 2 * 64 * 64 * 128 + 4 * 2 * 4 * 32**2 * 16  # q/k/v/o, mlp, attention
    layer_ms = 4 * ops["linear_hidden"]["fp32"]["ms"] + 3 * ops["linear_mlp"]["fp32"]["ms"] + \
        ops["attention"]["fp32"]["ms"]
    rate = layer_flops_per_s(measured, bf16=False)
    assert rate == pytest.approx(layer_flops / (layer_ms / 1000))
    assert layer_flops_per_s(None, bf16=False) is None
    model = shapes(smollm2_config(), ("lora", "full"))
    plan = make_plan(run_spec("lora"), cpu_hardware(), model, Constants(flops_per_s=rate))
    for method, entry in plan["methods"].items():
        rows = 64 + 16
        expected = entry["padded_tokens"] * training_flops_per_token(model[method], method,
                                                                     entry["padded_tokens"] / rows) / rate
        # the plan rounds its ETA to 0.1 s (43.2 for 43.244 with a slower measurement: over rel=1e-3 alone)
        assert entry["eta_seconds"] == pytest.approx(expected, rel=1e-3, abs=0.051)
        assert entry["eta_note"].startswith("analytic, not calibrated") and "GFLOP/s" in entry["eta_note"]
    assert plan["methods"]["full"]["eta_seconds"] > 1.4 * plan["methods"]["lora"]["eta_seconds"]  # 6N against 4N
    assert make_plan(run_spec("lora"), cpu_hardware(), model, Constants())["methods"]["lora"]["eta_seconds"] is None


def test_a_run_too_short_to_be_worth_a_calibration_is_planned_analytically_and_says_so(tmp_path, monkeypatch,
                                                                                    tiny_model_dir):
    """probe.calibrate: auto (the default) skips the calibration of a run whose micro-batches are too few for it:
    the calibration would time more than probe.calibration_max_share of them. The plan says so and keeps the
    analytic ETA; a calibration is what `true` (the tests' projects) or a longer run gets."""
    from frugaltune.config import load_params
    from frugaltune.planner.assembly import build_plan
    from tests import tiny_project

    monkeypatch.chdir(tmp_path)
    tiny_project.plan_inputs(tmp_path, tiny_model_dir, LABELS,
                             "train: {batch_size: 8, method: lora, threads: 1}\nprobe: {nvml: false}\n")
    params = load_params(tmp_path / "params.yaml")
    assert params.probe.calibrate == "auto"
    lines = []
    plan = build_plan(params, cpu_hardware(), measured_layer_speed(), log=lines.append)
    lora = plan["methods"]["lora"]
    assert lora["eta_seconds"] > 0
    assert lora["eta_note"].startswith("analytic, not calibrated")
    assert plan["calibration"] == {"skipped": lines[-1].removeprefix("plan: ")}
    assert f"would time 5 of the run's {lora['steps']} micro-batches" in lines[-1]
    assert "probe.calibrate: true" in lines[-1]
    assert plan["constants"]["seconds_per_token"] is None


def test_whether_a_run_is_worth_a_calibration_is_a_share_of_its_micro_batches_not_of_analytic_seconds():
    # The default run (186 micro-batches) is calibrated whatever the analytic model says of its seconds: on a fast
    # CPU those seconds were a fraction of the run's, and a threshold in seconds skipped its calibration.
    from frugaltune.config import ProbeParams
    from frugaltune.planner.assembly import _too_short_to_calibrate

    probe = ProbeParams()
    assert _too_short_to_calibrate(186, probe) is None
    assert _too_short_to_calibrate(100, probe) is None  # 5 of 100: the share itself
    assert "5 of the run's 99 micro-batches" in _too_short_to_calibrate(99, probe)
    assert _too_short_to_calibrate(0, probe)
    # two sizes are timed twice each (with more, the largest runs once): 4 micro-batches, at most 5 % of 80
    two = ProbeParams(calibration_steps=2)
    assert _too_short_to_calibrate(80, two) is None and "4 of the run's 79" in _too_short_to_calibrate(79, two)
