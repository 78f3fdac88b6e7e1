"""The register stage: one version per training run, the alias moves only on improvement, and the champion loads
and predicts label names in a fresh process (and through `frugaltune predict`).

Real MLflow with a sqlite store in a temp project; a tiny random llama + LoRA adapter built offline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import mlflow
import pytest
import torch
from mlflow import MlflowClient

from frugaltune import cli, tracking
from frugaltune.serving import load_classifier, pyfunc
from frugaltune.serving.base import BASE_EXPERIMENT
from frugaltune import paths
from frugaltune import registry
from stages import register as register_stage
from frugaltune.config import Params, parse_params

LABELS = ["negative", "neutral", "positive"]
SENTENCES = ["i love this so much", "i hate that", "it is fine ok", "what a great day", "worst service ever"]
MODEL_NAME = "tiny-sentiment"
EXPERIMENT = "tiny"


def build_tiny_model(out_dir: Path, labels: Sequence[str], seed: int = 0) -> Path:
    """Write `<out_dir>/base` (random 2-layer llama classifier + tokenizer, HF dir, safetensors) and
    `<out_dir>/adapter` (LoRA on q/v with the `score` head in modules_to_save + tokenizer + labels.json), the
    layout import_model and train produce under `models/`. Offline: the tokenizer is trained in memory."""
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        num_labels=len(labels),
    )
    model = LlamaForSequenceClassification(config)
    base, adapter = out_dir / "base", out_dir / "adapter"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    lora = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["score"])
    get_peft_model(model, lora).save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    (adapter / "labels.json").write_text(json.dumps({"labels": list(labels)}), encoding="utf-8")
    return out_dir


@contextmanager
def mlflow_project(root: Path) -> Iterator[Path]:
    """cwd = `root`, MLflow on `root/mlflow.db`; afterwards MLflow's process-wide state and the env vars it
    exports (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_ID) are as before."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
        patch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        try:
            yield root
        finally:
            mlflow.set_tracking_uri(None)
            mlflow.tracking.fluent._active_experiment_id = None
            os.environ.pop("MLFLOW_EXPERIMENT_ID", None)


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def write_eval_data(labels: Sequence[str], rows: int = 6, seed: int = 0) -> None:
    """What ingest and tokenize leave for register: the label set and a tokenized test split (cwd = project)."""
    from datasets import Dataset, DatasetDict

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 12, (rows, 5), generator=generator).tolist()
    split = Dataset.from_dict({"input_ids": ids, "labels": [i % len(labels) for i in range(rows)]})
    paths.SPLITS_DIR.mkdir(parents=True, exist_ok=True)
    paths.LABELS.write_text(json.dumps({"labels": list(labels)}))
    DatasetDict({"train": split, "test": split}).save_to_disk(str(paths.TOKENIZED_DIR))


def fake_reports(macro_f1: float, run_id: str | None) -> None:
    """What train and evaluate would write."""
    paths.REPORTS.mkdir(exist_ok=True)
    train = {"train_loss": 0.5, **({"mlflow_run_id": run_id} if run_id else {})}
    paths.report("train").write_text(json.dumps(train))
    evaluation = {
        "baseline": {"accuracy": 0.33, "macro_f1": 0.2},
        "finetuned": {"accuracy": macro_f1 + 0.05, "macro_f1": macro_f1},
    }
    paths.report("evaluate").write_text(json.dumps(evaluation))


def training_run() -> str:
    """A finished MLflow run, as the train stage leaves it."""
    tracking.setup(EXPERIMENT)
    with mlflow.start_run(tags=tracking.run_tags()) as run:
        mlflow.log_metric("train_loss", 0.5)
    return run.info.run_id


