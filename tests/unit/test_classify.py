"""The one classification evaluator (frugaltune/classify.py): the evaluate stage, the federated clients and server, and
batch serving score a row through it, and no other module runs a classification forward loop of its own."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from frugaltune.classify import classify
from frugaltune.federated import local
from frugaltune.models import load_for_classification, load_tokenizer
from frugaltune.serving.classifier import Classifier

ROOT = Path(__file__).resolve().parents[2]
LABELS = ["negative", "neutral", "positive"]


def _argmax_of_logits(function: ast.AST) -> bool:
    """Whether a function reads a model output's `.logits` and takes an argmax: a classification prediction."""
    attrs = {node.attr for node in ast.walk(function) if isinstance(node, ast.Attribute)}
    return "logits" in attrs and "argmax" in attrs


def test_only_the_evaluator_turns_logits_into_class_ids():
    found = []
    for folder in ("frugaltune", "stages", "flows", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "frugaltune" / "classify.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _argmax_of_logits(node):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not found, f"classification forward loops beside frugaltune.classify.classify: {found}"


def test_serving_the_federation_and_evaluation_score_the_same_rows_alike(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    pad = tokenizer.pad_token_id
    model = load_for_classification(tiny_model_dir, LABELS, pad, seed=5)
    texts = [("good " * (i % 7) + f"thing {i} " + "bad " * (i % 3)).strip() for i in range(23)]
    ids = tokenizer(texts, truncation=True, max_length=32)["input_ids"]
    targets = [i % 3 for i in range(23)]

    scores = classify(model, ids, pad, batch_size=4, labels=targets)
    assert scores.logits.shape == (23, 3) and scores.logits.dtype == np.float32
    served = Classifier(model, tokenizer, LABELS, max_length=32, batch_size=4).predict(texts)
    assert served == [LABELS[i] for i in scores.predictions]
    # the loss is the mean cross-entropy of those logits, whatever the batch size
    expected = float(torch.nn.functional.cross_entropy(torch.from_numpy(scores.logits), torch.tensor(targets)))
    assert scores.loss == pytest.approx(expected, rel=1e-6)
    assert classify(model, ids, pad, batch_size=23, labels=targets).loss == pytest.approx(expected, rel=1e-6)
    federated = local.evaluate(model, ids, targets, LABELS, pad, batch_size=4)
    assert federated["loss"] == round(scores.loss, 6)
    assert federated["accuracy"] == pytest.approx(float((scores.predictions == np.array(targets)).mean()))
    assert Classifier(model, tokenizer, LABELS, max_length=32, batch_size=4).predict([]) == []
