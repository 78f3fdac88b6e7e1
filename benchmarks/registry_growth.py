"""How much each registered version adds to the MLflow store: the base model stored once vs a copy per version.

    python benchmarks/registry_growth.py              # after `make pipeline` (needs models/, data/tokenized, reports/)
    python benchmarks/registry_growth.py --versions 10

Runs the real `register` stage N times in a temporary copy of the project (models/base, models/adapter,
data/tokenized, the label set and the train/evaluate reports), each time for a new MLflow training run, as nightly
retraining would, against a fresh sqlite store and `mlartifacts/`. Prints the store's size after the first version
(which stores the base once) and the growth per later version, against the baseline each version used to pay:
a copy of `models/base` plus the adapter. Then loads `@champion` in a fresh process with an empty base cache (so the
base comes from the store and is hash-checked) and predicts. Results: `reports/benchmarks/registry_growth.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "reports" / "benchmarks" / "registry_growth.json"
NEEDED = ("models/base", "models/adapter", "data/tokenized", "data/splits/labels.json", "reports/train.json",
          "reports/evaluate.json", "params.yaml")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=10)
    args = parser.parse_args()
    for needed in NEEDED:
        if not (ROOT / needed).exists():
            sys.exit(f"{needed} is missing: run `make pipeline` first.")
    with tempfile.TemporaryDirectory(prefix="registry-growth-") as tmp:
        project = Path(tmp)
        for needed in NEEDED:
            source, target = ROOT / needed, project / needed
            target.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update({"FRUGALTUNE_BASE_CACHE": str(project / "cache"), "PYTHONPATH": str(ROOT),
                    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"})
        script = (
            "import json, mlflow\n"
            "from frugaltune import paths, tracking\n"
            "from frugaltune.config import load_params\n"
            "from stages import register\n"
            "params = load_params()\n"
            "tracking.setup(params.train.experiment)\n"
            "with mlflow.start_run(tags=tracking.run_tags()) as run:\n"
            "    mlflow.log_metric('train_loss', 0.5)\n"
            "report = json.loads(paths.report('train').read_text())\n"
            "paths.report('train').write_text(json.dumps({**report, 'mlflow_run_id': run.info.run_id}))\n"
            "print(json.dumps(register.run(params)))\n"
        )
        sizes, seconds = [], []
        for i in range(args.versions):
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", script], cwd=project, env=env, capture_output=True,
                                  text=True)
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