def params(model_name: str = MODEL_NAME) -> Params:
    return parse_params({"register": {"model_name": model_name}, "train": {"experiment": EXPERIMENT}})


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A git project with a tiny model, a dvc.lock, raw data, and version 1 of MODEL_NAME registered."""
    root = tmp_path_factory.mktemp("project")
    build_tiny_model(root / paths.MODELS, LABELS)
    (root / paths.RAW_DIR).mkdir(parents=True)
    (root / paths.RAW_DIR / "tweets.csv").write_text("text,sentiment\ni love it,positive\n")
    (root / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  ingest:\n    cmd: python -m stages.ingest\n    outs:\n"
        "    - path: data/raw\n      hash: md5\n      md5: 0123456789abcdef0123456789abcdef.dir\n"
    )
    (root / paths.PARAMS).write_text(f"register:\n  model_name: {MODEL_NAME}\ntrain:\n  experiment: {EXPERIMENT}\n")
    _git(root, "init", "-q")
    _git(root, "add", "dvc.lock")
    _git(root, "commit", "-q", "-m", "init")
    with mlflow_project(root), pytest.MonkeyPatch.context() as patch:
        patch.setenv("FRUGALTUNE_BASE_CACHE", str(root / "base-cache"))  # never the user's ~/.cache
        write_eval_data(LABELS)
        fake_reports(0.6, training_run())
        register_stage.run(params())
        yield root


def test_first_registration_creates_version_1_tagged_and_champion(project: Path) -> None:
    report = json.loads(paths.report("register").read_text())
    assert report["version"] == 1 and report["promoted"] == 1 and report["champion_version"] == 1
    assert report["metric_value"] == report["champion_metric_value"] == 0.6

    version = MlflowClient().get_model_version_by_alias(MODEL_NAME, "champion")
    assert str(version.version) == "1"
    assert version.run_id == json.loads(paths.report("train").read_text())["mlflow_run_id"]
    assert len(version.tags["git_commit"]) == 40
    assert version.tags["data_hash"] == "0123456789abcdef0123456789abcdef.dir"
    assert float(version.tags["finetuned.macro_f1"]) == 0.6
    # A handful of tags on the version; the other metrics and the stage hashes are on its run.
    assert sorted(version.tags) == sorted(["git_commit", "data_hash", "finetuned.macro_f1", registry.MODEL_HASH_TAG,
                                           registry.EVAL_DATA_TAG, registry.LABELS_TAG, registry.TASK_TAG])
    run = MlflowClient().get_run(version.run_id)
    assert run.data.metrics["eval.baseline.accuracy"] == 0.33 and "dvc.ingest" in run.data.tags
    experiment = MlflowClient().get_experiment_by_name(EXPERIMENT)
    assert experiment.artifact_location == (project / "mlartifacts").as_uri()


def test_second_registration_of_the_same_run_reuses_the_version(project: Path) -> None:
    client = MlflowClient()
    run_id = json.loads(paths.report("train").read_text())["mlflow_run_id"]
    before = client.search_logged_models([client.get_run(run_id).info.experiment_id])

    report = register_stage.run(params())

    assert report["version"] == 1 and report["promoted"] == 1
    assert [str(v.version) for v in client.search_model_versions(f"name = '{MODEL_NAME}'")] == ["1"]
    after = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert len(after) == len(before) == 1
    assert client.get_run(run_id).info.status == "FINISHED"


def test_register_model_version_is_safe_to_retry(project: Path) -> None:
    client = MlflowClient()
    source = client.get_model_version(MODEL_NAME, "1")
    retried = registry.register_model_version(
        client, "retry-model", source.run_id, source.source, {"k": "v"}, model_id=source.model_id
    )
    again = registry.register_model_version(
        client, "retry-model", source.run_id, source.source, {"k": "v", "extra": "1"}, model_id=source.model_id
    )
    assert str(retried.version) == str(again.version) == "1"
    assert len(client.search_model_versions("name = 'retry-model'")) == 1
    assert again.tags == {"k": "v", "extra": "1"}


def test_alias_moves_only_to_a_better_version(project: Path) -> None:
    client, name = MlflowClient(), "alias-test"
    fake_reports(0.5, training_run())
    first = register_stage.run(params(name))
    fake_reports(0.7, training_run())
    better = register_stage.run(params(name))
    fake_reports(0.65, training_run())
    worse = register_stage.run(params(name))

    assert (first["version"], better["version"], worse["version"]) == (1, 2, 3)
    assert better["promoted"] == 1 and better["champion_version"] == 2
    assert worse["promoted"] == 0 and worse["champion_version"] == 2
    assert worse["metric_value"] == 0.65 and worse["champion_metric_value"] == 0.7
    assert str(client.get_model_version_by_alias(name, "champion").version) == "2"


def test_unknown_training_run_gets_one_new_run_however_often_it_is_retried(project: Path) -> None:
    fake_reports(0.55, "0" * 32)  # a run id this store has never seen
    first = register_stage.run(params("orphan"))
    again = register_stage.run(params("orphan"))
    assert first["run_id"] != "0" * 32
    assert again["run_id"] == first["run_id"] and again["version"] == first["version"] == 1


def test_unknown_metric_is_rejected_with_the_known_ones(project: Path) -> None:
    fake_reports(0.6, None)
    with pytest.raises(registry.RegisterError, match="Choose one of: accuracy, macro_f1"):
        register_stage.run(parse_params({"register": {"metric": "f1_macro"}}))


def test_champion_loads_and_predicts_label_names_in_a_fresh_process(project: Path) -> None:
    script = (
        "import sys, mlflow, pandas as pd\n"
        f"model = mlflow.pyfunc.load_model('models:/{MODEL_NAME}@champion')\n"
        "labels = model.predict(pd.DataFrame({'text': ['i love this', 'i hate that', 'unseen words here']}))\n"
        "print('LABELS=' + '|'.join(labels))\n"
        "print('FRUGALTUNE_IMPORTED=' + str(any(m.split('.')[0] == 'frugaltune' for m in sys.modules)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # An empty cache: the base model comes from the tracking store, stored there once, and is hash-checked.
    env["FRUGALTUNE_BASE_CACHE"] = str(project / "fresh-cache")
    # -I: no cwd or PYTHONPATH on sys.path; the default store (sqlite:///mlflow.db in cwd) is found by MLflow.
    done = subprocess.run([sys.executable, "-I", "-c", script], cwd=project, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    labels = lines["LABELS"].split("|")
    assert len(labels) == 3 and set(labels) <= set(LABELS)
    assert lines["FRUGALTUNE_IMPORTED"] == "False"  # the model carries its own serving code
    assert len([p for p in (project / "fresh-cache").iterdir() if not p.name.startswith(".")]) == 1


def test_the_base_model_is_stored_once_whatever_the_number_of_versions(project: Path) -> None:
    def weight_copies() -> int:
        return len([p for p in (project / "mlartifacts").rglob("model.safetensors")
                    if "adapter" not in p.parts])

    before = weight_copies()
    reports = [register_stage.run(params("store-once")) for _ in range(3) if fake_reports(0.5, training_run()) is None]
    assert [r["version"] for r in reports] == [1, 2, 3]
    assert before == weight_copies() == 1  # the fixture's version stored it; three more versions added no copy
    base_runs = MlflowClient().search_runs(
        [MlflowClient().get_experiment_by_name(BASE_EXPERIMENT).experiment_id])
    assert len(base_runs) == 1 and base_runs[0].data.tags["frugaltune.base_complete"] == "1"


def test_a_model_of_another_dataset_never_takes_the_champion_alias(project: Path) -> None:
    """Two datasets under one name: a higher macro-F1 on another test set with other labels does not win."""
    name = "two-datasets"
    fake_reports(0.6, training_run())
    first = register_stage.run(params(name))
    try:
        write_eval_data(["no", "yes"], rows=8, seed=1)
        fake_reports(0.9, training_run())
        other = register_stage.run(params(name))
        write_eval_data(LABELS, rows=6, seed=2)  # same labels, another test set: not comparable either
        fake_reports(0.95, training_run())
        other_split = register_stage.run(params(name))
    finally:
        write_eval_data(LABELS)
    assert first["champion_version"] == other["champion_version"] == other_split["champion_version"] == 1
    assert other["promoted"] == other_split["promoted"] == 0
    assert "register.model_name" in registry.update_alias(
        MlflowClient(), name, "champion", MlflowClient().get_model_version(name, str(other["version"])),
        "finetuned.macro_f1", True)[1]
    # Back on the first data, a better model does move it.
    fake_reports(0.7, training_run())
    better = register_stage.run(params(name))
    assert better["promoted"] == 1 and better["champion_version"] == 4


def test_cli_predict_prints_one_label_per_text(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    texts = ["i love this", "worst service ever"]
    assert cli.main(["predict", *texts]) == 0  # params.yaml names the model; @champion by default
    captured = capsys.readouterr()
    printed = captured.out.splitlines()
    assert len(printed) == 2 and set(printed) <= set(LABELS)
    # which model answered, on stderr (stdout stays the labels): the alias and the version it points at now
    champion = MlflowClient().get_model_version_by_alias(MODEL_NAME, "champion")
    assert f"models:/{MODEL_NAME}@champion = {MODEL_NAME} version {champion.version}" in captured.err

    assert cli.main(["predict", "--model-uri", f"models:/{MODEL_NAME}/1", "--json", texts[0]]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["text"] == texts[0] and row["label"] in LABELS


def test_cli_predict_without_a_store_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with mlflow_project(tmp_path):
        assert cli.main(["predict", "hello"]) == 1
    assert "dvc repro register" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()


def test_an_adapter_without_a_trained_head_is_refused(project: Path, tmp_path: Path) -> None:
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(project / paths.ADAPTER_DIR, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": None}))
    with pytest.raises(ValueError, match="does not save a classification head"):
        load_classifier(project / paths.BASE_MODEL, adapter)


def test_evaluation_metrics_are_run_metrics_and_the_experiment_is_model_development(project: Path) -> None:
    """The MLflow runs table sorts by macro-F1 (a metric, not only a version tag); the UI opens the experiment in its
    model-training view, not the GenAI one."""
    client = MlflowClient()
    fake_reports(0.62, training_run())
    run_id = register_stage.run(params("run-metrics"))["run_id"]
    metrics = client.get_run(run_id).data.metrics
    assert metrics["eval.finetuned.macro_f1"] == 0.62 and metrics["eval.baseline.accuracy"] == 0.33
    ranked = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                                order_by=["metrics.`eval.finetuned.macro_f1` DESC"])
    assert ranked and all("eval.finetuned.macro_f1" in r.data.metrics for r in ranked[:1])
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_alias_rule_reads_the_holders_run_when_its_version_lacks_the_metric_tag(project: Path) -> None:
    """Versions carry only the metric that decided; a later register.metric is compared on the runs' metrics."""
    name = "metric-switch"
    fake_reports(0.6, training_run())  # accuracy 0.65
    register_stage.run(params(name))
    fake_reports(0.55, training_run())  # accuracy 0.60: worse than v1's, which v1 has as a run metric only
    by_accuracy = parse_params({"register": {"model_name": name, "metric": "accuracy"},
                                "train": {"experiment": EXPERIMENT}})
    second = register_stage.run(by_accuracy)
    assert second["promoted"] == 0 and second["champion_version"] == 1


