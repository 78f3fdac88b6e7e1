"""Aggregation of federated LoRA adapters: FedAvg is the example-weighted mean, FFA-LoRA is exact, clients of
different ranks aggregate to the global shapes; per-client plans; FedProx's proximal term in the project's loop;
bf16 on the wire; the rounds' layout on disk and the stage's run key.
Run with `pytest tests/unit/test_federated.py` (no Flower needed)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from frugaltune.federated import aggregation as agg
from frugaltune.federated import rounds

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
HEAD = "base_model.model.score.modules_to_save.default.weight"
IN, OUT, LABELS = 6, 5, 3


def adapter(rank: int, seed: int, with_a: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {B: torch.randn(OUT, rank, generator=g), HEAD: torch.randn(LABELS, OUT, generator=g)}
    if with_a:
        tensors[A] = torch.randn(rank, IN, generator=g)
    return tensors


def test_fedavg_is_the_example_weighted_mean():
    glob = adapter(4, 0)
    one, two = adapter(4, 1), adapter(4, 2)
    out = agg.aggregate(glob, [(one, 10), (two, 30)], "fedavg")
    for name in glob:
        torch.testing.assert_close(out[name], 0.25 * one[name] + 0.75 * two[name])


def test_fedavg_of_lora_factors_is_not_the_mean_of_products_but_ffa_is():
    glob = adapter(4, 0)
    clients = [(adapter(4, seed), n) for seed, n in ((1, 5), (2, 7), (3, 11))]
    fedavg = agg.aggregate(glob, clients, "fedavg")
    assert agg.product_error(fedavg, clients) > 0.05  # averaging A and B separately is off by a lot

    # FFA: every client trained B on the server's A; they send B + head only
    ffa_clients = [({k: v for k, v in t.items() if k != A}, n) for t, n in clients]
    ffa = agg.aggregate(glob, ffa_clients, "ffa")
    torch.testing.assert_close(ffa[A], glob[A])
    exact = sum(t[B] @ glob[A] * n for t, n in ffa_clients) / sum(n for _, n in ffa_clients)
    torch.testing.assert_close(ffa[B] @ ffa[A], exact)
    with_a = [({**t, A: glob[A]}, n) for t, n in ffa_clients]
    assert agg.product_error(ffa, with_a) < 1e-6


def test_ffa_refuses_a_client_that_sends_lora_a():
    glob = adapter(4, 0)
    with pytest.raises(ValueError, match="lora_A"):
        agg.aggregate(glob, [(adapter(4, 1), 3)], "ffa")


def test_heterogeneous_ranks_aggregate_to_the_global_shapes():
    glob = adapter(8, 0)
    small = agg.slice_to_rank(glob, 2)
    assert small[A].shape == (2, IN) and small[B].shape == (OUT, 2) and small[HEAD].shape == (LABELS, OUT)
    clients = [(adapter(2, 1), 4), (adapter(4, 2), 4), (adapter(8, 3), 4)]
    out = agg.aggregate(glob, clients, "fedavg")
    assert out[A].shape == (8, IN) and out[B].shape == (OUT, 8)
    # rows 4..7 of A come from the rank-8 client only (the others are zero-padded there)
    torch.testing.assert_close(out[A][4:], clients[2][0][A][4:] / 3)


def test_ffa_with_heterogeneous_ranks_is_the_mean_of_the_clients_deltas():
    glob = adapter(8, 0)
    clients = []
    for seed, rank, n in ((1, 2, 3), (2, 4, 5), (3, 8, 9)):
        clients.append(({B: torch.randn(OUT, rank, generator=torch.Generator().manual_seed(seed)),
                         HEAD: torch.randn(LABELS, OUT)}, n))
    out = agg.aggregate(glob, clients, "ffa")
    # each client's delta uses its own first `rank` rows of the shared A (same alpha/r, see client_alpha)
    exact = sum(t[B] @ glob[A][: t[B].shape[1]] * n for t, n in clients) / 17
    torch.testing.assert_close(out[B] @ out[A], exact)


def test_a_client_of_too_large_rank_is_an_error_that_names_the_fix():
    with pytest.raises(ValueError, match="federated.lora.r"):
        agg.aggregate(adapter(2, 0), [(adapter(4, 1), 1)], "fedavg")


def test_client_alpha_keeps_the_scale():
    assert agg.client_alpha(16, 8, 4) == 8
    with pytest.raises(ValueError, match="multiple of the rank"):
        agg.client_alpha(10, 8, 3)


def test_the_server_step_scales_the_mean_update_and_keeps_ffa_exact():
    glob = adapter(4, 0)
    one, two = adapter(4, 1), adapter(4, 2)
    mean = agg.aggregate(glob, [(one, 1), (two, 1)], "fedavg")
    assert agg.server_step(glob, mean, 1.0) == mean  # plain FedAvg
    stepped = agg.server_step(glob, mean, 3.0)
    for name in glob:
        torch.testing.assert_close(stepped[name], glob[name] + 3 * (mean[name] - glob[name]))
    # FFA: A stays the global one, so the global delta B @ A is exactly 3x the clients' mean delta
    ffa_clients = [(adapter(4, seed, with_a=False), n) for seed, n in ((3, 2), (4, 6))]
    ffa = agg.server_step(glob, agg.aggregate(glob, ffa_clients, "ffa"), 3.0)
    torch.testing.assert_close(ffa[A], glob[A])
    mean_delta = sum((t[B] - glob[B]) @ glob[A] * n for t, n in ffa_clients) / 8
    torch.testing.assert_close(ffa[B] @ ffa[A] - glob[B] @ glob[A], 3 * mean_delta)
    with pytest.raises(ValueError, match="server_lr"):
        agg.server_step(glob, mean, 0.0)


def test_server_momentum_accumulates_the_rounds_deltas_and_without_momentum_is_the_server_step():
    glob = adapter(4, 0)
    first = agg.aggregate(glob, [(adapter(4, 1), 1), (adapter(4, 2), 3)], "fedavg")
    plain, velocity = agg.server_momentum_step(glob, first, 1.0, 0.0, None)
    for name in glob:
        torch.testing.assert_close(plain[name], first[name])
    step1, velocity = agg.server_momentum_step(glob, first, 2.0, 0.9, None)
    second = agg.aggregate(step1, [(adapter(4, 3), 1)], "fedavg")
    step2, velocity2 = agg.server_momentum_step(step1, second, 2.0, 0.9, velocity)
    for name in glob:
        expected_v = 0.9 * (first[name] - glob[name]) + (second[name] - step1[name])
        torch.testing.assert_close(velocity2[name], expected_v)
        torch.testing.assert_close(step2[name], step1[name] + 2.0 * expected_v)
    # FFA: A's delta is zero every round, so momentum never moves A off the shared initialisation
    ffa = agg.aggregate(glob, [(adapter(4, 5, with_a=False), 2)], "ffa")
    moved, velocity = agg.server_momentum_step(glob, ffa, 1.0, 0.9, None)
    moved, velocity = agg.server_momentum_step(moved, agg.aggregate(moved, [(adapter(4, 6, with_a=False), 2)],
                                                                    "ffa"), 1.0, 0.9, velocity)
    torch.testing.assert_close(moved[A], glob[A])
    with pytest.raises(ValueError, match="server_momentum"):
        agg.server_momentum_step(glob, first, 1.0, 1.0, None)


def test_the_round_lr_follows_the_centralized_decay_sampled_mid_round():
    assert [agg.round_lr(0.01, r, 4, "constant") for r in range(1, 5)] == [0.01] * 4
    assert [round(agg.round_lr(0.01, r, 4, "linear"), 6) for r in range(1, 5)] == [0.00875, 0.00625, 0.00375,
                                                                                     0.00125]
    cosine = [agg.round_lr(0.01, r, 4, "cosine") for r in range(1, 5)]
    assert cosine == sorted(cosine, reverse=True) and 0 < cosine[-1] < 0.001
    assert math.isclose(cosine[0] + cosine[-1], 0.01)  # symmetric about half the rate
    with pytest.raises(ValueError, match="lr_schedule"):
        agg.round_lr(0.01, 1, 4, "step")
    with pytest.raises(ValueError, match="outside"):
        agg.round_lr(0.01, 5, 4, "linear")


def test_no_update_at_all_is_an_error():
    with pytest.raises(ValueError, match="every sampled client failed"):
        agg.aggregate(adapter(4, 0), [], "fedavg")


# --- per-client plans from hardware profiles (the project's planner on each client's hardware)
from transformers import LlamaConfig  # noqa: E402

from frugaltune.federated import profiles  # noqa: E402
from frugaltune.planner.assembly import RunSpec  # noqa: E402
from frugaltune.planner.memory import Constants, MethodKnobs  # noqa: E402

SMALL_LLAMA = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3)  # SmolLM2-135M's shape


def client_plan(profile, local_steps=8, budget=None, constants=Constants()):
    run = RunSpec(method="lora", batch_size=16, grad_accum=1, epochs=1.0, max_steps=local_steps, seq_len=128,
                  lengths=tuple([128] * 256), seed=0)
    return profiles.plan_client(profiles.resolve(profile), run, SMALL_LLAMA, 3, MethodKnobs(r=8),
                                constants, local_steps, budget, calibrated_cores=2)


def test_each_preset_gets_a_plan_that_fits_its_own_memory():
    plans = {name: client_plan(name) for name in profiles.PRESETS}
    assert all(plan["fits"] for plan in plans.values()), plans
    assert plans["small_cpu_box"]["lora_rank"] == 4 and plans["gpu_server"]["lora_rank"] == 8  # capped at global r
    assert plans["small_cpu_box"]["threads"] == 2
    for name, plan in plans.items():
        limit = profiles.PRESETS[name].gpu_memory_gb or profiles.PRESETS[name].ram_gb
        assert plan["predicted_peak_mb"] < limit * 1024


def test_less_memory_means_a_smaller_micro_batch_and_too_little_excludes_the_client():
    roomy = client_plan(profiles.HardwareProfile(ram_gb=16, cores=2))
    tight = client_plan(profiles.HardwareProfile(ram_gb=2.0, cores=2))
    assert roomy["fits"] and tight["fits"]
    assert tight["micro_batch_size"] < roomy["micro_batch_size"] and tight["predicted_peak_mb"] < 2 * 1024
    out = client_plan(profiles.HardwareProfile(ram_gb=0.7, cores=2))
    assert not out["fits"] and "GiB" in out["reason"] and "qlora" in out["reason"]


def test_the_round_budget_caps_local_steps_by_the_calibrated_speed():
    measured = Constants(step_overhead_s=0.1, seconds_per_token=1e-3)  # 16 x 128 tokens: ~2.2 s a step
    slow = client_plan(profiles.HardwareProfile(ram_gb=16, cores=1), local_steps=8, budget=10, constants=measured)
    fast = client_plan(profiles.HardwareProfile(ram_gb=16, cores=8), local_steps=8, budget=10, constants=measured)
    assert 1 <= slow["local_steps"] < fast["local_steps"] <= 8


def test_a_gpu_client_gets_no_time_from_a_cpu_calibration_and_this_host_scales_by_its_threads():
    measured = Constants(step_overhead_s=2.0, seconds_per_token=0.0)  # 2 s a step on 2 threads
    run = RunSpec(method="lora", batch_size=16, grad_accum=1, epochs=1.0, max_steps=8, seq_len=128,
                  lengths=tuple([128] * 256), seed=0)
    gpu = profiles.plan_client(profiles.resolve("gpu_server"), run, SMALL_LLAMA, 3, MethodKnobs(r=8),
                               measured, 8, 1.0, calibrated_cores=2, host_threads=1)
    assert gpu["local_steps"] == 8 and gpu["predicted_seconds"] is None and "GPU" in gpu["time_note"]
    assert gpu["predicted_seconds_here"] == pytest.approx(32.0)  # simulated here: 8 steps at 4 s on 1 thread
    box = profiles.plan_client(profiles.resolve("laptop"), run, SMALL_LLAMA, 3, MethodKnobs(r=8),
                               measured, 8, 3.0, calibrated_cores=2, host_threads=2)
    assert box["local_steps"] == 3 and box["predicted_seconds"] == pytest.approx(3.0)  # 1 s a step on 4 cores
    assert box["predicted_seconds_here"] == pytest.approx(6.0)
    uncalibrated = client_plan("laptop", budget=3.0)
    assert uncalibrated["local_steps"] == 8 and uncalibrated["predicted_seconds_here"] is None


def test_client_plans_use_the_plan_stages_calibration_only_of_this_cpu_and_precision(monkeypatch, tmp_path):
    from frugaltune.federated.plans import plan_calibration

    monkeypatch.chdir(tmp_path)
    constants, cores, why = plan_calibration(bf16=True)
    assert constants == Constants() and cores is None and "missing" in why
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports/hardware.json").write_text(json.dumps({"cpu": {"model": "CPU A"}}))
    plan = {"device": {"kind": "cpu", "name": "CPU A"}, "threads": 2, "run": {"precision": "bf16"},
            "constants": {"step_overhead_s": 0.05, "seconds_per_token": 0.002, "startup_s": 4.0,
                          "calibrated_method": "lora", "source": "calibrated here"}}
    (tmp_path / "reports/plan.json").write_text(json.dumps(plan))
    constants, cores, why = plan_calibration(bf16=True)
    assert (constants.seconds_per_token, constants.startup_s, cores) == (0.002, 4.0, 2) and "calibrated here" in why
    constants, cores, why = plan_calibration(bf16=False)  # measured in bf16, the clients train in fp32
    assert constants.seconds_per_token is None and cores is None and "fp32" in why
    # calibrated with the int8 products the clients train with (or without, as they): used; otherwise not
    (tmp_path / "reports/plan.json").write_text(json.dumps(plan | {"calibration": {"int8_products": True}}))
    assert plan_calibration(bf16=True, int8=True)[0].seconds_per_token == 0.002
    constants, cores, why = plan_calibration(bf16=True)
    assert constants.seconds_per_token is None and "with int8 products" in why
    (tmp_path / "reports/plan.json").write_text(json.dumps(plan | {"device": {"kind": "cpu", "name": "CPU B"}}))
    constants, cores, why = plan_calibration(bf16=True)  # a plan in git from another machine
    assert constants.seconds_per_token is None and "CPU B" in why


def test_the_clients_take_the_plans_int8_decision_unless_int8_products_is_set(monkeypatch):
    from frugaltune import resolve
    from frugaltune.config import parse_params
    from frugaltune.federated.plans import Precision, machine_precision
    from frugaltune.planner.machine import decide_machine

    decided = decide_machine({"cpu": {"physical_cores": 2}}, None, "auto", "false", ("lora",), (32, 64))
    auto = {"on": True, "why": "measured 3.6x"}  # what the plan's timing found, as the plan writes it
    plan = {"machine": {**decided, "int8_setting": "auto",
                        "int8_by_setting": {**decided["int8_by_setting"], "auto": {"lora": auto}}}}
    monkeypatch.setattr(resolve, "read_plan", lambda: plan)
    assert machine_precision(parse_params({"train": {"int8_products": "auto"}})) == Precision(False, 0, True)
    assert machine_precision(parse_params({"train": {"int8_products": False}})) == Precision(False, 0, False)


def test_an_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match="laptop"):
        profiles.resolve("phone")


# --- FedProx: the proximal term rides in the project's training loop (train_classifier's regularizer)
from frugaltune.federated import local  # noqa: E402


def distance_after_local_training(model_dir, pad_token_id: int, mu: float) -> tuple[float, float]:
    """||w - w_global|| over the trainable tensors after 4 local steps, and the last task loss."""
    model = local.build_model(model_dir, ["a", "b", "c"], pad_token_id, seed=0,
                              lora=MethodKnobs(4, 8, 0.0, ("q_proj", "v_proj")))
    start = local.trainable_tensors(model)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(5, 500, (6,), generator=g).tolist() for _ in range(16)]
    labels = [i % 3 for i in range(16)]
    result = local.train_locally(model, ids, labels, pad_token_id, steps=4, lr=0.05, batch_size=8,
                                 micro_batch_size=None, seed=0, proximal_mu=mu)
    end = local.trainable_tensors(model)
    return float(sum(((end[k] - start[k]) ** 2).sum() for k in start) ** 0.5), result.final_loss


def test_fedprox_pulls_the_local_update_toward_the_global_weights(tiny_model_dir, smol_tokenizer):
    pad = smol_tokenizer.pad_token_id
    free, free_loss = distance_after_local_training(tiny_model_dir, pad, mu=0.0)
    again, _ = distance_after_local_training(tiny_model_dir, pad, mu=0.0)
    held, held_loss = distance_after_local_training(tiny_model_dir, pad, mu=50.0)
    assert free == pytest.approx(again, rel=1e-6)  # deterministic: the difference below is the term's alone
    assert 0 < held < 0.7 * free
    assert math.isfinite(held_loss) and math.isfinite(free_loss)


def test_a_bf16_client_stores_its_frozen_projections_in_bf16_and_trains_as_autocast_does(tiny_model_dir,
                                                                                          smol_tokenizer):
    """bf16 clients (and the server's evaluation) store the frozen projections in bf16 once, as the train stage
    does: the products see the same bf16 operands as autocast's casts, so the local update is the same; the
    trainable tensors (what travels) stay fp32."""
    pad = smol_tokenizer.pad_token_id
    spec = MethodKnobs(4, 8, 0.0, ("q_proj", "v_proj"))
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(5, 500, (6,), generator=g).tolist() for _ in range(16)]
    labels = [i % 3 for i in range(16)]
    trained = {}
    for stored in (False, True):
        model = local.build_model(tiny_model_dir, ["a", "b", "c"], pad, seed=0, lora=spec, bf16=stored)
        frozen = {m.weight.dtype for m in model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad}
        assert frozen == ({torch.bfloat16} if stored else {torch.float32})
        local.train_locally(model, ids, labels, pad, steps=3, lr=0.01, batch_size=8, micro_batch_size=None, seed=0,
                            bf16=True)
        trained[stored] = local.trainable_tensors(model)
    assert {t.dtype for t in trained[True].values()} == {torch.float32}
    for name, tensor in trained[False].items():
        torch.testing.assert_close(trained[True][name], tensor, rtol=0, atol=1e-6)


def test_an_int8_client_trains_the_same_tensors_and_keeps_ffas_a(tiny_model_dir, smol_tokenizer):
    """The plan's int8 products in a client (local.build_model(int8=True)): its frozen Linears become int8, the
    tensors that train and travel keep their names and shapes, FFA's frozen A stays the global's, and the update
    is the plain model's up to int8's rounding."""
    from frugaltune import int8

    pad = smol_tokenizer.pad_token_id
    spec = MethodKnobs(4, 8, 0.0, ("q_proj", "v_proj"))
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(5, 500, (6,), generator=g).tolist() for _ in range(16)]
    labels = [i % 3 for i in range(16)]
    plain = local.build_model(tiny_model_dir, ["a", "b", "c"], pad, seed=0, lora=spec)
    quantized = local.build_model(tiny_model_dir, ["a", "b", "c"], pad, seed=0, lora=spec, int8=True)
    assert any(isinstance(m, int8.Int8FrozenLinear) for m in quantized.modules())
    assert not any(isinstance(m, int8.Int8FrozenLinear) for m in plain.modules())
    start = local.trainable_tensors(plain)
    assert {k: v.shape for k, v in local.trainable_tensors(quantized).items()} == {k: v.shape for k, v in start.items()}
    updates = {}
    for name, model in (("plain", plain), ("int8", quantized)):
        local.load_tensors(model, start)
        local.freeze_lora_a(model)
        local.train_locally(model, ids, labels, pad, steps=3, lr=0.01, batch_size=8, micro_batch_size=None, seed=0)
        trained = local.trainable_tensors(model)
        assert not any(agg.is_lora_a(k) for k in trained)  # FFA: A neither trains nor travels
        assert all(p.equal(start[k]) for k, p in model.named_parameters() if k in start and agg.is_lora_a(k))
        updates[name] = torch.cat([(trained[k] - start[k]).flatten() for k in sorted(trained)])
    assert updates["int8"].norm() > 0
    cosine = torch.nn.functional.cosine_similarity(updates["int8"], updates["plain"], dim=0)
    assert cosine > 0.9, f"int8 client's update points elsewhere than the plain one's (cosine {cosine:.3f})"


def test_a_clients_round_trains_its_rank_of_the_global_and_a_cached_model_trains_as_a_fresh_one(
        tiny_model_dir, smol_tokenizer):
    """local.train_round, the round the ClientApp and benchmarks/federated_rounds.py both run: the global cut to the
    client's rank, A kept under FFA (neither trained nor sent), the round's steps; the cached model of a later
    FedAvg round trains A again, exactly as a freshly built one does from the same global."""
    from frugaltune.federated.settings import RoundSettings

    pad = smol_tokenizer.pad_token_id
    spec = MethodKnobs(4, 8, 0.0, ("q_proj", "v_proj"))
    server = local.build_model(tiny_model_dir, ["a", "b", "c"], pad, seed=0, lora=spec)
    received = {k: v + 0.01 for k, v in local.trainable_tensors(server).items()}  # a global after some rounds
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(5, 500, (6,), generator=g).tolist() for _ in range(16)]
    labels = [i % 3 for i in range(16)]
    settings = dict(model_dir=str(tiny_model_dir), labels=("a", "b", "c"), pad_token_id=pad, lora_r=4, lora_alpha=8,
                    lora_dropout=0.0, lora_target_modules=("q_proj", "v_proj"), local_steps=2, lr=0.01,
                    batch_size=8, seed=0)
    model, reused = local.cached_model(str(tiny_model_dir), ["a", "b", "c"], pad, 0, spec, 2)
    assert not reused
    ffa = RoundSettings(**settings, method="ffa", round=1)
    trained, result, privacy = local.train_round(model, received, 2, ffa, ids, labels)
    assert result.steps == 2 and privacy == {}
    assert trained and not any(agg.is_lora_a(k) for k in trained)
    sliced = agg.slice_to_rank(received, 2)
    assert all(p.equal(sliced[k]) for k, p in model.named_parameters() if agg.is_lora_a(k))
    assert {k: v.shape for k, v in trained.items()} == {k: sliced[k].shape for k in trained}

    fedavg = RoundSettings(**settings, method="fedavg", round=2)
    again, reused = local.cached_model(str(tiny_model_dir), ["a", "b", "c"], pad, 0, spec, 2)
    assert reused and again is model
    cached, _, _ = local.train_round(again, received, 2, fedavg, ids, labels)
    fresh_model = local.build_model(tiny_model_dir, ["a", "b", "c"], pad, seed=0, lora=spec, rank=2)
    fresh, _, _ = local.train_round(fresh_model, received, 2, fedavg, ids, labels)
    assert any(agg.is_lora_a(k) for k in cached) and cached.keys() == fresh.keys()
    assert all(torch.allclose(cached[k], fresh[k], atol=1e-6) for k in fresh)


def test_a_client_reports_its_own_rounds_peak_not_the_workers_largest_so_far():
    """A simulation worker runs client after client: the ClientApp resets the high-water mark when a round's
    message arrives (loop.reset_peak_rss), so a small client after a large one reports its own peak. In a fresh
    process: the reset is the whole process's."""
    import subprocess
    import sys

    code = ("import numpy as np\n"
            "from frugaltune.training.loop import peak_rss_mb, reset_peak_rss\n"
            "before = peak_rss_mb()\n"
            "large = np.ones(40_000_000)\n"  # 320 MB, every page touched
            "high = peak_rss_mb()\n"
            "del large\n"
            "print(before, high, reset_peak_rss(), peak_rss_mb())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    before, high, reset, after = float(out[0]), float(out[1]), out[2], float(out[3])
    assert high - before > 250  # the large job raised the peak
    assert reset == "True" and high - after > 250  # after the reset: what the process holds now, not the old peak


def test_rounds_before_the_last_evaluate_the_same_label_stratified_sample_and_the_last_the_whole_split():
    labels = [0] * 50 + [1] * 30 + [2] * 20
    ids = [[i + 5] for i in range(100)]
    chosen = local.sample_rows(labels, 10, seed=42)
    assert len(chosen) == 10 and chosen == sorted(set(chosen))
    assert [sum(labels[i] == k for i in chosen) for k in range(3)] == [5, 3, 2]  # each label's share of the split
    assert local.sample_rows(labels, 10, seed=42) == chosen and local.sample_rows(labels, 10, seed=1) != chosen
    odd = local.sample_rows(labels, 7, seed=0)  # 3.5 / 2.1 / 1.4: the largest remainders get the last rows
    assert [sum(labels[i] == k for i in odd) for k in range(3)] == [4, 2, 1]
    assert local.sample_rows(labels, 0, seed=0) == local.sample_rows(labels, 500, seed=0) == list(range(100))
    test = (ids, labels)
    between = local.evaluation_split(test, 2, 4, 10, seed=42)
    assert between == ([ids[i] for i in chosen], [labels[i] for i in chosen])
    assert local.evaluation_split(test, 3, 4, 10, seed=42) == between  # the same rows every round
    assert local.evaluation_split(test, 4, 4, 10, seed=42) == test  # the last round: the result, the whole split
    assert local.evaluation_split(test, 2, 4, 0, seed=42) == test  # round_eval_rows null: the whole split


def test_a_kept_client_state_continues_adamw_and_changes_the_update(tiny_model_dir, smol_tokenizer):
    """federated.client_state: kept. Round 1 fills the dict with AdamW's state; round 2 starts from it (its step
    count goes on from 3 to 6) and so takes another step than a fresh optimizer from the same weights would."""
    pad = smol_tokenizer.pad_token_id
    spec = MethodKnobs(4, 8, 0.0, ("q_proj", "v_proj"))
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(5, 500, (6,), generator=g).tolist() for _ in range(16)]
    labels = [i % 3 for i in range(16)]

    def round_two(state: dict | None) -> dict[str, torch.Tensor]:
        model = local.build_model(tiny_model_dir, ["a", "b", "c"], pad, seed=0, lora=spec)
        local.train_locally(model, ids, labels, pad, steps=3, lr=0.01, batch_size=8, micro_batch_size=None,
                            seed=1, optimizer_state=state)
        return local.trainable_tensors(model)

    kept: dict = {}
    model = local.build_model(tiny_model_dir, ["a", "b", "c"], pad, seed=0, lora=spec)
    local.train_locally(model, ids, labels, pad, steps=3, lr=0.01, batch_size=8, micro_batch_size=None, seed=0,
                        optimizer_state=kept)
    assert kept and {float(entry["step"]) for entry in kept.values()} == {3.0}
    assert all(entry["exp_avg"].abs().sum() > 0 for entry in kept.values())
    continued, fresh = round_two(kept), round_two(None)
    assert {float(entry["step"]) for entry in kept.values()} == {6.0}  # replaced by round two's state
    again = round_two(None)
    assert all(again[name].equal(fresh[name]) for name in fresh)  # deterministic: the difference is the state
    assert any(not continued[name].equal(fresh[name]) for name in fresh)


def test_a_client_starts_from_its_newest_state_of_an_earlier_round(tmp_path):
    """A server killed during round 3 resumes round 3: the client's state from its first attempt at round 3 is
    not where the second attempt starts."""
    assert rounds.client_state_before(tmp_path, 1) is None
    for number in (1, 2, 3):
        rounds.client_state_path(tmp_path, number).write_bytes(b"s")
    assert rounds.client_state_before(tmp_path, 3) == rounds.client_state_path(tmp_path, 2)
    assert rounds.client_state_before(tmp_path, 5) == rounds.client_state_path(tmp_path, 3)
    rounds.prune_client_states(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client_state_003.pt"]


def test_the_label_prior_is_smoothed_and_normalised():
    prior = local.label_log_prior([0, 0, 0, 1], 3).exp()
    assert prior.tolist() == pytest.approx([4 / 7, 2 / 7, 1 / 7])  # add-one: an unseen label is not log 0


def test_logit_adjustment_trains_on_logits_plus_the_clients_log_prior_and_leaves_the_model_as_it_was(
        tiny_model_dir, smol_tokenizer):
    """The first step's loss with adjustment is the cross-entropy of (logits + log prior); after training the
    model's forward is its own again (the hook is gone)."""
    pad = smol_tokenizer.pad_token_id
    spec = MethodKnobs(4, 8, 0.0, ("q_proj", "v_proj"))
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(5, 500, (6,), generator=g).tolist() for _ in range(8)]
    labels = [0] * 6 + [1, 2]  # one client's skewed rows
    prior = local.label_log_prior(labels, 3)
    model = local.build_model(tiny_model_dir, ["a", "b", "c"], pad, seed=0, lora=spec)
    inputs = {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(8, 6, dtype=torch.long)}
    with torch.no_grad():
        logits = model(**inputs).logits
    target = torch.tensor(labels)
    expected = {False: float(torch.nn.functional.cross_entropy(logits, target)),
                True: float(torch.nn.functional.cross_entropy(logits + prior, target))}
    for adjust in (False, True):
        model = local.build_model(tiny_model_dir, ["a", "b", "c"], pad, seed=0, lora=spec)
        result = local.train_locally(model, ids, labels, pad, steps=1, lr=1e-9, batch_size=8, micro_batch_size=None,
                                     seed=0, logit_adjustment=adjust)
        assert result.history[0]["loss"] == pytest.approx(expected[adjust], rel=1e-4), adjust
        with torch.no_grad():  # lr ~0: the weights barely moved, and no prior is added any more
            assert torch.allclose(model(**inputs).logits, logits, atol=1e-5)
    assert expected[True] < expected[False]  # the majority label's prior lowers its loss: less to learn from it


# --- bf16 transmission: the 16-bit pattern travels as uint16 (numpy has no bf16) and is restored exactly
import io  # noqa: E402

import numpy as np  # noqa: E402

from frugaltune.federated import wire  # noqa: E402


def npy_bytes(array: np.ndarray) -> int:
    """What a Flower Array built from `array` carries: its .npy serialization."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return len(buffer.getvalue())


def test_bf16_on_the_wire_restores_the_bf16_value_and_halves_the_bytes():
    tensors = adapter(8, 0)
    for name, tensor in tensors.items():
        sent = wire.encode(tensor, "bf16")
        assert sent.dtype == np.uint16 and sent.shape == tuple(tensor.shape)
        back = wire.decode(sent)
        assert back.dtype == torch.float32
        assert torch.equal(back, tensor.to(torch.bfloat16).float())  # exactly the bf16 value, bit for bit
        torch.testing.assert_close(back, tensor, rtol=2 ** -8, atol=0)
        assert torch.equal(wire.decode(wire.encode(tensor, "fp32")), tensor)  # fp32: unchanged
        # the payload: 2 bytes a value instead of 4, plus the same .npy header
        assert sent.nbytes * 2 == wire.encode(tensor, "fp32").nbytes
        assert npy_bytes(wire.encode(tensor, "fp32")) - npy_bytes(sent) == tensor.numel() * 2
    once = wire.round_trip(tensors, "bf16")
    assert all(torch.equal(once[k], wire.round_trip(once, "bf16")[k]) for k in once)  # rounding is done once
    with pytest.raises(ValueError, match="transmit_dtype"):
        wire.encode(tensors[A], "fp16")


def test_a_round_exists_when_its_json_does_and_velocities_are_not_rounds(tmp_path):
    (tmp_path / "rounds").mkdir()
    assert rounds.last_completed_round(tmp_path) is None
    for number in (0, 1, 2):
        rounds.round_path(tmp_path, number, "safetensors").write_bytes(b"x")
        rounds.velocity_path(tmp_path, number).write_bytes(b"v")
    for number in (0, 1):  # round 2's JSON was never written: the server died saving it
        rounds.round_path(tmp_path, number, "json").write_text(json.dumps({"round": number}))
    assert rounds.completed(tmp_path) == [0, 1]
    assert rounds.last_completed_round(tmp_path) == 1
    assert [report["round"] for report in rounds.reports(tmp_path)] == [0, 1]


def test_the_federated_run_key_changes_with_the_code_that_computes_rounds(monkeypatch, tmp_path):
    from frugaltune.config import load_params
    from frugaltune.federated import keys
    from frugaltune.federated.plans import Precision

    params = load_params()
    key = keys.run_key(params, "dirichlet", "fedavg", "rows")
    assert keys.run_key(params, "dirichlet", "fedavg", "rows") == key
    assert keys.run_key(params, "dirichlet", "fedavg", "other rows") != key  # new data: a new federation
    # the plan deciding int8 products (or bf16) for the clients: a new federation, not a resume of the other's rounds
    plain, int8 = Precision(False, 0, False), Precision(False, 0, True)
    assert keys.run_key(params, "dirichlet", "fedavg", "rows", precision=plain) != keys.run_key(
        params, "dirichlet", "fedavg", "rows", precision=int8)
    copy = tmp_path / "frugaltune" / "federated"
    copy.mkdir(parents=True)
    for entry in keys.ROUND_CODE:  # the same code elsewhere: the same key; one changed byte: another key
        source = keys.PROJECT_ROOT / entry
        target = tmp_path / entry
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.write_bytes(source.read_bytes())
    monkeypatch.setattr(keys, "PROJECT_ROOT", tmp_path)
    assert keys.run_key(params, "dirichlet", "fedavg", "rows") == key
    with (tmp_path / "frugaltune/federated/aggregation.py").open("a") as handle:
        handle.write("\n# changed\n")
    assert keys.run_key(params, "dirichlet", "fedavg", "rows") != key


def test_the_federated_data_fingerprint_follows_the_rows_not_the_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from frugaltune.federated.rows import data_fingerprint

    def write(rows: dict[str, tuple[list[list[int]], list[int]]], compression: str = "snappy") -> str:
        parts = tmp_path / "parts"
        parts.mkdir(exist_ok=True)
        for name, (ids, labels) in rows.items():
            pq.write_table(pa.table({"input_ids": ids, "labels": labels}),
                           tmp_path / "test.parquet" if name == "test" else parts / f"{name}.parquet",
                           compression=compression)
        clients = [{"client": int(name.split("_")[1])} for name in rows if name != "test"]
        (parts / "partitions.json").write_text(json.dumps({"clients": clients}))
        return data_fingerprint(parts, tmp_path / "test.parquet")

    rows = {"client_0": ([[1, 2, 3], [4]], [0, 1]), "client_1": ([[5, 6]], [2]), "test": ([[7, 8]], [1])}
    first = write(rows)
    assert write(rows, compression="none") == first  # the same rows in other bytes: the same federation
    assert write({**rows, "client_1": ([[5, 6]], [0])}) != first  # one label changed
    assert write({**rows, "test": ([[7, 9]], [1])}) != first  # the server judges on other rows
    (tmp_path / "parts" / "client_7.parquet").write_bytes(b"stale")  # a file partitions.json does not list
    assert write(rows) == first


def test_the_centralized_reference_key_follows_what_the_reference_trains_on(monkeypatch, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from frugaltune.config import load_params
    from frugaltune.federated.centralized import reference_key
    from frugaltune.federated.plans import Precision

    params = load_params()
    monkeypatch.chdir(tmp_path)  # the reference's rows: data/federated/ of the project it runs in
    data = tmp_path / "data/federated"
    data.mkdir(parents=True)

    def write(train_labels: list[int]) -> None:
        pq.write_table(pa.table({"input_ids": [[1, 2], [3]], "labels": train_labels}), data / "train.parquet")
        pq.write_table(pa.table({"input_ids": [[4]], "labels": [0]}), data / "test.parquet")

    write([0, 1])
    key = reference_key(params, 6400, 2, Precision(True, 512), 2)
    assert reference_key(params, 6400, 2, Precision(True, 512), 2) == key
    changed = [reference_key(params, 3200, 2, Precision(True, 512), 2),  # fewer examples
               reference_key(params, 6400, 0, Precision(True, 512), 2),  # another pad id
               reference_key(params, 6400, 2, Precision(False, 512), 2),  # fp32
               reference_key(params, 6400, 2, Precision(True, 512), 1),  # 1 thread: other bf16 sums
               reference_key(params.model_copy(update={"train": params.train.model_copy(update={"lr": 1e-3})}),
                             6400, 2, Precision(True, 512), 2),  # the recipe
               reference_key(params, 6400, 2, Precision(True, 512, int8=True), 2)]  # trained with int8 products
    assert key not in changed and len(set(changed)) == len(changed)
    write([0, 2])  # one label of the union of the clients' rows
    assert reference_key(params, 6400, 2, Precision(True, 512), 2) != key

