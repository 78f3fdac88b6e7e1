"""Quality per minute: train + evaluate one variant of the pipeline's training params, on the pipeline's data and split.

    python benchmarks/quality_sweep.py NAME train.epochs=1.4 train.lora.r=16 ...     # one variant
    python benchmarks/quality_sweep.py --table                                         # all variants run so far

Each variant runs the plan, train and evaluate stages themselves (`python -m stages.plan`, `python -m stages.train`,
then `python -m stages.evaluate`) in a scratch project (a temporary directory with symlinks to this checkout's models/base,
data/tokenized, data/splits and the hardware, kernels and import_model reports) whose params.yaml is this one's
with the overrides applied. Its plan is the variant's own, analytic (`probe.calibrate: false` unless an override
sets it): the machine decisions the train stage reads (frugaltune.resolve decides nothing) and the micro-batch
that fits; its MLflow run goes to this project's store. The adapter is copied to models/sweep/NAME and the
reports to reports/sweep/. One line per variant goes to reports/sweep/quality_sweep.jsonl: training wall seconds,
useful tokens/s, test macro-F1 and accuracy, and the CPU it ran on. Needs the pipeline's data (`dvc repro
tokenize`).

Two variants may run at once with `train.threads=1` each (2 cores): their wall times then describe that setting,
so the chosen one is re-timed alone by the pipeline itself (`dvc repro`) before its time is quoted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import common
import yaml

from frugaltune import paths, tracking
from frugaltune.config import ParamsError, load_params

OUT = Path("reports/sweep")
TABLE = OUT / "quality_sweep.jsonl"
# What the three stages read and never write, linked into the scratch project (the plan is the variant's own)
STAGE_INPUTS = (str(paths.BASE_MODEL), str(paths.TOKENIZED_DIR), str(paths.SPLITS_DIR), str(paths.HARDWARE),
                str(paths.report("kernels")), str(paths.report("import_model")), str(paths.KERNEL_BUILD_DIR))


def with_overrides(raw: dict, overrides: list[str]) -> dict:
    """params.yaml's mapping `raw` with `a.b.c=value` applied (value parsed as YAML); a key must be one the params
    model knows (a default not written in params.yaml counts). The result is validated when it is loaded."""
    known_all = load_params().model_dump()
    for item in overrides:
        key, _, value = item.partition("=")
        node, known = raw, known_all
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(known, dict) or part not in known:
                raise SystemExit(f"quality_sweep: {key}: no section {part!r} in params.yaml")
            node, known = node.setdefault(part, {}), known[part]
        if not isinstance(known, dict) or leaf not in known:
            raise SystemExit(f"quality_sweep: {key}: no key {leaf!r} in params.yaml")
        node[leaf] = yaml.safe_load(value)
    return raw


def outputs(name: str) -> paths.RunOutputs:
    return paths.RunOutputs(paths.MODELS / "sweep" / name, OUT / f"{name}_train.json", OUT / f"{name}_loss.csv",
                            OUT / f"{name}_telemetry.csv", OUT / f"{name}_evaluate.json", OUT / f"{name}_confusion.csv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    if args.table or not args.name:
        rows = [json.loads(line) for line in TABLE.read_text().splitlines()] if TABLE.exists() else []
        print(f"{'variant':22s} {'overrides':55s} {'train s':>8s} {'tok/s':>7s} {'macro-F1':>9s} {'acc':>7s}")
        for r in rows:
            print(f"{r['name']:22s} {' '.join(r['overrides']):55s} {r['train_seconds']:8.1f} {r['tokens_per_s']:7.1f} "
                  f"{r['macro_f1']:9.4f} {r['accuracy']:7.4f}")
        return
    raw = yaml.safe_load(paths.PARAMS.read_text())
    raw.setdefault("probe", {})["calibrate"] = False  # the plan's decisions and fit, not its ETA: no timed steps
    raw = with_overrides(raw, args.overrides)
    OUT.mkdir(parents=True, exist_ok=True)
    out = outputs(args.name)
    with tempfile.TemporaryDirectory(prefix="quality-sweep-") as tmp:
        project = common.scratch_project(Path(tmp), linked=STAGE_INPUTS)
        (project / paths.PARAMS).write_text(yaml.safe_dump(raw, sort_keys=False))
        try:
            load_params(project / paths.PARAMS)  # a bad override stops here, before anything trains
        except ParamsError as exc:
            raise SystemExit(f"quality_sweep: {exc}") from None
        env = common.stage_env(MLFLOW_TRACKING_URI=tracking.tracking_uri())  # this project's store
        for stage in ("plan", "train", "evaluate"):
            if subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=project, env=env).returncode:
                raise SystemExit(f"quality_sweep: {args.name}: the {stage} stage failed (its output is above)")
        written = dataclasses.asdict(paths.PIPELINE_RUN)
        for field, target in dataclasses.asdict(out).items():
            source = project / written[field] if written[field] is not None else None
            if target is None or source is None or not source.exists():
                continue
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(source, target)
            else:
                shutil.copy(source, target)
        trained = json.loads((project / paths.PIPELINE_RUN.train_report).read_text())
        evaluated = json.loads((project / paths.PIPELINE_RUN.evaluate_report).read_text())
    finetuned = evaluated.get("finetuned", evaluated)
    hardware = json.loads(paths.HARDWARE.read_text()) if paths.HARDWARE.exists() else {}
    row = {"name": args.name, "overrides": args.overrides, "train_seconds": trained["wall_seconds"],
           "tokens_per_s": trained["tokens_per_s"], "steps": trained["steps"], "threads": trained["threads"],
           "macro_f1": finetuned["macro_f1"], "accuracy": finetuned["accuracy"],
           "cpu": hardware.get("cpu", {}).get("model"), "peak_rss_mb": trained["peak_rss_mb"]}
    with TABLE.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
