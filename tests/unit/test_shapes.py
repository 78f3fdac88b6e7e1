"""Models by shape, before their weights (frugaltune/shapes.py), and the plan's one line on what fits
(frugaltune/fit_summary.py): public configs on the meta device, tiny shapes materialised; nothing downloads."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from frugaltune import cli, shapes
from frugaltune.planner.assembly import RunSpec, make_plan
from frugaltune.planner.memory import Constants, _config, model_shape
from frugaltune.fit_summary import fit_line
from frugaltune.models import load_for_classification

LABELS = ["negative", "neutral", "positive"]
GiB = 2**30

# the parameter counts the models' publishers state (model cards), counted here from the configs alone
PUBLISHED = {"SmolLM2-360M": 362e6, "Qwen2.5-0.5B": 494e6, "Llama-3.2-1B": 1.24e9, "SmolLM2-1.7B": 1.71e9,
             "Llama-3.2-3B": 3.21e9}

# a Qwen2 shape a test can materialise: q/k/v biases, tied embeddings; widths of 64 as build_tiny_model explains
TINY_QWEN2 = {"_source": "a test's tiny Qwen2 shape", "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
              "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 49152, "tie_word_embeddings": True,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6}


def test_every_shape_names_its_source_and_counts_its_published_parameters(tmp_path):
    assert set(shapes.names()) == set(PUBLISHED)
    for name, published in PUBLISHED.items():
        model = shapes.resolve(name, tmp_path / name)
        assert model.by_shape and model.source.endswith("config.json") and "/" in model.source
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(_config(model.config_dir, 3))
        assert sum(p.numel() for p in built.parameters()) == pytest.approx(published, rel=0.01), name
    # Qwen2's q/k/v projections carry biases, its o_proj none
    qwen = model_shape(shapes.resolve("qwen2.5-0.5b", tmp_path / "q").config_dir, 3, "full")
    assert qwen.hidden == 896 and qwen.kv_heads == 2 and qwen.layers == 24


def test_a_model_is_found_by_name_config_file_or_directory_and_bad_input_is_one_line(tmp_path, tiny_model_dir):
    assert shapes.resolve("HuggingFaceTB/SmolLM2-360M-Instruct", tmp_path / "a").given == "SmolLM2-360M"
    config = tmp_path / "qwen.json"
    config.write_text(json.dumps(TINY_QWEN2))
    by_file = shapes.resolve(str(config), tmp_path / "b")
    assert by_file.by_shape and json.loads((by_file.config_dir / "config.json").read_text())["hidden_size"] == 64
    assert "_source" not in json.loads((by_file.config_dir / "config.json").read_text())
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    shutil.copy(config, only_config / "config.json")
    assert shapes.resolve(str(only_config), tmp_path / "c").by_shape
    with_weights = shapes.resolve(str(tiny_model_dir), tmp_path / "d")  # its weights: planned with them
    assert not with_weights.by_shape and with_weights.weights_dir() == tiny_model_dir
    with pytest.raises(shapes.ShapeError, match=r"known shapes: Llama-3.2-1B, .*SmolLM2-360M"):
        shapes.resolve("Mistral-7B", tmp_path / "e")
    config.write_text(json.dumps({**TINY_QWEN2, "num_key_value_heads": 2, "intermediate_size": "wide"}))
    with pytest.raises(shapes.ShapeError, match=r"qwen.json: intermediate_size = 'wide', expected a positive"):
        shapes.resolve(str(config), tmp_path / "f")
    config.write_text("{not json")
    with pytest.raises(shapes.ShapeError, match=r"not a readable JSON config"):
        shapes.resolve(str(config), tmp_path / "g")
    big = shapes.resolve(str(only_config), tmp_path / "h")
    big.config["vocab_size"] = 1000
    with pytest.raises(shapes.ShapeError, match=r"vocabulary \(1,000 tokens\) is smaller than the project's"):
        shapes.check_vocabulary(big, 49152, tmp_path)


def test_random_weights_of_a_qwen2_shape_load_as_a_complete_checkpoint_in_shards(tmp_path, monkeypatch):
    """Every weight the architecture has, biases included, tied once, in shards with transformers' index: the
    classifier load (which refuses missing weights) and the causal LM load both take it as they take a real one."""
    config = tmp_path / "qwen.json"
    config.write_text(json.dumps(TINY_QWEN2))
    model = shapes.resolve(str(config), tmp_path / "work")
    monkeypatch.setattr(shapes, "SHARD_BYTES", 4 * 2**20)  # the embeddings alone are 12 MiB: several shards
    out = model.weights_dir()
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2 and (out / "model.safetensors.index.json").is_file()
    classifier = load_for_classification(out, LABELS, pad_token_id=2, seed=0)
    assert classifier.model.layers[0].self_attn.q_proj.bias is not None
    causal, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert causal.lm_head.weight.data_ptr() == causal.model.embed_tokens.weight.data_ptr()
    weights = causal.model.layers[0].mlp.up_proj.weight
    assert 0.01 < weights.std().item() < 0.03  # initializer_range's spread: not zeros, not unit noise


def test_the_fit_line_says_what_does_not_fit_and_what_would(tmp_path):
    """SmolLM2-1.7B by shape under a laptop's 4 GiB: full fine-tuning does not fit, QLoRA does; the line says so
    with the numbers of the plan's own memory model."""
    config_dir = shapes.resolve("SmolLM2-1.7B", tmp_path).config_dir
    methods = ("none", "full", "lora", "qlora")
    model_shapes = {m: model_shape(config_dir, 3, m) for m in methods}
    hardware = {"cpu": {"model": "test CPU", "physical_cores": 2, "flags": {}},
                "memory": {"total_bytes": 64 * GiB, "cgroup_limit_bytes": None}, "gpus": []}
    spec = RunSpec(method="lora", batch_size=16, grad_accum=1, epochs=1.0, max_steps=None, seq_len=128,
                           lengths=(40,) * 60 + (128,) * 4, seed=0)
    lines = {}
    for limit in (4, 8, 16):
        plan = make_plan(spec, hardware, model_shapes, Constants(), limit_gb=limit)
        lines[limit] = fit_line(plan)
        for method in methods[1:]:
            entry = plan["methods"][method]
            peak = f"{entry['predicted_peak_bytes'] / GiB:.1f} GiB"
            assert (f"fits at micro-batch {entry['micro_batch_size']}" if entry["fits"] else f"needs {peak}") in \
                lines[limit].split(f"{method} (NF4)" if method == "qlora" else f"{method} ")[1].split(";")[0]
    # 1.7 B params x 16 bytes (fp32 weights, gradients, AdamW's two states): full fits at none of the three
    assert all(" full needs 26.1 GiB even at micro-batch 1 with gradient checkpointing;" in line
               for line in lines.values())
    assert lines[4].startswith("At 4 GiB (3.6 usable): ")
    assert "; lora needs " in lines[4] and "; qlora (NF4) fits at micro-batch " in lines[4]
    assert "; lora fits at micro-batch 2 x 8 accumulation with gradient checkpointing (" in lines[8]
    assert "; lora fits at micro-batch 4 x 4 accumulation (" in lines[16]  # no checkpointing where memory allows


