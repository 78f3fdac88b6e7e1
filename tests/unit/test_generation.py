"""Prompt -> response models: prompt formatting, batched generation, constrained choice, answer metrics, the
logged generative pyfunc and `frugaltune export --merged`.

A tiny random llama with the real SmolLM2 tokenizer (conftest fixtures); a few seconds in all.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from frugaltune.generation import (
    choose,
    exact_match,
    format_messages_prompt,
    format_prompt,
    generate,
    load_scorer,
    normalize_answer,
    prompt_ids,
    response_ids,
    split_messages,
    token_f1,
    uses_chat_template,
)

EOS = 2  # SmolLM2's <|im_end|>
PROMPTS = ["What is two plus two?", "Name a colour.", "Say hi", "Write one long sentence about the sea and ships"]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny llama with its own random output layer: tied to the input embeddings, a random model only ever
    repeats the prompt's last token (a newline after the chat template: empty outputs that test nothing)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    torch.manual_seed(1)
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.5)
    out = tmp_path_factory.mktemp("tiny_lm")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_lm(lm_dir):
    return AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ids(smol_tokenizer):
    return [prompt_ids(smol_tokenizer, p, None, templated=True) for p in PROMPTS]


# ------------------------------------------------------------------------------------------------ prompts


def test_the_chat_template_is_used_when_the_tokenizer_has_one(smol_tokenizer):
    assert uses_chat_template(smol_tokenizer, "auto") and uses_chat_template(smol_tokenizer, "always")
    assert not uses_chat_template(smol_tokenizer, "never")
    with pytest.raises(ValueError, match="expected one of auto, always, never"):
        uses_chat_template(smol_tokenizer, "yes")


def test_always_without_a_template_says_what_to_do(smol_tokenizer, monkeypatch):
    monkeypatch.setattr(smol_tokenizer, "chat_template", None)
    assert not uses_chat_template(smol_tokenizer, "auto")
    with pytest.raises(ValueError, match="has no chat template. Use chat_template: auto"):
        uses_chat_template(smol_tokenizer, "always")


def test_templated_prompt_ends_with_the_assistant_turn_and_keeps_the_default_system(smol_tokenizer):
    text = format_prompt(smol_tokenizer, "Hi there", None, templated=True)
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # the template's own default system prompt
    custom = format_prompt(smol_tokenizer, "Hi there", "Be brief.", templated=True)
    assert custom.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert format_prompt(smol_tokenizer, "Hi there", "ignored", templated=False) == "Hi there"


def test_prompt_ids_hold_the_special_tokens_once_and_responses_end_with_eos(smol_tokenizer):
    ids = prompt_ids(smol_tokenizer, "Hi there", None, templated=True)
    text = format_prompt(smol_tokenizer, "Hi there", None, templated=True)
    assert ids == smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(smol_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    plain = prompt_ids(smol_tokenizer, "Hi there", None, templated=False)
    assert plain == smol_tokenizer("Hi there", add_special_tokens=True)["input_ids"]
    answer = response_ids(smol_tokenizer, "Four.")
    assert answer[-1] == smol_tokenizer.eos_token_id == 2
    assert smol_tokenizer.decode(answer[:-1]) == "Four."


def test_chat_rows_split_into_context_and_response(smol_tokenizer):
    row = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": "4"}]
    context, response = split_messages(row)
    assert context == row[:2] and response == "4"
    templated = format_messages_prompt(smol_tokenizer, context, templated=True)
    assert templated == format_prompt(smol_tokenizer, "2+2?", "Be brief.", templated=True)
    assert format_messages_prompt(smol_tokenizer, context, templated=False) == "Be brief.\n2+2?\n"


@pytest.mark.parametrize(("row", "message"), [
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}], "must be the 'assistant'"),
    ([{"role": "assistant", "content": "4"}], "at least two"),
    ("user: hi", "at least two"),
    ([{"role": "user", "content": "hi"}, {"content": "4"}], r"messages\[1\].*'role' and 'content'"),
    ([{"role": "human", "content": "hi"}, {"role": "assistant", "content": "4"}], "role 'human' is not one of"),
    ([{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "4"}], "content is list"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "4"}], "no 'user'"),
])
def test_malformed_chat_rows_are_refused_saying_what_is_wrong(row, message):
    with pytest.raises(ValueError, match=message):
        split_messages(row)


# ------------------------------------------------------------------------------------------------ generation


def test_greedy_generation_is_deterministic_and_left_padding_changes_nothing(tiny_lm, smol_tokenizer, ids):
    batched = generate(tiny_lm, smol_tokenizer, ids, max_new_tokens=6, batch_size=4)
    assert batched == generate(tiny_lm, smol_tokenizer, ids, max_new_tokens=6, batch_size=4)
    one_by_one = [generate(tiny_lm, smol_tokenizer, [p], max_new_tokens=6)[0] for p in ids]
    assert batched == one_by_one
    assert len(batched) == len(PROMPTS) and all(isinstance(text, str) for text in batched)
    assert any(batched)  # a random model still emits something within 6 tokens


def test_sampling_is_seeded_and_leaves_the_global_random_state_alone(tiny_lm, smol_tokenizer, ids):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = generate(tiny_lm, smol_tokenizer, ids, max_new_tokens=6, temperature=1.5, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    assert first == generate(tiny_lm, smol_tokenizer, ids, max_new_tokens=6, temperature=1.5, seed=7)
    greedy = generate(tiny_lm, smol_tokenizer, ids, max_new_tokens=6)
    others = {tuple(generate(tiny_lm, smol_tokenizer, ids, max_new_tokens=6, temperature=1.5, seed=s))
              for s in range(3)}
    assert len(others | {tuple(greedy)}) > 1  # sampling does sample


def _brute_force_score(model, tokenizer, prompt, candidate):
    answer = response_ids(tokenizer, candidate)
    tokens = torch.tensor([prompt + answer])
    with torch.no_grad():
        logprobs = model(input_ids=tokens).logits[0].log_softmax(-1)
    return sum(float(logprobs[len(prompt) - 1 + k, token]) for k, token in enumerate(answer))


def test_choose_scores_each_candidate_by_its_summed_log_probability(tiny_lm, smol_tokenizer, ids):
    candidates = [["four", "4", "five apples and a pear"], ["red"], ["hi", "hello", "hey you", "no"],
                  ["The sea is wide.", "Ships"]]
    best, scores = choose(tiny_lm, smol_tokenizer, ids, candidates, batch_size=3)
    assert [len(s) for s in scores] == [len(c) for c in candidates]
    for prompt, options, row, chosen in zip(ids, candidates, scores, best):
        expected = [_brute_force_score(tiny_lm, smol_tokenizer, prompt, option) for option in options]
        torch.testing.assert_close(torch.tensor(row), torch.tensor(expected), atol=1e-4, rtol=0)
        assert chosen == max(range(len(expected)), key=expected.__getitem__)
    assert best[1] == 0
    # One prompt at a time (no neighbour's tails or padding beside it): the same scores
    for prompt, options, row in zip(ids, candidates, scores):
        _, (alone,) = choose(tiny_lm, smol_tokenizer, [prompt], [options])
        torch.testing.assert_close(torch.tensor(alone), torch.tensor(row), atol=1e-5, rtol=0)


def test_choose_reads_a_shared_prefix_once_and_scores_as_if_each_prompt_were_read_whole(tiny_lm, smol_tokenizer,
                                                                                          ids):
    # A system turn + instruction that every prompt starts with, then prompts of different lengths (one is only a
    # token longer than the shared part), as the scheduling and classification prompts are.
    head = smol_tokenizer("You schedule jobs. Pick the job to run next, answer with its letter.")["input_ids"]
    prompts = [head + p for p in ids] + [head + ids[0][:1]]
    candidates = [["A", "B", "C"], ["B", "C"], ["A", "hello there"], ["C", "A", "B", "D"], ["A", "B"]]
    best, scores = choose(tiny_lm, smol_tokenizer, prompts, candidates, batch_size=2)
    whole_best, whole = choose(tiny_lm, smol_tokenizer, prompts, candidates, batch_size=2,
                               min_shared_prefix=10_000)  # read every prompt whole
    assert best == whole_best
    for prompt, options, row, again in zip(prompts, candidates, scores, whole):
        torch.testing.assert_close(torch.tensor(row), torch.tensor(again), atol=1e-4, rtol=0)
        expected = [_brute_force_score(tiny_lm, smol_tokenizer, prompt, option) for option in options]
        torch.testing.assert_close(torch.tensor(row), torch.tensor(expected), atol=1e-4, rtol=0)
    # Prompts equal to the shared part but for their last token still get that token as their own
    same = choose(tiny_lm, smol_tokenizer, [head, head], [["A", "B"], ["A", "B"]])[1]
    torch.testing.assert_close(torch.tensor(same[0]), torch.tensor(
        [_brute_force_score(tiny_lm, smol_tokenizer, head, o) for o in ("A", "B")]), atol=1e-4, rtol=0)


def test_the_head_gets_a_contiguous_input_and_no_hook_is_left_behind(tiny_lm, smol_tokenizer, ids):
    # A frozen head fed the last position's non-contiguous slice made torch copy its weight once per prompt
    # (generation.contiguous_head_input); the prompts differ in length, so the slice is a strided view.
    head = tiny_lm.get_output_embeddings()
    hooks_before = len(head._forward_pre_hooks)
    seen: list[bool] = []
    handle = head.register_forward_hook(lambda module, args, output: seen.append(args[0].is_contiguous()))
    try:
        choose(tiny_lm, smol_tokenizer, ids, [["A", "B"]] * len(ids), batch_size=len(ids))
        generate(tiny_lm, smol_tokenizer, ids, max_new_tokens=2, batch_size=len(ids))
    finally:
        handle.remove()
    assert seen and all(seen)
    assert len(head._forward_pre_hooks) == hooks_before


@contextmanager
def eos_bias(model, bias: float):
    """Add `bias` to the EOS logit: a random model then ends its answers within a few tokens, as a trained one does."""
    def hook(module, inputs, logits):
        return logits + bias * (torch.arange(logits.shape[-1]) == EOS)

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


def test_choose_agrees_with_greedy_generation_when_its_output_is_a_candidate(tiny_lm, smol_tokenizer, ids):
    prompt = ids[0]

    def greedy_tokens() -> list[int]:
        return tiny_lm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                pad_token_id=EOS, eos_token_id=EOS)[0, len(prompt):].tolist()

    # The case: greedy ends by itself, after some words. The EOS bias that gives it depends on the random model's
    # logit scale, so take the first that does (deterministic) rather than a number tuned to one model.
    for bias in [b / 2 for b in range(8, 41)]:
        with eos_bias(tiny_lm, bias):
            tokens = greedy_tokens()
        if tokens[-1] == EOS and len(tokens) > 2:
            break
    assert tokens[-1] == EOS and len(tokens) > 2, tokens
    with eos_bias(tiny_lm, bias):
        greedy = smol_tokenizer.decode(tokens[:-1])  # unstripped: it starts with a space, as the model wrote it
        assert generate(tiny_lm, smol_tokenizer, [prompt], max_new_tokens=8) == [greedy.strip()]
        assert response_ids(smol_tokenizer, greedy) == tokens  # the text round-trips to the same tokens
        others = ["Paris", greedy.rsplit(" ", 1)[0], greedy + " again", greedy.strip()]
        for candidates in ([greedy, *others], [*others, greedy]):
            best, _ = choose(tiny_lm, smol_tokenizer, [prompt], [candidates])
            assert candidates[best[0]] == greedy


def test_choose_refuses_mismatched_or_empty_candidate_lists(tiny_lm, smol_tokenizer, ids):
    with pytest.raises(ValueError, match="one list per prompt"):
        choose(tiny_lm, smol_tokenizer, ids, [["a"]])
    with pytest.raises(ValueError, match=r"candidates\[0\]"):
        choose(tiny_lm, smol_tokenizer, ids[:1], [[]])


# ------------------------------------------------------------------------------------------------ metrics


def test_answers_are_compared_normalized():
    assert normalize_answer("  The   Answer. ") == "the answer"
    assert normalize_answer("«Paris»!") == "paris"
    assert exact_match("Paris.", "paris") == 1.0 and exact_match("Paris, France", "Paris") == 0.0


def test_token_f1_is_squad_style():
    assert token_f1("the cat sat", "the cat sat") == 1.0
    assert token_f1("cat", "the cat") == pytest.approx(2 * 1.0 * 0.5 / 1.5)  # precision 1, recall 1/2
    assert token_f1("a a b", "a c") == pytest.approx(0.4)  # 1 common token: p = 1/3, r = 1/2
    assert token_f1("", "") == 1.0 and token_f1("", "x") == 0.0 and token_f1("dog", "cat") == 0.0


def test_a_scorer_loads_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_gen_metrics.py").write_text(
        "def score(prompt, prediction, reference):\n    return float(len(prediction) == len(reference))\n"
        "THRESHOLD = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_gen_metrics", raising=False)
    for dotted in ("my_gen_metrics:score", "my_gen_metrics.score"):
        assert load_scorer(dotted)("q", "abc", "xyz") == 1.0
    with pytest.raises(ValueError, match="has no 'missing'. Define `def missing"):
        load_scorer("my_gen_metrics:missing")
    with pytest.raises(ValueError, match="'THRESHOLD' is a int, not a function"):
        load_scorer("my_gen_metrics:THRESHOLD")
    with pytest.raises(ValueError, match="cannot import module 'no_such_metrics_module'"):
        load_scorer("no_such_metrics_module:score")
    with pytest.raises(ValueError, match="names no function"):
        load_scorer("my_gen_metrics")
    monkeypatch.delitem(sys.modules, "my_gen_metrics", raising=False)


# ------------------------------------------------------------------------------------------------ serving


def save_lora_adapter(base_dir: Path, out: Path, seed: int = 0) -> Path:
    """A LoRA adapter on q/v of the tiny llama, made non-trivial (peft starts B at zero), saved as train saves it:
    adapter + tokenizer + labels.json for the causal_lm task."""
    from peft import LoraConfig, TaskType, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8,
                                             target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    (out / "labels.json").write_text(json.dumps({
        "task": "causal_lm", "labels": [], "max_length": 128, "method": "lora",
        "generation": {"max_new_tokens": 5, "temperature": 0.0, "system": None, "templated": True},
    }))
    return out


@pytest.fixture(scope="module")
def adapter_dir(lm_dir, tmp_path_factory) -> Path:
    return save_lora_adapter(lm_dir, tmp_path_factory.mktemp("adapter"))


def test_generator_formats_prompts_as_trained_and_answers_with_the_adapter(lm_dir, adapter_dir, smol_tokenizer):
    from peft import PeftModel

    from frugaltune.serving import load_generator
    from frugaltune.serving.files import read_labels, read_task

    generator = load_generator(lm_dir, adapter_dir)
    assert isinstance(generator.model, PeftModel) and read_task(adapter_dir) == "causal_lm"
    ids = [prompt_ids(smol_tokenizer, p, None, templated=True) for p in PROMPTS[:2]]
    expected = generate(generator.model, smol_tokenizer, ids, max_new_tokens=5)
    assert generator.predict(PROMPTS[:2]) == expected
    base_only = generate(AutoModelForCausalLM.from_pretrained(lm_dir).eval(), smol_tokenizer, ids, max_new_tokens=5)
    assert expected != base_only  # the adapter is applied
    chosen = generator.predict(PROMPTS[:2], [["red", "blue"], None])
    assert chosen[0] in ("red", "blue") and chosen[1] == expected[1]
    assert len(load_generator(lm_dir, adapter_dir, max_new_tokens=2).predict(PROMPTS[:1])[0].split()) <= 2
    with pytest.raises(ValueError, match="expected"):
        read_labels(adapter_dir)  # no label names: a classification loader refuses it


def _local_store(monkeypatch, tmp_path) -> str:
    """This test's own sqlite MLflow store (and base cache) in tmp_path, as the tracking URI; returns the URI."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FRUGALTUNE_BASE_CACHE", str(tmp_path / "base-cache"))
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    return uri


