"""What a user reads names the right thing: the command that continues an interrupted training names the pipeline
that ran it, the docs state no count of params keys that the params file contradicts, and README.md stays a page.

Run with:  pytest tests/unit/test_messages.py      (seconds: a few steps of a tiny random llama)
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import yaml

from frugaltune.models import load_for_classification, load_tokenizer
from frugaltune.training.loop import LoopConfig, TrainingInterrupted, train_classifier
from frugaltune.training.methods import apply_lora

ROOT = Path(__file__).resolve().parents[2]


def interrupted_training(model_dir: Path, checkpoints: Path) -> TrainingInterrupted:
    """A real training run SIGTERM'd at its second logged step, as `kill <pid>` does to the train stage."""
    tokenizer = load_tokenizer(model_dir)
    model = apply_lora(load_for_classification(model_dir, ["no", "yes"], tokenizer.pad_token_id, seed=0),
                       4, 8, 0.0, ["q_proj", "v_proj"])
    ids = tokenizer([f"row {i}" for i in range(16)])["input_ids"]

    def kill(record):
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingInterrupted) as caught:
        train_classifier(model, ids, [i % 2 for i in range(16)],
                         LoopConfig(lr=1e-2, batch_size=4, epochs=2, log_every=1, seed=0, checkpoint_every=2,
                                    checkpoint_dir=checkpoints), tokenizer.pad_token_id, on_log=kill, progress=False)
    return caught.value


def test_a_sigterm_scheduling_training_names_scheduling_dvc_yaml(tiny_model_dir, tmp_path, monkeypatch):
    from stages.train import interrupted_message

    (tmp_path / ".dvc").mkdir()  # a DVC project; the scheduling pipeline's stages run in scheduling/
    (tmp_path / "scheduling").mkdir()
    (tmp_path / "scheduling/dvc.yaml").write_text("stages: {}\n")
    exc = interrupted_training(tiny_model_dir, tmp_path / "checkpoints")
    monkeypatch.chdir(tmp_path / "scheduling")
    message = interrupted_message(exc)
    assert message.startswith("train: SIGTERM at step") and "checkpoint" in message
    assert "`dvc repro scheduling/dvc.yaml`" in message, message
    monkeypatch.chdir(tmp_path)  # the root pipeline: plain `dvc repro`
    assert interrupted_message(exc).endswith("From the project root: `dvc repro`.")


def _leaves(tree) -> int:
    return sum(_leaves(value) for value in tree.values()) if isinstance(tree, dict) and tree else 1


def test_the_docs_state_no_params_key_count_the_params_file_contradicts():
    keys = _leaves(yaml.safe_load((ROOT / "params.yaml").read_text()))
    claim = re.compile(r"`?params\.yaml`?(?:'s| has)\s+(\d[\d,]*)\s+keys")
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if page.name == "DECISIONS.md":  # the dated lab notebook: figures of their day
            continue
        for count in claim.findall(page.read_text()):
            assert int(count.replace(",", "")) == keys, f"{page.name} says params.yaml has {count} keys; it has {keys}"


def test_the_readme_stays_one_page_that_links_to_docs_for_the_detail():
    """README.md is the two commands and one short section per capability (issue 53: at most 350 lines); tables
    and measurements live in docs/. It had crept to 351 lines unnoticed."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines (at most 350): move the detail to a page in docs/"
