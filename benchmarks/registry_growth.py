"""How much each registered version adds to the MLflow store: the base model stored once vs a copy per version.

    python benchmarks/registry_growth.py              # after `make pipeline` (needs models/, data/tokenized, reports/)
    python benchmarks/registry_growth.py --versions 10

Runs the real `register` stage (`python -m stages.register`) N times in a temporary copy of the project
(models/base, models/adapter, data/tokenized, the label set and the train/evaluate reports), each time for a new
MLflow training run, as nightly retraining would, against a fresh sqlite store and `mlartifacts/`. Prints the
store's size after the first version (which stores the base once) and the growth per later version, against the
baseline each version used to pay: a copy of `models/base` plus the adapter. Then loads `@champion` in a fresh
process with an empty base cache (so the base comes from the store and is hash-checked) and predicts. The register
seconds are the stage's process alone (the new training run is made before it). Results:
`reports/benchmarks/registry_growth.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

ROOT = common.ROOT
RESULTS = ROOT / "reports" / "benchmarks" / "registry_growth.json"
NEEDED = ("models/base", "models/adapter", "data/tokenized", "data/splits/labels.json", "reports/train.json",
          "reports/evaluate.json", "params.yaml")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=10)
    args = parser.parse_args()
    common.require(*(ROOT / needed for needed in NEEDED))
    with tempfile.TemporaryDirectory(prefix="registry-growth-") as tmp:
        project = common.scratch_project(Path(tmp), copied=NEEDED)  # copies: register rewrites the reports
        env = common.stage_env({k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
                               FRUGALTUNE_BASE_CACHE=str(project / "cache"),
                               MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false")
        # A new MLflow training run, as nightly retraining makes one, named in reports/train.json for `register`
        new_run = (
            "import json, mlflow\n"
            "from frugaltune import paths, tracking\n"
            "from frugaltune.config import load_params\n"
            "tracking.setup(tracking.experiment_name(load_params()))\n"
            "with mlflow.start_run(tags=tracking.run_tags()) as run:\n"
            "    mlflow.log_metric('train_loss', 0.5)\n"
            "report = json.loads(paths.report('train').read_text())\n"
            "paths.report('train').write_text(json.dumps({**report, 'mlflow_run_id': run.info.run_id}))\n"
        )
        sizes, seconds = [], []
        for i in range(args.versions):
            made = subprocess.run([sys.executable, "-c", new_run], cwd=project, env=env, capture_output=True,
                                  text=True)
            if made.returncode != 0:
                sys.exit(f"training run #{i + 1} failed:\n{made.stderr[-3000:]}")
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "stages.register"], cwd=project, env=env,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"register #{i + 1} failed:\n{done.stderr[-3000:]}")
            seconds.append(time.perf_counter() - started)
            sizes.append(dir_bytes(project / "mlartifacts"))
            print(f"version {i + 1}: mlartifacts {sizes[-1] / 2**20:,.1f} MB ({seconds[-1]:.1f} s)", flush=True)
        base_mb, adapter_mb = dir_bytes(project / "models/base") / 2**20, dir_bytes(project / "models/adapter") / 2**20
        growth_mb = (sizes[-1] - sizes[0]) / 2**20
        per_version = growth_mb / max(1, args.versions - 1)
        baseline = base_mb + adapter_mb

        loader = ("import mlflow, pandas as pd\n"
                  "m = mlflow.pyfunc.load_model('models:/frugaltune-sentiment@champion')\n"
                  "print(list(m.predict(pd.DataFrame({'text': ['what a lovely day', 'this is awful']}))))\n")
        started = time.perf_counter()
        loaded = subprocess.run([sys.executable, "-I", "-c", loader], cwd=project, env=env, capture_output=True,
                                text=True)
        load_s = time.perf_counter() - started
        if loaded.returncode != 0:
            sys.exit(f"loading @champion failed:\n{loaded.stderr[-3000:]}")
        result = {
            "versions": args.versions,
            "store_after_first_mb": round(sizes[0] / 2**20, 1),
            "store_after_last_mb": round(sizes[-1] / 2**20, 1),
            "growth_after_first_mb": round(growth_mb, 1),
            "per_version_mb": round(per_version, 2),
            "baseline_per_version_mb": round(baseline, 1),
            "ratio_baseline_over_now": round(baseline / per_version, 1) if per_version else None,
            "register_seconds_median": round(sorted(seconds)[len(seconds) // 2], 1),
            "fresh_process_load_and_predict_s": round(load_s, 1),
            "prediction": loaded.stdout.strip().splitlines()[-1],
        }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{args.versions} versions: the store grew {growth_mb:,.1f} MB after the first ({per_version:.2f} MB per "
          f"version); a copy of the base per version (baseline) would be {baseline:,.1f} MB per version: "
          f"{result['ratio_baseline_over_now']}x less. Fresh-process load of @champion from the store with an empty "
          f"base cache: {load_s:.1f} s, predicted {result['prediction']}.")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