def test_plan_by_shape_calibrates_a_random_model_of_that_shape_on_the_projects_rows(tmp_path, monkeypatch,
                                                                                    tiny_model_dir, capsys):
    """`frugaltune plan --model CONFIG` in a project whose models/base is another model: the shape planned is the
    config's (Qwen2: q/k/v biases), the calibration runs on random weights of it, the output says so."""
    from tests import tiny_project

    monkeypatch.chdir(tmp_path)
    tiny_project.plan_inputs(tmp_path, tiny_model_dir, LABELS, "train: {batch_size: 8, method: lora, threads: 1}\n"
                             "probe: {calibration_steps: 2, calibration_max_share: 1, nvml: false}\n")
    (tmp_path / "qwen.json").write_text(json.dumps(TINY_QWEN2))
    assert cli.main(["plan", "--model", "qwen.json", "--memory-limit-gb", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    expected = model_shape(tmp_path / "models" / "base", 3, "lora").total_params
    assert plan["methods"]["lora"]["total_params"] != expected  # not models/base's shape...
    qwen = shapes.resolve("qwen.json", tmp_path / "w").config_dir
    assert plan["methods"]["lora"]["total_params"] == model_shape(qwen, 3, "lora").total_params  # ...qwen's
    # a machine busy with other work stops the calibration (planner.worker._Watch): then the note says it did not calibrate
    if plan["calibration"]["steps"]:
        assert plan["constants"]["calibrated_method"] == "lora"
        assert "randomly initialised model of the same shape" in plan["model"]["note"]
    else:
        assert plan["calibration"]["machine_busy"] and "not calibrated" in plan["model"]["note"]
    assert plan["fit"].startswith("At 4 GiB (3.6 usable): full fits at micro-batch 8")
    # by shape, with calibrate: auto, only the method planned is timed (the others keep their FLOPs estimate)
    if plan["calibration"]["steps"]:
        assert plan["constants"]["method_cost"] == {} and plan["constants"]["not_timed"] == {}

    # ...and the answer comes within probe.calibration_by_shape_s: past it before the calibration could start, the
    # plan is the analytic one and says why; --calibrate has no such limit
    (tmp_path / "params.yaml").write_text("train: {batch_size: 8, method: lora, threads: 1}\n"
                                          "probe: {calibration_steps: 2, calibration_max_share: 1, nvml: false, "
                                          "calibration_by_shape_s: 0.001}\n")
    assert cli.main(["plan", "--model", "qwen.json", "--memory-limit-gb", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert "probe.calibration_by_shape_s" in plan["calibration"]["skipped"]
    assert plan["constants"]["calibrated_method"] is None and "not calibrated" in plan["model"]["note"]
