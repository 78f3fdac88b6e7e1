"""A federation's identity on disk: what its rounds' numbers depend on, hashed into the name of its folder in
checkpoints/federated/, so a rerun resumes only rounds computed by the same settings, rows, base weights and code.

Library code, used by the federated stage and the centralized reference (frugaltune/federated/centralized.py);
never run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from frugaltune import paths
from frugaltune.config import Params
from frugaltune.federated.rows import rows_fingerprint
from frugaltune.io import read_json

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# The code a round's numbers come from: the clients' training, the aggregation, the server's evaluation and the
# settings they read (not the export, plots or launch). Part of the run key, so a code change starts the federations
# over instead of resuming rounds the old code computed: DVC reruns the stage when this code changes, and a resumed
# finished run would report the old code's figures under the new lock.
ROUND_CODE = ("frugaltune/federated/aggregation.py", "frugaltune/federated/client_app.py",
              "frugaltune/federated/local.py", "frugaltune/federated/privacy.py", "frugaltune/federated/secure.py",
              "frugaltune/federated/server_app.py", "frugaltune/federated/settings.py",
              "frugaltune/federated/wire.py", "frugaltune/training", "frugaltune/int8.py")


def round_code_sha256() -> str:
    digest = hashlib.sha256()
    for entry in ROUND_CODE:
        path = PROJECT_ROOT / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(str(file.relative_to(PROJECT_ROOT)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def base_weights_sha() -> str | None:
    """The base model's weights as the import_model stage hashed them (None before it ran)."""
    report = paths.report("import_model")
    return read_json(report).get("weights_sha256") if report.exists() else None


def run_key(params: Params, scheme: str, method: str, data: str, plans: list[dict] | None = None,
            precision: tuple | None = None) -> str:
    """The federation's identity in checkpoints/federated/: its settings, seed, base weights, round code, `data`
    (rows.data_fingerprint), the local steps each client's plan gave it (`round_budget_s` makes them the
    calibration's: a recalibration that moves them is another federation, one that does not resumes this one) and
    the clients' precision on this machine (plans.Precision: bf16, attention crossover, int8 products), which the
    plan decides by measurement: a plan that decides otherwise starts a new federation."""
    fp = params.federated
    steps = {str(p["client"]): p["local_steps"] for p in plans or [] if p.get("fits")}
    blob = json.dumps({"federated": fp.model_dump(), "seed": params.common.seed, "scheme": scheme, "method": method,
                       "model": base_weights_sha(), "code": round_code_sha256(), "data": data, "steps": steps,
                       **({"precision": list(precision)} if precision is not None else {})},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def start_evaluations(test: Path) -> Path:
    """Where the stage's federations share round 0's evaluation (server_app.start_evaluation): a folder named by what
    that evaluation depends on beyond the start's bytes and the evaluation's settings, which name its files: the
    base weights (a folder's path does not say which), the round code and the test split's rows."""
    blob = json.dumps({"model": base_weights_sha(), "code": round_code_sha256(), "test": rows_fingerprint([test])},
                      sort_keys=True)
    return paths.FEDERATED_CHECKPOINTS / "start_evaluations" / hashlib.sha256(blob.encode()).hexdigest()[:16]
