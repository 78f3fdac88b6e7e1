"""Quiet logs: loading a classifier and wrapping it in LoRA prints no known-harmless warning (the LOAD REPORT table
of the new head, peft's `is_gradient_checkpointing` FutureWarning). Run with `pytest tests/unit/test_quiet_logs.py`;
a fresh process each, as a stage runs, on the tiny llama."""

from __future__ import annotations

import subprocess
import sys

from tests import tiny_project

LOAD_AND_WRAP = """
import sys
from frugaltune.models import load_for_classification
from frugaltune.training.methods import apply_lora, load_trained
model = apply_lora(load_for_classification(sys.argv[1], ["neg", "pos"], 0, seed=0), 4, 8, 0.0, ["q_proj"])
model.save_pretrained(sys.argv[2])
load_trained(load_for_classification(sys.argv[1], ["neg", "pos"], 0, seed=0), sys.argv[2])
print("loaded")
"""


def test_loading_and_wrapping_a_classifier_prints_no_known_harmless_warning(tiny_model_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_WRAP, str(tiny_model_dir), str(tmp_path / "adapter")],
                          env=tiny_project.env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr
    assert "LOAD REPORT" not in proc.stderr and "MISSING" not in proc.stderr, proc.stderr
    assert "is_gradient_checkpointing" not in proc.stderr, proc.stderr


def test_a_checkpoint_that_does_not_fit_the_model_is_still_an_error(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(tiny_model_dir), str(broken)], check=True)
    code = ("import sys, torch; from safetensors.torch import load_file, save_file; p = sys.argv[1] + "
            "'/model.safetensors'; t = load_file(p); t.pop(next(k for k in t if 'q_proj' in k)); save_file(t, p)")
    subprocess.run([sys.executable, "-c", code, str(broken)], check=True)
    from frugaltune.models import load_for_classification

    try:
        load_for_classification(broken, ["neg", "pos"], 0, seed=0)
    except ValueError as error:
        assert "q_proj" in str(error) and "import_model" in str(error)
    else:
        raise AssertionError("a checkpoint missing a q_proj weight loaded silently")
