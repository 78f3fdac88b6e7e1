"""What a user reads names the right thing: the command that continues an interrupted training names the pipeline
that ran it, the docs state no count of params keys that the params file contradicts, README.md stays a page,
docs/DECISIONS.md stays a record whose headings every quoted reference finds, and `make bench` runs every script
in benchmarks/ (and only those).

Run with:  pytest tests/unit/test_messages.py      (seconds: a few steps of a tiny random llama)
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import yaml

from frugaltune.models import load_for_classification, load_tokenizer
from frugaltune.training.loop import LoopConfig, train_classifier
from frugaltune.training.signals import TrainingInterrupted
from frugaltune.training.methods import apply_lora

ROOT = Path(__file__).resolve().parents[2]


def interrupted_training(model_dir: Path, checkpoints: Path) -> TrainingInterrupted:
    """A real training run SIGTERM'd at its second logged step, as `kill <pid>` does to the train stage."""
    tokenizer = load_tokenizer(model_dir)
    model = apply_lora(load_for_classification(model_dir, ["no", "yes"], tokenizer.pad_token_id, seed=0),
                       4, 8, 0.0, ["q_proj", "v_proj"])
    ids = tokenizer([f"row {i}" for i in range(16)])["input_ids"]

    def kill(record):
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingInterrupted) as caught:
        train_classifier(model, ids, [i % 2 for i in range(16)],
                         LoopConfig.build(lr=1e-2, batch_size=4, epochs=2, log_every=1, seed=0, checkpoint_every=2,
                                          checkpoint_dir=checkpoints), tokenizer.pad_token_id, on_log=kill,
                         progress=False)
    return caught.value


def test_a_sigterm_scheduling_training_names_scheduling_dvc_yaml(tiny_model_dir, tmp_path, monkeypatch):
    from stages.train import interrupted_message

    (tmp_path / ".dvc").mkdir()  # a DVC project; the scheduling pipeline's stages run in scheduling/
    (tmp_path / "scheduling").mkdir()
    (tmp_path / "scheduling/dvc.yaml").write_text("stages: {}\n")
    exc = interrupted_training(tiny_model_dir, tmp_path / "checkpoints")
    monkeypatch.chdir(tmp_path / "scheduling")
    message = interrupted_message(exc)
    assert message.startswith("train: SIGTERM at step") and "checkpoint" in message
    assert "`dvc repro scheduling/dvc.yaml`" in message, message
    monkeypatch.chdir(tmp_path)  # the root pipeline: plain `dvc repro`
    assert interrupted_message(exc).endswith("From the project root: `dvc repro`.")


def _leaves(tree) -> int:
    return sum(_leaves(value) for value in tree.values()) if isinstance(tree, dict) and tree else 1


def test_the_docs_state_no_params_key_count_the_params_file_contradicts():
    keys = _leaves(yaml.safe_load((ROOT / "params.yaml").read_text()))
    claim = re.compile(r"`?params\.yaml`?(?:'s| has)\s+(\d[\d,]*)\s+keys")
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if page.name == "DECISIONS.md":  # the decision record: figures of the run that decided
            continue
        for count in claim.findall(page.read_text()):
            assert int(count.replace(",", "")) == keys, f"{page.name} says params.yaml has {count} keys; it has {keys}"


def test_the_readme_stays_one_page_that_links_to_docs_for_the_detail():
    """README.md is the two commands and one short section per capability (issue 53: at most 350 lines); tables
    and measurements live in docs/. It had crept to 351 lines unnoticed."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines (at most 350): move the detail to a page in docs/"


def test_make_bench_runs_every_benchmark_in_benchmarks_and_benchmarks_md_lists_each():
    """benchmarks/ holds the comparisons `make bench` reruns, no more (issue 91: at most 15); an answered experiment
    leaves the tree. A script outside the Makefile's list would never be rerun, a name in it without a script would
    stop `make bench`."""
    listed = re.search(r"^BENCHMARKS := ((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert listed, "the Makefile has no `BENCHMARKS :=` list for `make bench`"
    in_make = listed.group(1).replace("\\\n", " ").split()
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "common"))
    assert sorted(in_make) == scripts, f"make bench runs {sorted(in_make)}; benchmarks/ holds {scripts}"
    assert len(scripts) <= 15, f"benchmarks/ holds {len(scripts)} scripts (at most 15): move answered ones out"
    page = (ROOT / "docs/BENCHMARKS.md").read_text()
    missing = [name for name in scripts if f"`{name}.py`" not in page]
    assert not missing, f"docs/BENCHMARKS.md does not list {missing}"


def test_decisions_is_a_record_of_at_most_600_lines():
    lines = (ROOT / "docs/DECISIONS.md").read_text().splitlines()
    assert len(lines) <= 600, f"docs/DECISIONS.md has {len(lines)} lines (at most 600): superseded entries go to git"


QUOTED = re.compile(r'DECISIONS(?:\.md)?[,:]?\s+("[^"]+"(?:\s*,\s*"[^"]+")*)')


def test_every_quoted_reference_to_decisions_names_a_heading_it_has():
    """Code comments and docs point at an entry by its heading ("docs/DECISIONS.md, \"oneDNN's caches\""); a
    rewritten record must keep every heading so named, or the pointer leads nowhere (budget.py's pointed at a heading
    that never existed)."""
    headings = [line.lstrip("#").strip() for line in (ROOT / "docs/DECISIONS.md").read_text().splitlines()
                if line.startswith("#")]
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for folder in ("frugaltune", "stages", "flows", "tests", "benchmarks", "docs"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh", ".yaml"))
    broken = []
    for path in files:
        text = re.sub(r"\n\s*#*\s*", " ", path.read_text())  # a quote wrapped over comment or docstring lines
        for group in QUOTED.findall(text):
            for quoted in re.findall(r'"([^"]+)"', group):
                prefix = quoted.rstrip(".… ").strip()
                if not any(heading.startswith(prefix) for heading in headings):
                    broken.append(f"{path.relative_to(ROOT)}: {quoted!r}")
    assert not broken, "no DECISIONS.md heading starts with: " + "; ".join(broken)
