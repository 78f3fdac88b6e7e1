"""The serving loader (and so the registered pyfunc) handles methods that save plain tensors, not only adapters."""

import json

from frugaltune.models import load_for_classification, load_tokenizer
from frugaltune.serving import load_classifier
from frugaltune.classify import classify
from frugaltune.training.loop import LoopConfig, train_classifier
from frugaltune.training.methods import freeze_for, save_trained
from frugaltune.methods import get as method_named

LABELS = ["negative", "positive"]


def test_prelayer_tensors_load_for_serving_with_the_same_predictions(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    pad = tokenizer.pad_token_id
    model = freeze_for(method_named("prelayer"), load_for_classification(tiny_model_dir, LABELS, pad, seed=0))
    texts = [f"{'great lovely' if i % 2 else 'awful bad'} thing {i}" for i in range(16)]
    ids = tokenizer(texts)["input_ids"]
    train_classifier(model, ids, [i % 2 for i in range(16)], LoopConfig.build(lr=1e-2, batch_size=8, max_steps=2), pad,
                     progress=False)
    save_trained(model, method_named("prelayer"), tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "labels.json").write_text(json.dumps({"labels": LABELS, "max_length": 64, "method": "prelayer"}))
    expected = [LABELS[i] for i in classify(model, ids, pad).predictions]
    assert load_classifier(tiny_model_dir, tmp_path).predict(texts) == expected