def test_each_task_gets_an_experiment_of_its_own_with_runs_named_after_what_ran(project: Path) -> None:
    """Without train.experiment the experiment is the registered model's; a run made by register says what ran."""
    tickets = parse_params({"register": {"model_name": "tiny-tickets"}, "data": {"source": "data/tickets.csv"}})
    assert tracking.experiment_name(tickets) == "tiny-tickets"
    fake_reports(0.6, None)  # no training run known: register makes one
    report = register_stage.run(tickets)
    client = MlflowClient()
    run = client.get_run(report["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "tiny-tickets"
    assert re.fullmatch(r"lora-tickets-[0-9a-f]{7}", run.info.run_name), run.info.run_name
    sentiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    assert not client.search_runs([sentiment], filter_string=f"attributes.run_id = '{run.info.run_id}'")


def test_the_runs_table_view_shows_the_headline_metric_and_key_params(project: Path) -> None:
    """The experiment holds the UI's view (columns), and runs_url opens the runs table in model-training mode."""
    client = MlflowClient()
    fake_reports(0.62, training_run())
    register_stage.run(params("view"))  # the view follows the last registration's register.metric
    experiment = client.get_experiment_by_name(EXPERIMENT)
    view = json.loads(experiment.tags[tracking.RUNS_VIEW_TAG])
    assert view["selectedColumns"][1:4] == ["metrics.`eval.finetuned.macro_f1`", "metrics.`eval.baseline.macro_f1`",
                                            "metrics.`final_loss`"]
    assert "params.`train.method`" in view["selectedColumns"]
    assert view["orderByKey"] == "metrics.`eval.finetuned.macro_f1`"
    url = tracking.runs_url("http://127.0.0.1:5000", experiment.experiment_id)
    assert url.endswith(f"/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"
                        "&viewStateShareKey=frugaltune")


def test_logging_a_version_prints_no_cloudpickle_notice_and_other_mlflow_warnings_still_show(
        project: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with mlflow_project(project), pytest.MonkeyPatch.context() as patch:
        patch.setenv("FRUGALTUNE_BASE_CACHE", str(project / "base-cache"))
        tracking.setup(EXPERIMENT)
        capfd.readouterr()
        with mlflow.start_run():
            pyfunc.log_model(project / paths.BASE_MODEL, project / paths.ADAPTER_DIR)
        logged = capfd.readouterr()
        logging.getLogger("mlflow.pyfunc").warning("another MLflow warning")
        after = capfd.readouterr()
    assert "CloudPickle" not in logged.out + logged.err, logged.err
    assert "another MLflow warning" in after.out + after.err  # the filter is gone once the model is logged


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def test_register_never_rewrites_a_version_s_metrics_from_other_files(project: Path, tmp_path: Path) -> None:
    """Train's run already has v1; an evaluation of other files (a damaged adapter) must not become v1's metric."""
    import shutil

    client = MlflowClient()
    v1 = client.get_model_version(MODEL_NAME, "1")
    metric_before = client.get_run(v1.run_id).data.metrics["eval.finetuned.macro_f1"]
    adapter = tmp_path / "adapter"
    shutil.copytree(project / paths.ADAPTER_DIR, adapter)
    _flip(adapter / "adapter_model.safetensors", 1000)
    content_hash = registry.model_hash(paths.BASE_MODEL, adapter)
    metrics = registry.metric_tags({"finetuned": {"macro_f1": 0.1999}})

    with pytest.raises(registry.RegisterError, match=rf"already has {MODEL_NAME} v1, registered from other files"):
        registry.register_adapter(client, params().register_, v1.run_id, paths.BASE_MODEL, adapter, metrics,
                                  registry.eval_data_tags("test"), content_hash)
    after = client.get_model_version(MODEL_NAME, "1")
    assert after.tags["finetuned.macro_f1"] == v1.tags["finetuned.macro_f1"]
    assert after.tags[registry.MODEL_HASH_TAG] == v1.tags[registry.MODEL_HASH_TAG]
    assert client.get_run(v1.run_id).data.metrics["eval.finetuned.macro_f1"] == metric_before


def registered_file(client: MlflowClient, version: str, name: str) -> Path:
    """The file `name` (`adapter/...`) of MODEL_NAME's `version` in the store's artifacts, where loads read it."""
    source = client.get_model_version(MODEL_NAME, version).source  # models:/<logged model id>, or the artifacts' URI
    if source.startswith("models:/"):
        source = client.get_logged_model(source.removeprefix("models:/")).artifact_location
    [found] = Path(urlparse(source).path).rglob(name)
    return found


def test_a_registered_version_with_a_damaged_file_is_refused_on_load(project: Path) -> None:
    """Any load of the version checks its files against the hashes it was logged with (the pyfunc's own
    load_context); `frugaltune predict` prints the message as one line (tests/faults/test_registry_store.py)."""
    tensors = registered_file(MlflowClient(), "1", "adapter/adapter_model.safetensors")
    original = tensors.read_bytes()
    damaged = bytearray(original)
    damaged[len(original) // 2] ^= 1
    tensors.write_bytes(bytes(damaged))
    try:
        with pytest.raises(ValueError) as refused:
            mlflow.pyfunc.load_model(f"models:/{MODEL_NAME}/1")
    finally:
        tensors.write_bytes(original)
    expected, found = (hashlib.sha256(data).hexdigest() for data in (original, bytes(damaged)))
    message = str(refused.value)
    assert message.startswith(f"adapter/adapter_model.safetensors of the model: sha256 {found}, logged as "
                              f"{expected}: the model's files are damaged, refusing to load it."), message
    assert "\n" not in message and "`dvc repro -f train register`" in message


def test_a_damaged_safetensors_header_is_one_line_naming_the_file(project: Path, tmp_path: Path) -> None:
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(project / paths.ADAPTER_DIR, adapter)
    tensors = adapter / "adapter_model.safetensors"
    _flip(tensors, 12)  # inside the JSON header that follows the 8-byte length
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tensors))}: its safetensors header cannot be read"):
        load_classifier(project / paths.BASE_MODEL, adapter)
