"""Quiet logs: loading a classifier and wrapping it in LoRA prints no known-harmless warning (the LOAD REPORT table
of the new head, peft's `is_gradient_checkpointing` FutureWarning); a stage whose output is not a terminal draws no
progress bar; a report rewritten with nothing new but its timings stays as it was. Run with
`pytest tests/unit/test_quiet_logs.py`; a fresh process where the output matters, as a stage runs, on the tiny llama.
(MLflow's cloudpickle notice: tests/unit/test_register.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from frugaltune import console
from frugaltune.io import write_json, write_metrics
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


# What a stage does that draws a bar: datasets' map and save_to_disk, transformers' save_pretrained, the loop's own.
STAGE_WITH_BARS = """
import sys
from datasets import Dataset
from frugaltune.faults import stage_errors
from frugaltune.models import load_for_classification
from frugaltune.classify import classify
from frugaltune.training.inference import bar
with stage_errors("bars"):
    rows = Dataset.from_dict({"x": list(range(50))}).map(lambda row: {"y": row["x"] + 1})
    rows.save_to_disk(sys.argv[2] + "/rows")
    model = load_for_classification(sys.argv[1], ["neg", "pos"], 0, seed=0)
    model.save_pretrained(sys.argv[2] + "/model")
    classify(model, [[1, 2, 3]] * 40, 0, batch_size=4, progress=bar("predict"))
print("done")
"""


def test_a_stage_writing_to_a_pipe_draws_no_progress_bar(tiny_model_dir, tmp_path):
    env = {name: value for name, value in tiny_project.env().items() if name not in console.QUIET_ENV}
    # Bytes, not text: text mode would turn each "\r" redraw into a line end before the test could see it.
    proc = subprocess.run([sys.executable, "-c", STAGE_WITH_BARS, str(tiny_model_dir), str(tmp_path)],
                          env=env, capture_output=True, timeout=300)
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0 and "done" in stdout, stderr
    assert "\r" not in stdout + stderr, stderr[-3000:]
    for bar in ("Map", "Saving the dataset", "Loading weights", "Writing model shards", "predict"):
        assert bar not in stderr, stderr[-3000:]


# As the import_model stage runs: its imports (transformers, tqdm) before main(), then transformers' GGUF conversion,
# which draws its bar with tqdm.auto directly (modeling_gguf_pytorch_utils), past transformers' own switch.
GGUF_CONVERSION_BAR = """
import stages.import_model
from frugaltune.faults import stage_errors
with stage_errors("import_model"):
    from transformers import modeling_gguf_pytorch_utils as gguf_loader
    for _ in gguf_loader.tqdm(range(300), desc="Converting and de-quantizing GGUF tensors...", mininterval=0):
        pass
print("done")
"""


def test_a_bar_of_a_library_imported_before_the_stage_began_stays_out_of_a_pipe():
    env = {name: value for name, value in tiny_project.env().items() if name not in console.QUIET_ENV}
    proc = subprocess.run([sys.executable, "-c", GGUF_CONVERSION_BAR], env=env, capture_output=True, timeout=300)
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0 and "done" in stdout, stderr
    assert "\r" not in stdout + stderr and "Converting" not in stderr, stderr[-3000:]

def test_on_a_terminal_the_progress_bars_stay(monkeypatch):
    for name in console.QUIET_ENV:
        monkeypatch.delenv(name, raising=False)

    class Terminal:
        def isatty(self) -> bool:
            return True

    console.quiet_progress_unless_terminal(Terminal())
    assert console.progress_bars_on() and not any(name in os.environ for name in console.QUIET_ENV)


def test_a_report_with_only_new_timings_is_left_as_it_was(tmp_path):
    report = tmp_path / "train.json"
    write_json(report, {"macro_f1": 0.75, "wall_seconds": 91.2, "steps": [{"loss": 0.5, "duration_s": 1.5}]})
    before, stat = report.read_bytes(), report.stat()
    os.utime(report, ns=(stat.st_atime_ns, stat.st_mtime_ns - 10**9))  # older, so a rewrite would show
    old_mtime = report.stat().st_mtime_ns
    write_json(report, {"macro_f1": 0.75, "wall_seconds": 88.0, "steps": [{"loss": 0.5, "duration_s": 1.4}]})
    assert report.read_bytes() == before and report.stat().st_mtime_ns == old_mtime
    assert not [p.name for p in tmp_path.iterdir() if p.name != "train.json"]  # no temp file left beside it


def test_a_report_with_a_changed_result_or_key_is_rewritten(tmp_path):
    report = tmp_path / "train.json"
    write_json(report, {"macro_f1": 0.75, "wall_seconds": 91.2})
    write_json(report, {"macro_f1": 0.76, "wall_seconds": 91.2})
    assert json.loads(report.read_text())["macro_f1"] == 0.76
    write_json(report, {"macro_f1": 0.76, "wall_seconds": 91.2, "trainable_params": 12})  # `params` is no `_s`
    assert json.loads(report.read_text())["trainable_params"] == 12
    metrics = tmp_path / "metrics.json"
    write_metrics(metrics, {"macro_f1": 0.75, "tokens_per_s": 900.0})
    write_metrics(metrics, {"macro_f1": 0.75, "tokens_per_s": 910.0})
    assert json.loads(metrics.read_text())["tokens_per_s"] == 900.0  # metrics files follow the same rule
    write_metrics(metrics, {"macro_f1": 0.7, "tokens_per_s": 910.0})
    assert json.loads(metrics.read_text()) == {"macro_f1": 0.7, "tokens_per_s": 910.0}
