"""train.input_template: the wrap on token ids, its checks, the federation's rows, and serving applying the adapter's
template. Run with `pytest tests/unit/test_input_template.py`."""

import json

import pytest
from pydantic import ValidationError

from frugaltune.config import Params, TrainParams
from frugaltune.input_template import InputTemplate, from_manifest, sides, wrapped
from frugaltune.models import load_for_classification, load_tokenizer
from frugaltune.serving import load_classifier
from frugaltune.classify import classify
from frugaltune.training.loop import LoopConfig, train_classifier
from frugaltune.training.methods import freeze_for, save_trained
from frugaltune.recipes.train import adapter_manifest
from frugaltune.methods import get as method_named

LABELS = ["negative", "positive"]
TEMPLATE = "Tweet: {text}\nSentiment:"


def test_sides_need_the_placeholder_exactly_once():
    assert sides(TEMPLATE) == ("Tweet: ", "\nSentiment:")
    assert sides("{text}") == ("", "")
    for bad in ("Sentiment:", "{text} and {text}"):
        with pytest.raises(ValueError, match="exactly once"):
            sides(bad)
    with pytest.raises(ValidationError, match="exactly once"):
        TrainParams(input_template="no placeholder")


def test_a_generative_task_records_no_classifier_template(smol_tokenizer):
    params = Params.model_validate({"task": {"type": "causal_lm"}, "train": {"input_template": TEMPLATE}})
    assert "input_template" not in adapter_manifest(params, [], smol_tokenizer)
    classifier = Params.model_validate({"train": {"input_template": TEMPLATE}})
    assert adapter_manifest(classifier, LABELS, smol_tokenizer)["input_template"] == TEMPLATE


def test_the_federation_wraps_the_rows_its_clients_and_server_read(smol_tokenizer, tmp_path):
    from frugaltune.federated import rows  # what the federated stage writes its rows with
    from frugaltune.federated.local import read_examples

    split = {"input_ids": [smol_tokenizer("what a day")["input_ids"], list(range(40, 80))], "labels": [1, 0]}
    template = rows.classifier_template(Params.model_validate({"train": {"input_template": TEMPLATE}}),
                                         smol_tokenizer)
    rows.write_split(split, tmp_path / "train.parquet", template, 16)
    assert read_examples(tmp_path / "train.parquet") == (template.wrap_all(split["input_ids"], 16), [1, 0])
    assert len(read_examples(tmp_path / "train.parquet")[0][1]) == 16  # cut to max_length, suffix kept
    generative = Params.model_validate({"task": {"type": "causal_lm"}, "train": {"input_template": TEMPLATE}})
    assert rows.classifier_template(generative, smol_tokenizer) is None
    rows.write_split(split, tmp_path / "bare.parquet")
    assert read_examples(tmp_path / "bare.parquet")[0] == split["input_ids"]


def test_the_suffix_survives_truncation_and_specials_stay_outside():
    template = InputTemplate("T {text} S", before=(7,), after=(8, 9))
    assert template.wrap([1, 2, 3], 10) == [7, 1, 2, 3, 8, 9]
    assert template.wrap([1, 2, 3, 4, 5, 6], 6) == [7, 1, 2, 3, 8, 9]  # the row is cut, never the template
    with_specials = InputTemplate("T {text} S", before=(7,), after=(8,), lead=1, trail=1)
    assert with_specials.wrap([0, 1, 2, 3, 99], 6) == [0, 7, 1, 2, 8, 99]  # BOS first, EOS last
    with pytest.raises(ValueError, match="no room"):
        template.wrap([1], 3)
    assert wrapped([[1]], None, 3) == [[1]]


def test_build_tokenizes_each_side_once(smol_tokenizer):
    template = InputTemplate.build(TEMPLATE, smol_tokenizer)
    assert list(template.before) == smol_tokenizer("Tweet: ", add_special_tokens=False)["input_ids"]
    assert list(template.after) == smol_tokenizer("\nSentiment:", add_special_tokens=False)["input_ids"]
    row = smol_tokenizer("what a day")["input_ids"]
    assert template.wrap(row, 128)[len(template.before):-len(template.after)] == row
    assert from_manifest({"labels": LABELS}, smol_tokenizer) is None
    assert from_manifest({"input_template": TEMPLATE}, smol_tokenizer) == template


def test_serving_wraps_inputs_as_the_adapter_was_trained(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    pad, max_length = tokenizer.pad_token_id, 12
    template = InputTemplate.build(TEMPLATE, tokenizer)
    model = freeze_for(method_named("prelayer"), load_for_classification(tiny_model_dir, LABELS, pad, seed=0))
    texts = [f"{'great lovely wonderful' if i % 2 else 'awful bad terrible'} thing number {i} today" for i in range(16)]
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    rows = template.wrap_all(ids, max_length)
    assert all(len(row) == max_length for row in rows)  # each text is longer than the room: the cut is exercised
    train_classifier(model, rows, [i % 2 for i in range(16)], LoopConfig.build(lr=1e-2, batch_size=8, max_steps=2), pad,
                     progress=False)
    save_trained(model, method_named("prelayer"), tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "labels.json").write_text(json.dumps(
        {"labels": LABELS, "max_length": max_length, "method": "prelayer", "input_template": TEMPLATE}))
    classifier = load_classifier(tiny_model_dir, tmp_path)
    assert classifier.template == template
    assert classifier.predict(texts) == [LABELS[i] for i in classify(model, rows, pad).predictions]
