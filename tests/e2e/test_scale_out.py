"""End to end: the tiny pipeline against a real MLflow tracking server, then a second clone fed by a DVC remote.

Run with `make test` (or `pytest -m slow tests/e2e/test_scale_out.py`). README "Scaling out", as a team would:

- `make mlflow-server` (python -m flows.ui --mlflow-server --no-prefect) starts `mlflow server` on a free
  127.0.0.1 port, its sqlite store and proxied artifacts in a temp dir of its own (the team's machine).
- With `MLFLOW_TRACKING_URI=http://127.0.0.1:<port>`, `dvc repro` trains, registers v1 and sets @champion on the
  server; a new `train.lr` registers v2 and the champion gate decides. A fresh process elsewhere, with an empty
  base-model cache, loads `models:/frugaltune-sentiment@champion` through the server and predicts. The project
  directory holds no MLflow store at all.
- `dvc push` to a local DVC remote (the README's `dvc remote add` line); `git clone` anew, `dvc pull`, `dvc repro`
  reruns the probe alone: nothing is trained, evaluated or registered again.

The tests share the server and the project and run in file order.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests import readme_commands, tiny_project

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
MODEL_NAME = "frugaltune-sentiment"
DVC = [sys.executable, "-m", "dvc"]


@dataclass
class Server:
    url: str
    home: Path  # the launcher's working directory: mlflow-server/ (sqlite + artifacts) lands here
    log: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '(?:[\w/.-]+:)?([\w@.-]+)'", output)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("team_server")
    port = free_port()
    log = home / "launcher.log"
    with open(log, "wb") as out:  # `make mlflow-server` with this test's port; PYTHONPATH: `flows` from this checkout
        proc = subprocess.Popen([sys.executable, "-m", "flows.ui", "--mlflow-server", "--no-prefect",
                                 "--mlflow-port", str(port)], cwd=home, env=tiny_project.env(PYTHONPATH=str(ROOT)),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C stops it." not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.5)
        assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{port}" in log.read_text()
        yield Server(f"http://127.0.0.1:{port}", home, log)
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops the server's whole process group
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_model_dir) -> Path:
    repo = tiny_project.build(tmp_path_factory.mktemp("project"), tiny_model_dir, calibrate=False)  # not its subject
    for name in (".gitignore", ".dvcignore"):  # the project's: a clone lacks exactly what a real clone lacks
        shutil.copy(ROOT / name, repo / name)
    tiny_project.run(["git", "add", "-A"], repo)
    tiny_project.run(["git", "commit", "-qm", "ignore files"], repo)
    return repo


def champion(client, name: str = MODEL_NAME) -> str:
    return str(client.get_model_version_by_alias(name, "champion").version)


def test_pipeline_registry_and_champion_on_the_server_and_the_model_loads_through_it(server, repo, tmp_path):
    from mlflow import MlflowClient

    from frugaltune.serving.base import BASE_EXPERIMENT

    on_server = {"MLFLOW_TRACKING_URI": server.url}
    first = tiny_project.run([*DVC, "repro"], repo, **on_server)
    assert {"train", "evaluate", "register"} <= set(ran_stages(first)), first
    assert "tracking: warning" not in first, first  # the server proxies artifacts

    client = MlflowClient(server.url)
    assert [v.version for v in client.search_model_versions(f"name = '{MODEL_NAME}'")] == ["1"]
    assert champion(client) == "1"
    run_id = json.loads((repo / "reports/train.json").read_text())["mlflow_run_id"]
    assert client.get_run(run_id).data.metrics["eval.finetuned.macro_f1"] >= 0  # register logged into that run
    # the task's own experiment (named after its model) and the base models': artifacts proxied, no path on a disk
    for experiment in (MODEL_NAME, BASE_EXPERIMENT):
        assert client.get_experiment_by_name(experiment).artifact_location.startswith("mlflow-artifacts:")
    stored = list((server.home / "mlflow-server" / "artifacts").rglob("model.safetensors"))
    assert stored, "the base model is not in the server's artifact store"

    # Another learning rate: train -> evaluate -> register again, v2, and the gate decides on the server.
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["lr"] = params["train"]["lr"] * 4
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    second = tiny_project.run([*DVC, "repro"], repo, **on_server)
    assert "register" in ran_stages(second), second
    report = json.loads((repo / "reports/register.json").read_text())
    v1 = float(client.get_model_version(MODEL_NAME, "1").tags["finetuned.macro_f1"])
    assert report["version"] == 2 and report["metric_value"] == float(
        client.get_model_version(MODEL_NAME, "2").tags["finetuned.macro_f1"])
    expected = "2" if report["metric_value"] > v1 else "1"  # only a strictly better macro-F1 takes the alias
    assert champion(client) == expected == str(report["champion_version"]), (report, v1)

    # A fresh process on "another machine": no project, an empty base cache, only the server's URL.
    elsewhere, cache = tmp_path / "elsewhere", tmp_path / "base_cache"
    elsewhere.mkdir()
    loaded = tiny_project.run([sys.executable, "-c", (
        "import mlflow, pandas as pd\n"
        f"model = mlflow.pyfunc.load_model('models:/{MODEL_NAME}@champion')\n"
        "print(list(model.predict(pd.DataFrame({'text': ['what a lovely day', 'this is awful']}))))")],
        elsewhere, timeout=600, FRUGALTUNE_BASE_CACHE=str(cache), **on_server)
    assert re.search(r"\['(negative|neutral|positive)', '(negative|neutral|positive)'\]", loaded), loaded
    (base,) = [entry for entry in cache.iterdir() if not entry.name.startswith(".")]  # downloaded via the server
    assert (base / ".sha256").read_text() == base.name and (base / "config.json").is_file()

    leftovers = [p for d in (repo, elsewhere) for p in (d / "mlflow.db", d / "mlruns", d / "mlartifacts") if
                 p.exists()]
    assert not leftovers, f"a local MLflow store was written: {leftovers}"


def test_a_new_clone_pulls_from_the_dvc_remote_and_retrains_nothing(server, repo, tmp_path):
    on_server = {"MLFLOW_TRACKING_URI": server.url}
    tiny_project.run([*DVC, "repro"], repo, **on_server)  # the pipeline's outputs (a no-op after the test above)
    storage = tmp_path / "dvc-storage"
    add_remote = readme_commands.command("dvc remote add -d storage /")  # the README's line, this test's directory
    tiny_project.run(["bash", "-c", re.sub(r" /\S+", f" {storage}", add_remote, count=1)], repo)
    tiny_project.run(["bash", "-c", readme_commands.command('git commit -m "DVC remote"')], repo)
    tiny_project.run(["git", "add", "-A"], repo)
    tiny_project.run(["git", "commit", "-qm", "pipeline run, DVC remote"], repo)
    pushed = tiny_project.run([*DVC, "push"], repo)
    assert re.search(r"\d+ files? pushed", pushed), pushed

    clone = tmp_path / "clone"
    tiny_project.run(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    assert not (clone / "models/adapter").exists() and not (clone / "data/tokenized").exists()
    tiny_project.run([sys.executable, "-m", "frugaltune.offline", "dvc-template"], clone)  # `make install`
    pull = readme_commands.command("make install && dvc pull").split(" && ", 1)[1]  # the pipeline's outputs
    tiny_project.run(["bash", "-c", pull], clone)
    assert (clone / "models/adapter/labels.json").is_file() and (clone / "models/base/config.json").is_file()

    again = tiny_project.run([*DVC, "repro"], clone, **on_server)
    assert ran_stages(again) == ["probe"], again  # the machine's facts, read anew; the same machine: nothing else
    status = json.loads(tiny_project.run([*DVC, "status", "--json", "dvc.yaml"], clone).strip().splitlines()[-1])
    assert status == {"probe": ["always changed"]}, status
