"""End to end on a second architecture: a tiny random Qwen2 (biases on q, k and v, tied embeddings) through every
stage of `dvc repro`, to `register`, and the registered classifier served in a fresh process.

Run with `make test` (or `pytest -m slow tests/e2e/test_second_architecture.py`). Quality is meaningless with random
weights; the run proves the stages, the planner's model of another architecture (its parameter counts are the
trained model's) and the registry. The 0.5 B Qwen2 shape, the same way: docs/PLAN.md, "Bigger models".
"""

from __future__ import annotations

import json
import sys

import pytest

from tests import tiny_project
from tests.e2e.test_pipeline import ran_stages
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow


def test_a_tiny_qwen2_goes_through_every_stage_and_is_served(tmp_path, smol_tokenizer):
    model_dir = build_tiny_model(tmp_path / "qwen2", smol_tokenizer, architecture="qwen2")
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen2"
    repo = tiny_project.build(tmp_path / "repo", model_dir, calibrate=False)
    out = tiny_project.run([sys.executable, "-m", "dvc", "repro"], repo)
    assert {"import_model", "plan", "train", "evaluate", "register"} <= set(ran_stages(out)), out
    reports = {name: json.loads((repo / f"reports/{name}.json").read_text())
               for name in ("import_model", "plan", "train", "evaluate", "register")}
    assert reports["import_model"]["architecture"] == "Qwen2ForCausalLM"
    planned = reports["plan"]["methods"][reports["plan"]["configured_method"]]
    # the planner counted the Qwen2 classifier it planned for exactly as training built it (the q/k/v biases too)
    assert (planned["total_params"], planned["trainable_params"]) == (
        reports["train"]["total_params"], reports["train"]["trainable_params"])
    assert reports["train"]["steps"] == 4 and 0 <= reports["evaluate"]["finetuned"]["macro_f1"] <= 1
    assert reports["register"]["version"] == 1

    served = tiny_project.run([sys.executable, "-c", (
        "import json, mlflow, pandas as pd\n"
        "m = mlflow.pyfunc.load_model('models:/frugaltune-sentiment@champion')\n"
        "print('LABELS ' + json.dumps(list(m.predict(pd.DataFrame({'text': ['good day', 'awful']})))))")], repo)
    labels = json.loads(next(line for line in served.splitlines() if line.startswith("LABELS "))[len("LABELS "):])
    assert len(labels) == 2 and set(labels) <= {"negative", "neutral", "positive"}, served[-2000:]
