"""Bad params files and the security rows: what `load_params` refuses before any compute, and what the code never
does (remote code, non-loopback servers, unsafe unpickling). In-process, seconds.

Run with `make test` or `pytest -m slow tests/faults`. Each test is a row of docs/FAULTS.md (see table.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import yaml

from frugaltune.config import ParamsError, load_params
from frugaltune.training import checkpoint
from tests.faults.helpers import ROOT, base_params
from tests.faults.table import fault

pytestmark = pytest.mark.slow


def refused(tmp_path: Path, text: str, *needles: str) -> str:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError) as error:
        load_params(path)
    message = str(error.value)
    for needle in needles:
        assert needle in message, message
    return message


def with_train(**changes) -> str:
    raw = base_params()
    raw["train"].update(changes)
    return yaml.safe_dump(raw, sort_keys=False)


@fault("params", "a misspelled key", "clear error naming the key and the closest known one (`Did you mean`)",
       "nothing run")
def test_misspelled_key(tmp_path):
    raw = base_params()
    raw["train"]["lora"]["rnk"] = raw["train"]["lora"].pop("r")
    refused(tmp_path, yaml.safe_dump(raw), "train.lora.rnk", "Did you mean", "train.lora.r")


@fault("params", "a value of the wrong type", "clear error naming the key, the value and the type expected",
       "nothing run")
def test_wrong_type(tmp_path):
    refused(tmp_path, with_train(epochs="three"), "train.epochs", "three")


@fault("params", "a negative learning rate", "clear error naming `train.lr` and the bound", "nothing run")
def test_negative_lr(tmp_path):
    refused(tmp_path, with_train(lr=-0.001), "train.lr")


@fault("params", "batch size 0", "clear error naming `train.batch_size` and the bound", "nothing run")
def test_batch_size_zero(tmp_path):
    refused(tmp_path, with_train(batch_size=0), "train.batch_size")


@fault("params", "an unknown method", "clear error naming `train.method` and the methods there are", "nothing run")
def test_unknown_method(tmp_path):
    message = refused(tmp_path, with_train(method="lorax"), "train.method", "lorax")
    assert "qlora" in message and "dora" in message


@fault("params", "a YAML syntax error", "clear error: the file is not valid YAML, with the line", "nothing run")
def test_yaml_syntax_error(tmp_path):
    text = with_train().replace("train:\n", "train:\n  method: [lora\n", 1)
    message = refused(tmp_path, text, "params.yaml", "not valid YAML")
    assert re.search(r"line \d+", message), message


@fault("params", "a duplicated key, at any depth (issue #19)", "clear error naming the key and both line numbers",
       "nothing run")
def test_duplicated_key(tmp_path):
    text = (ROOT / "params.yaml").read_text() + "\ncommon:\n  seed: 7\n"
    message = refused(tmp_path, text, "common", "line")
    assert re.search(r"lines \d+ and \d+", message), message
    nested = with_train().replace("train:\n", "train:\n  lr: 0.5\n", 1)
    refused(tmp_path, nested, "lr")


@fault("security", "checkpoint state holding a pickled object", "refused (`torch.load(weights_only=True)`), naming "
       "the file", "no code from the checkpoint directory runs")
def test_pickled_checkpoint_state_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("this ran from a checkpoint",))

    step = tmp_path / "step-3"
    step.mkdir()
    torch.save({"python": Payload()}, step / "rng.pt")
    with pytest.raises(checkpoint.CheckpointRefused, match="rng.pt"):
        checkpoint._load_tensors_only(step / "rng.pt")


def _python_files():
    for folder in ("frugaltune", "stages", "flows"):
        yield from (ROOT / folder).rglob("*.py")


@fault("security", "remote code in a model directory", "never run: no call passes `trust_remote_code=True`",
       "a model dir with custom code loads as its declared architecture or fails")
def test_no_trust_remote_code():
    offenders = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
    assert not offenders, offenders


@fault("security", "servers reachable from the network", "never: the Prefect server and the MLflow UI bind "
       "127.0.0.1; no code binds 0.0.0.0", "nothing exposed")
def test_servers_bind_loopback():
    from flows import ui

    assert ui.HOST == "127.0.0.1"
    for path in _python_files():
        assert "0.0.0.0" not in path.read_text(), path
    for line in (ROOT / "README.md").read_text().splitlines():
        if "mlflow models serve" in line or "--host" in line:
            assert "-h 127.0.0.1" in line or "--host 127.0.0.1" in line, line


@fault("security", "a registered model from an untrusted registry", "the README says a pyfunc is code (cloudpickle) "
       "and must come from a registry you trust", "documented")
def test_readme_says_a_pyfunc_is_code():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"pyfunc.{0,200}cloudpickle.{0,300}trust", readme, re.S), "README: the pyfunc-is-code warning"
