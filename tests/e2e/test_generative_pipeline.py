"""End to end: `task.type: causal_lm` through `dvc repro`, on a tiny random llama and 300 synthetic pairs.

Run with `make test` (or `pytest -m slow tests/e2e/test_generative_pipeline.py`). The README's "Generative fine-tuning" example
in a temp git+DVC project: `python -m frugaltune.sft_data dates` writes prompt/response/candidates JSONL,
every stage runs (pair validation, prompt masking, the planner calibrating the LM head's cost, LoRA on the LM,
generative evaluation with the base model beside it, a generative pyfunc registered), the registered model
generates in a fresh process, with and without candidates, and a second `dvc repro` runs only the probe.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests import tiny_project
from tests.e2e.test_pipeline import ran_stages

pytestmark = pytest.mark.slow
MODEL_NAME = "frugaltune-dates"
PROMPT = "Write this date as YYYY-MM-DD: the 9th of July, 2031"


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model_dir) -> Path:
    repo = tiny_project.build(tmp_path_factory.mktemp("sft"), tiny_model_dir)
    tiny_project.run([sys.executable, "-m", "frugaltune.sft_data", "dates", "data/dates.jsonl",
                      "--rows", "300", "--candidates", "4"], repo)
    with (repo / "data/dates.jsonl").open("a") as fh:  # bad pairs the validation must quarantine
        fh.write(json.dumps({"prompt": PROMPT, "response": "   ", "candidates": ["2031-07-09", "2031-07-10"]}) + "\n")
        fh.write(json.dumps({"prompt": "", "response": "2031-07-09", "candidates": ["2031-07-09"]}) + "\n")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["task"].update({"type": "causal_lm", "candidates_column": "candidates", "max_new_tokens": 4})
    params["data"].update({"source": "data/dates.jsonl", "max_rows": None})
    params["validate"].update({"min_text_chars": 1, "min_class_fraction": 0.0})
    params["tokenize"]["max_length"] = 96
    params["register"].update({"model_name": MODEL_NAME, "metric": "exact_match"})
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return repo


def test_causal_lm_repro_trains_evaluates_registers_and_serves_then_is_a_no_op(project: Path):
    first = tiny_project.run([sys.executable, "-m", "dvc", "repro"], project)
    assert "train" in ran_stages(first) and "register" in ran_stages(first), first
    reports = {name: json.loads((project / f"reports/{name}.json").read_text())
               for name in ("ingest", "validate", "tokenize", "plan", "train", "evaluate", "register")}

    assert reports["ingest"]["task"] == "causal_lm" and reports["ingest"]["rows"] == 302
    checks = reports["validate"]["total"]["checks"]
    assert checks["response_empty"] == 1 and checks["prompt_empty"] == 1, checks
    quarantine = pd.read_parquet(project / "data/quarantine.parquet")
    assert set(quarantine.columns) >= {"prompt", "response", "reason"} and len(quarantine) == 2

    assert reports["tokenize"]["task"] == "causal_lm" and reports["tokenize"]["chat_template"] is True
    from datasets import load_from_disk

    train = load_from_disk(str(project / "data/tokenized"))["train"]
    example = train[0]
    prompt_len = example["prompt_length"]
    assert example["labels"][:prompt_len] == [-100] * prompt_len  # the loss sees the response only
    assert example["labels"][prompt_len:] == example["input_ids"][prompt_len:]

    assert reports["plan"]["configured_method"] == "lora" and "calibrated" in reports["plan"]["constants"]["source"]
    assert reports["train"]["steps"] == 4 and reports["train"]["final_loss"] > 0

    evaluation = reports["evaluate"]
    assert evaluation["task"] == "causal_lm" and evaluation["rows"] > 0
    for name in ("baseline", "finetuned"):
        assert evaluation[name]["answered_by"] == "constrained choice"
        assert evaluation[name]["valid_fraction"] == 1.0  # a choice is always one of the candidates
        assert 0 <= evaluation[name]["exact_match"] <= 1 and evaluation[name]["perplexity"] > 1
    assert evaluation["finetuned"]["loss"] != evaluation["baseline"]["loss"]  # the adapter changed the model
    metrics = json.loads((project / "reports/metrics/evaluate.json").read_text())
    assert {"exact_match", "baseline_exact_match", "token_f1", "loss"} <= set(metrics)
    manifest = json.loads((project / "models/adapter/labels.json").read_text())
    assert manifest["task"] == "causal_lm" and manifest["generation"]["max_new_tokens"] == 4
    assert reports["register"]["version"] == 1 and reports["register"]["metric"] == "exact_match"

    # The registered model, in a fresh process: free generation, and a choice among the given candidates
    served = tiny_project.run([sys.executable, "-c", (
        "import json, mlflow, pandas as pd\n"
        f"m = mlflow.pyfunc.load_model('models:/{MODEL_NAME}@champion')\n"
        f"free = m.predict(pd.DataFrame({{'prompt': ['{PROMPT}']}}))\n"
        f"chosen = m.predict(pd.DataFrame({{'prompt': ['{PROMPT}'], 'candidates': [['2031-07-09', '2031-09-07']]}}))\n"
        "print(json.dumps({'free': list(free), 'chosen': list(chosen)}))")], project)
    # the output is stdout + stderr: find the printed line rather than trusting it to come last
    answers = json.loads(next(line for line in served.splitlines() if line.startswith('{"free"')))
    assert len(answers["free"]) == 1 and isinstance(answers["free"][0], str)
    assert answers["chosen"][0] in ("2031-07-09", "2031-09-07")
    # bitsandbytes' offline notice (avx512_bf16 CPUs) is silenced in a process that never imports frugaltune too
    assert "kernels-community" not in served, served[-2000:]

    second = tiny_project.run([sys.executable, "-m", "dvc", "repro"], project)
    assert ran_stages(second) == ["probe"], second