@pytest.mark.slow  # MLflow logging + a fresh interpreter: ~25 s
def test_logged_generative_model_loads_without_frugaltune_and_generates(lm_dir, adapter_dir, tmp_path, monkeypatch,
                                                                         capsys):
    import os
    import subprocess

    import mlflow
    import pandas as pd

    from frugaltune.serving import load_generator, pyfunc

    uri = _local_store(monkeypatch, tmp_path)
    try:
        mlflow.set_experiment("gen")
        with mlflow.start_run():
            info = pyfunc.log_model(lm_dir, adapter_dir, task="causal_lm", example_texts=PROMPTS[:2])
        model = mlflow.pyfunc.load_model(info.model_uri)
        expected = load_generator(lm_dir, adapter_dir).predict(PROMPTS[:3])
        assert model.predict(pd.DataFrame({"prompt": PROMPTS[:3]})) == expected
        chosen = model.predict(pd.DataFrame({"prompt": PROMPTS[:2], "candidates": [["red", "blue"], ["hi", "yo"]]}))
        assert chosen[0] in ("red", "blue") and chosen[1] in ("hi", "yo")
        short = model.predict(pd.DataFrame({"prompt": PROMPTS[:1]}), params={"max_new_tokens": 1})
        assert short[0] == expected[0].split(" ")[0] or len(short[0].split()) <= 1

        from frugaltune import cli

        assert cli.main(["predict", "--model-uri", info.model_uri, "--json", *PROMPTS[:2]]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert rows == [{"prompt": p, "response": r} for p, r in zip(PROMPTS[:2], expected[:2])]
    finally:
        mlflow.set_tracking_uri(None)
        mlflow.tracking.fluent._active_experiment_id = None
        os.environ.pop("MLFLOW_EXPERIMENT_ID", None)

    # A fresh process where `frugaltune` cannot be imported: from /tmp, -I (no cwd, no PYTHONPATH on sys.path).
    script = (
        "import sys, json, mlflow, pandas as pd\n"
        f"mlflow.set_tracking_uri({uri!r})\n"
        f"model = mlflow.pyfunc.load_model({info.model_uri!r})\n"
        f"print('OUT=' + json.dumps(list(model.predict(pd.DataFrame({{'prompt': {PROMPTS[:3]!r}}})))))\n"
        "print('FRUGALTUNE_IMPORTED=' + str(any(m.split('.')[0] == 'frugaltune' for m in sys.modules)))\n"
        "import importlib.util; print('IMPORTABLE=' + str(importlib.util.find_spec('frugaltune') is not None))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "PYTHONPATH"}
    env["FRUGALTUNE_BASE_CACHE"] = str(tmp_path / "fresh-cache")  # the base comes from the store, hash-checked
    done = subprocess.run([sys.executable, "-I", "-c", script], cwd="/tmp", env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert json.loads(lines["OUT"]) == expected
    assert lines["FRUGALTUNE_IMPORTED"] == "False"


# ------------------------------------------------------------------------------------------------ export


def test_export_merged_writes_a_plain_model_with_the_adapters_logits(lm_dir, adapter_dir, tmp_path, capsys):
    from transformers import pipeline

    from frugaltune import cli
    from frugaltune.serving.generator import load_causal_lm

    out = tmp_path / "merged"
    assert cli.main(["export", "--merged", str(out), "--adapter", str(adapter_dir), "--base", str(lm_dir)]) == 0
    assert "text-generation" in capsys.readouterr().out
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    # readable as any file the user writes (safetensors itself writes 0600): a server or a colleague can load it
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()} == {f.name: "0o644" for f in out.iterdir()}
    peft_model, tokenizer = load_causal_lm(lm_dir, adapter_dir)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.tensor([prompt_ids(tokenizer, PROMPTS[0], None, templated=True)])
    # In float64 the comparison sees the merge (weights rounded once to float32 when saved), not float32's
    # different summation orders for W x + B A x and (W + B A) x, which reach 2e-5 on logits of size ~10.
    with torch.no_grad():
        torch.testing.assert_close(merged.double()(input_ids=tokens).logits,
                                   peft_model.double()(input_ids=tokens).logits, atol=1e-5, rtol=0)
    assert pipeline("text-generation", model=str(out), device="cpu").model.__class__.__name__ == "LlamaForCausalLM"

    assert cli.main(["export", "--merged", str(out), "--adapter", str(adapter_dir), "--base", str(lm_dir)]) == 1
    assert "exists and is not an empty directory" in capsys.readouterr().err


def test_the_merged_export_answers_in_transformers_pipeline_as_frugaltune_does(lm_dir, adapter_dir, tmp_path,
                                                                               capsys):
    """The pipeline call the export prints (chat messages, for a model trained on chat-templated prompts) gives the
    answers serving gives: the same prompt format, greedy, the trained length, stopping at EOS."""
    from transformers import pipeline

    from frugaltune import cli
    from frugaltune.serving import load_generator

    out = tmp_path / "merged"
    assert cli.main(["export", "--merged", str(out), "--adapter", str(adapter_dir), "--base", str(lm_dir)]) == 0
    printed = capsys.readouterr().out
    assert '[{"role": "user", "content": "..."}]' in printed and '["generated_text"][-1]["content"]' in printed
    pipe = pipeline("text-generation", model=str(out), device="cpu")
    answers = [pipe([{"role": "user", "content": p}])[0]["generated_text"][-1]["content"] for p in PROMPTS[:3]]
    # the same tokens; serving strips the decoded text's surrounding whitespace
    served = load_generator(lm_dir, adapter_dir).predict(PROMPTS[:3])
    assert [a.strip() for a in answers] == served
    # A plain string: the exported tokenizer wraps it in the template it was trained with (it went in raw, and the
    # model, trained to answer after the assistant turn, ended at once with an empty answer)
    plain = [pipe(p, return_full_text=False)[0]["generated_text"] for p in PROMPTS[:3]]
    assert [a.strip() for a in plain] == served
    assert pipe.tokenizer(PROMPTS[0])["input_ids"] == prompt_ids(pipe.tokenizer, PROMPTS[0], None, templated=True)


def test_a_model_trained_on_a_label_set_answers_with_one_of_its_labels(lm_dir, adapter_dir, tmp_path):
    """A labelled dataset as prompts (task.prompt_template): evaluation chooses among the labels, so serving does
    too unless the caller gives other candidates; free generation would answer anything."""
    import shutil

    from frugaltune.serving import load_generator

    labelled = tmp_path / "labelled"
    shutil.copytree(adapter_dir, labelled)
    manifest = json.loads((labelled / "labels.json").read_text())
    (labelled / "labels.json").write_text(json.dumps({**manifest, "labels": ["red", "blue"]}))
    generator = load_generator(lm_dir, labelled)
    assert set(generator.predict(PROMPTS)) <= {"red", "blue"}
    assert generator.predict(PROMPTS[:1], [["hi", "yo"]])[0] in ("hi", "yo")
    assert load_generator(lm_dir, adapter_dir).predict(PROMPTS[:2]) != ["red", "blue"]  # no label set: generated


@pytest.mark.slow  # MLflow registration + loads: ~30 s
def test_predict_says_which_version_it_loaded_and_chooses_among_candidates(lm_dir, adapter_dir, tmp_path,
                                                                            monkeypatch, capsys):
    """`frugaltune predict` names the version an alias resolved to (stderr; stdout stays one answer per line),
    `--candidates` picks the likeliest of them as evaluation does, and `export --model-uri` merges a registered
    version (a `dvc exp run --temp` experiment leaves no adapter in the workspace)."""
    import os

    import mlflow

    from frugaltune import cli
    from frugaltune.serving import pyfunc
    from frugaltune.serving.generator import load_causal_lm

    _local_store(monkeypatch, tmp_path)
    try:
        mlflow.set_experiment("gen")
        with mlflow.start_run():
            info = pyfunc.log_model(lm_dir, adapter_dir, task="causal_lm", example_texts=PROMPTS[:2])
        version = mlflow.register_model(info.model_uri, "gen")
        mlflow.MlflowClient().set_registered_model_alias("gen", "champion", version.version)
        capsys.readouterr()
        assert cli.main(["predict", "--model-uri", "models:/gen@champion", "--candidates", "red,blue", *PROMPTS[:2]]) == 0
        captured = capsys.readouterr()
        assert set(captured.out.splitlines()) <= {"red", "blue"} and len(captured.out.splitlines()) == 2
        assert f"models:/gen@champion = gen version {version.version}" in captured.err
        assert cli.main(["predict", "--model-uri", "models:/gen@champion", "--candidates", '["1,000", "10"]',
                         PROMPTS[0]]) == 0
        assert capsys.readouterr().out.strip() in ("1,000", "10")

        out = tmp_path / "merged"
        assert cli.main(["export", "--model-uri", "models:/gen@champion", "--merged", str(out)]) == 0
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
        peft_model, tokenizer = load_causal_lm(lm_dir, adapter_dir)
        tokens = torch.tensor([prompt_ids(tokenizer, PROMPTS[0], None, templated=True)])
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=tokens).logits,
                                       peft_model.double()(input_ids=tokens).logits, atol=1e-5, rtol=0)
    finally:
        mlflow.set_tracking_uri(None)
        mlflow.tracking.fluent._active_experiment_id = None
        os.environ.pop("MLFLOW_EXPERIMENT_ID", None)


def test_export_merged_of_a_classifier_keeps_its_labels(tiny_model_dir, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from frugaltune import cli
    from frugaltune.models import load_for_classification
    from frugaltune.serving import load_classifier

    labels = ["negative", "positive"]
    model = load_for_classification(tiny_model_dir, labels, pad_token_id=2, seed=0)
    lora = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["score"])
    adapter = tmp_path / "adapter"
    get_peft_model(model, lora).save_pretrained(adapter)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(adapter)
    (adapter / "labels.json").write_text(json.dumps({"labels": labels}))
    out = tmp_path / "merged"
    assert cli.main(["export", "--merged", str(out), "--adapter", str(adapter), "--base", str(tiny_model_dir)]) == 0
    merged = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert merged.config.id2label == {0: "negative", 1: "positive"}
    tokens = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=tokens).logits,
                                   load_classifier(tiny_model_dir, adapter).model(input_ids=tokens).logits,
                                   atol=1e-5, rtol=0)
