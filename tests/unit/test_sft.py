"""causal_lm (prompt -> response) pieces outside generation.py: pair ingest, the GX pair suite, prompt-masked
tokenization, token-weighted training, every method on the LM head, the planner's shapes.

Run with `make test-fast` (or `pytest tests/unit/test_sft.py`); a tiny random llama, a few seconds each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from frugaltune import generation
from frugaltune.config import parse_params
from frugaltune.data import DataSourceError, normalize_pairs, random_split
from frugaltune.models import load_for_causal_lm
from frugaltune.sft_data import arithmetic_rows, chat_rows, date_rows
from frugaltune.training.batching import IGNORE_INDEX, collate_targets, target_counts
from frugaltune.classify import collate
from frugaltune.training.inference import lm_loss, model_loss, shared_prefix_length
from frugaltune.training.loop import LoopConfig, train_classifier
from frugaltune.methods import NAMES as METHODS, get as method_named
from frugaltune.training.methods import prepare_model, save_trained, load_trained
from frugaltune.validation import ValidationRules, validate_splits

RULES = ValidationRules(min_text_chars=1, max_text_chars=200, min_confidence=0.0, max_bad_fraction=0.5,
                        max_duplicate_fraction=0.5, max_missing_confidence_fraction=1.0, max_mojibake_fraction=0.5,
                        min_class_fraction=0.0, drop_duplicates=True)


def sft_examples(tokenizer, n=24):
    templated = generation.uses_chat_template(tokenizer, "auto")
    ids, labels = [], []
    for row in arithmetic_rows(n, seed=1):
        prompt = generation.prompt_ids(tokenizer, row["prompt"], None, templated)
        response = generation.response_ids(tokenizer, row["response"])
        ids.append(prompt + response)
        labels.append([IGNORE_INDEX] * len(prompt) + response)
    return ids, labels


def test_the_readmes_dates_are_distinct_iso_answers_of_their_prompts_with_valid_near_misses():
    """The README's example set: each answer is the prompt's date in ISO form (its year, its month's name or number,
    its day), the prompts are distinct, and the candidates are real dates, the answer among them."""
    import calendar
    import datetime

    rows = date_rows(300, seed=3, candidates=4)
    assert len({row["prompt"] for row in rows}) == 300 and rows == date_rows(300, seed=3, candidates=4)
    styles = set()
    for row in rows:
        date = datetime.date.fromisoformat(row["response"])
        text = row["prompt"].removeprefix("Write this date as YYYY-MM-DD: ")
        assert str(date.year) in text and str(date.day) in text, row
        assert (calendar.month_name[date.month] in text or calendar.month_abbr[date.month] in text
                or f"{date.day:02d}.{date.month:02d}.{date.year}" == text), row
        assert row["response"] in row["candidates"] and len(set(row["candidates"])) == 4, row
        assert all(datetime.date.fromisoformat(c) for c in row["candidates"])
        styles.add("".join("9" if ch.isdigit() else ch for ch in text if not ch.isalpha()))
    assert len(styles) >= 6  # the styles are all drawn


def test_pairs_from_columns_and_from_chat_messages_and_their_errors(tmp_path):
    rows = pd.DataFrame(arithmetic_rows(5, candidates=3))
    pairs = normalize_pairs(rows, tmp_path / "a.jsonl", "prompt", "response", None, "candidates")
    assert list(pairs.columns) == ["source_row", "prompt", "response", "candidates"]
    assert json.loads(pairs["candidates"][0]) == rows["candidates"][0]

    chats = pd.DataFrame(chat_rows(3))
    pairs = normalize_pairs(chats, tmp_path / "c.jsonl", "prompt", "response", "messages", None)
    assert pairs["prompt"][0] == chats["messages"][0][0]["content"]
    assert json.loads(pairs["messages"][0]) == chats["messages"][0][:1]

    with pytest.raises(DataSourceError, match=r"c.jsonl: row 2, column 'messages'.*last message must be"):
        normalize_pairs(pd.DataFrame({"messages": [chat_rows(1)[0]["messages"], [{"role": "user", "content": "x"},
                                                                                 {"role": "user", "content": "y"}]]}),
                        tmp_path / "c.jsonl", "prompt", "response", "messages", None)
    with pytest.raises(DataSourceError, match=r"no column 'answer'.*task.response_column"):
        normalize_pairs(rows, tmp_path / "a.jsonl", "prompt", "answer", None, None)
    with pytest.raises(DataSourceError, match=r"row 1: column 'candidates' must be a non-empty list"):
        normalize_pairs(rows.assign(candidates=["not a list"] * 5), tmp_path / "a.jsonl", "prompt", "response",
                        None, "candidates")


def test_random_split_is_seeded_and_disjoint():
    frame = pd.DataFrame({"source_row": range(100), "prompt": [f"p{i}" for i in range(100)]})
    first, again = random_split(frame, 0.1, 0.2, 3), random_split(frame, 0.1, 0.2, 3)
    assert [len(first[s]) for s in ("train", "val", "test")] == [70, 10, 20]
    assert all(first[s].equals(again[s]) for s in first)
    assert set().union(*(set(f["source_row"]) for f in first.values())) == set(range(100))


def test_pair_suite_quarantines_blank_prompts_blank_responses_and_repeated_pairs():
    train = pd.DataFrame({"source_row": [0, 1, 2, 3, 4], "text": ["What is 2+2?", " ", "Hi", "What is 2+2?", "Q"],
                          "label": ["4", "x", "  ", "4", "A"]})
    test = pd.DataFrame({"source_row": [0, 1], "text": ["What is 2+2?", "Other"], "label": ["5", "B"]})
    outcome = validate_splits({"train": train, "test": test}, [], RULES, pairs=True)
    assert outcome.passed
    reasons = dict(zip(zip(outcome.frame["split"], outcome.frame["source_row"]), outcome.reasons))
    assert reasons[("train", 1)] == "prompt_empty"  # blank: the length checks see nothing to measure
    assert reasons[("train", 2)] == "response_empty"
    assert reasons[("train", 3)] == "duplicate_pair"  # the same prompt with another response is not a duplicate
    assert reasons[("test", 0)] == "" and reasons[("train", 0)] == ""
    assert "label_not_in_set" not in outcome.row_failures and "class_fraction" not in outcome.metrics()["total"]


def test_targets_pad_with_ignore_index_and_count_what_the_shifted_loss_sees():
    targets = [[IGNORE_INDEX, IGNORE_INDEX, 5, 2], [IGNORE_INDEX, 7, 2]]
    padded = collate_targets(targets, 5)
    assert padded.tolist() == [[-100, -100, 5, 2, -100], [-100, 7, 2, -100, -100]]
    assert target_counts(targets) == [2, 2] and target_counts([0, 2, 1]) == [1, 1, 1]


def test_micro_batches_weigh_by_response_tokens_so_splitting_a_batch_changes_nothing(tiny_model_dir, smol_tokenizer):
    """The step's loss is the mean over the whole batch's response tokens, however the batch is split."""
    ids, labels = sft_examples(smol_tokenizer)
    losses = []
    for micro in (8, 3):
        knobs = parse_params({"train": {"lora": {"dropout": 0.0}}}).train.lora  # no masks drawn per chunk
        model = prepare_model(tiny_model_dir, [], smol_tokenizer.pad_token_id, 0, method_named("lora"), knobs, task="causal_lm")
        cfg = LoopConfig.build(lr=1e-2, batch_size=8, max_steps=3, log_every=1, seed=0, micro_batch_size=micro)
        result = train_classifier(model, ids, labels, cfg, smol_tokenizer.pad_token_id, progress=False)
        losses.append([record["loss"] for record in result.history])
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    assert losses[0][-1] < losses[0][0]


@pytest.mark.slow  # six models trained: ~50 s
@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_the_lm_and_reloads_to_the_same_loss(method, tiny_model_dir, smol_tokenizer, tmp_path):
    ids, labels = sft_examples(smol_tokenizer, 16)
    knobs = getattr(parse_params({}).train, method)
    pad = smol_tokenizer.pad_token_id
    model = prepare_model(tiny_model_dir, [], pad, 0, method_named(method), knobs, task="causal_lm")
    assert not any(name.split(".")[0] in ("score", "classifier") for name, _ in model.named_parameters())
    before, count = lm_loss(model, ids, labels, pad, progress=False)
    assert count == sum(target_counts(labels))
    if method != "none":
        # 5e-2 is at the edge for DoRA on this tiny model: over seeds 0-3, 4 steps raised the loss once with our
        # shared dropout masks (10.756 -> 10.820), never with peft's nn.Dropout; at 2e-2 all eight runs went down.
        lr = {"full": 1e-3, "dora": 2e-2}.get(method, 5e-2)
        train_classifier(model, ids, labels, LoopConfig.build(lr=lr, batch_size=8, max_steps=4, seed=0), pad,
                         progress=False)
    after, _ = lm_loss(model, ids, labels, pad, progress=False)
    assert (after < before) if method != "none" else after == pytest.approx(before)
    save_trained(model, method_named(method), tmp_path)
    reloaded = load_trained(load_for_causal_lm(tiny_model_dir, pad, 0), tmp_path)
    # QLoRA's adapter is served on the full-precision base it was trained to approximate: close, not equal
    tolerance = 5e-3 if method == "qlora" else 1e-5
    assert lm_loss(reloaded, ids, labels, pad, progress=False)[0] == pytest.approx(after, abs=tolerance)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_loss_runs_the_lm_head_only_where_a_target_is_and_equals_transformers_loss(method, tiny_model_dir,
                                                                                        smol_tokenizer):
    """Same value and same gradients as `labels=` (which runs the head at every position), with logits for the
    response positions only."""
    ids, labels = sft_examples(smol_tokenizer, n=6)
    batch = collate(ids, smol_tokenizer.pad_token_id)
    target = collate_targets(labels, batch["input_ids"].shape[1])
    knobs = getattr(parse_params({}).train, method)
    model = prepare_model(tiny_model_dir, [], smol_tokenizer.pad_token_id, 0, method_named(method), knobs, task="causal_lm")
    model.eval()  # dropout off: the two forwards must see the same function (eval packs nothing: no 4-bit here)
    params = [p for p in model.parameters() if p.requires_grad]

    reference = model(**batch, labels=target).loss
    expected = torch.autograd.grad(reference, params)
    heads = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: heads.append(out.shape))
    ours = model_loss(model, batch, target)
    hook.remove()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(ours, params), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    counted = (target[:, 1:] != IGNORE_INDEX).any(dim=0).sum().item()
    assert heads == [torch.Size([len(ids), counted, model.config.vocab_size])]
    assert counted < batch["input_ids"].shape[1] // 2  # the prompts are most of the positions
    summed = model_loss(model, batch, target, reduction="sum")
    torch.testing.assert_close(summed, reference * sum(target_counts(labels)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_shared_prompt_prefix_read_once_gives_the_whole_batch_loss_and_gradients(method, tiny_model_dir,
                                                                                   smol_tokenizer):
    """The chat template's system turn, the same in every row, runs as one row and its keys/values are repeated:
    same loss and same gradients as the batch read in full, with the decoder seeing the prefix once."""
    ids, labels = sft_examples(smol_tokenizer, n=6)
    batch = collate(ids, smol_tokenizer.pad_token_id)
    target = collate_targets(labels, batch["input_ids"].shape[1])
    shared = shared_prefix_length(batch["input_ids"], target, 8)
    first_scored = int((target[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero()[0])
    assert 8 <= shared <= first_scored
    assert (batch["input_ids"][:, :shared] == batch["input_ids"][0, :shared]).all()
    assert not (batch["input_ids"][:, shared] == batch["input_ids"][0, shared]).all()  # the longest such prefix
    knobs = getattr(parse_params({}).train, method)
    model = prepare_model(tiny_model_dir, [], smol_tokenizer.pad_token_id, 0, method_named(method), knobs, task="causal_lm")
    model.eval()  # dropout off: both forwards compute the same function
    params = [p for p in model.parameters() if p.requires_grad]

    whole = model_loss(model, batch, target)
    expected = torch.autograd.grad(whole, params)
    rows = []
    hook = model.get_input_embeddings().register_forward_hook(lambda module, args, out: rows.append(out.shape[:2]))
    ours = model_loss(model, batch, target, shared=shared)
    hook.remove()
    assert rows == [torch.Size([1, shared]), torch.Size([len(ids), batch["input_ids"].shape[1] - shared])]
    torch.testing.assert_close(ours, whole, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(ours, params), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    summed = model_loss(model, batch, target, reduction="sum", shared=shared)
    torch.testing.assert_close(summed, whole * sum(target_counts(labels)), rtol=1e-5, atol=1e-5)


def test_no_shared_prefix_for_one_row_class_ids_short_prefixes_or_one_that_reaches_the_response():
    ids = torch.tensor([[5, 6, 7, 8, 1], [5, 6, 7, 9, 2]])
    scored = torch.tensor([[-100, -100, -100, 8, 1], [-100, -100, -100, 9, 2]])
    # tokens 0-2 are equal, but the logit at 2 predicts the first response token: it must be each row's own
    assert shared_prefix_length(ids, scored, 2) == 2
    assert shared_prefix_length(ids, scored, 3) == 0  # fewer than asked for
    assert shared_prefix_length(ids, scored, 0) == 0  # off
    assert shared_prefix_length(ids[:1], scored[:1], 2) == 0  # one row: nothing to share
    assert shared_prefix_length(ids, torch.tensor([0, 1]), 2) == 0  # a classifier's class ids
    early = torch.tensor([[-100, -100, 7, 8, 1], [-100, -100, 7, 9, 2]])
    assert shared_prefix_length(ids, early, 1) == 1  # the logit at 1 is scored: the shared part stops before it
    same = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    assert shared_prefix_length(same, torch.full((2, 4), -100), 2) == 3  # equal rows keep a token of their own


def test_planner_shapes_the_lm_head_over_the_vocabulary(tiny_model_dir):
    from frugaltune.planner.memory import memory_estimate, model_shape

    causal = model_shape(tiny_model_dir, 1, "lora", task="causal_lm")
    classifier = model_shape(tiny_model_dir, 3, "lora")
    assert causal.num_labels == json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    assert causal.trainable_params < classifier.trainable_params  # no new head to train
    memory = memory_estimate(causal, "lora", bf16=False, micro_batch=4, seq_len=32,
                                    gradient_checkpointing=False)
    assert memory["logits"] == 4 * 32 * causal.num_labels * 4 * 3


def test_task_params_are_typed():
    with pytest.raises(Exception, match=r"prompt_template must contain `\{text\}`"):
        parse_params({"task": {"type": "causal_lm", "prompt_template": "no placeholder"}})
    with pytest.raises(Exception, match=r"task.type"):
        parse_params({"task": {"type": "seq2seq"}})
    assert parse_params({"task": {"type": "causal_lm"}}).task.constrained is True
