"""Federated fine-tuning: the training split partitioned across clients that keep their rows, each planned for its
own hardware, LoRA adapters + head trained where the data is and averaged by a Flower ServerApp.
Run by DVC as:  python -m stages.federated   (make federated = dvc repro federated/dvc.yaml; not in `make pipeline`)

Reads `federated.*`, `common.seed`, `data/tokenized/` (train = what the clients own, test = the server's held-out
split), the label set, `models/base/` and `train.input_template`: every row, the clients' and the server's, is
wrapped in it as the train stage wraps its own (frugaltune/input_template.py), and each exported adapter records it.
Needs the Flower venv (`make flower-env`).

For every method in `federated.methods` (and, with `iid_control`, the first method on an IID partition) it starts a
real Flower deployment on this machine, a SuperLink and one SuperNode per included client on 127.0.0.1
(frugaltune/federated/launch.py), and runs the app (frugaltune/federated/{server,client}_app.py). Rounds are kept in
`checkpoints/federated/<run>/` (outside the outs, which dvc deletes): a killed stage resumes from the last round.

Writes `data/federated/` (the partitions), `models/federated/<run>/` (each run's final global adapter + head, a PEFT
dir served like models/adapter/; `python -m stages.federated_register` registers the best), `reports/federated.json`
(per run: the final global test accuracy, macro-F1 and loss, bytes per client per round up and down, adapter vs
full-model size; the partition's label histograms; each client's plan or why it was left out; the MLflow run id),
`reports/plots/federated_rounds.csv` (metric vs round vs cumulative bytes, per run), `reports/plots/
federated_labels.csv` (per-client label counts), `reports/plots/federated_clients.csv` and the PNGs
`reports/figures/federated_rounds.png` (metric vs round and vs bytes) and `reports/figures/federated_clients.png`
(each client's measured time and memory against its plan); one MLflow run with the per-round metrics.
With `federated.centralized_baseline`, the report's `centralized` is LoRA trained in one process on as many examples
as the first run's clients trained on (the federation's LoRA and seed, the train stage's lr, batch and schedule; the
same test split), and each run gets its `macro_f1_gap_to_centralized`.
"""

from __future__ import annotations

if __name__ == "__main__":
    # as the train stage: before the heavy imports, this process may re-execute itself on `train.allocator`
    # (mimalloc), which the centralized reference trains on and every process of the federations inherits
    from frugaltune import allocator as _allocator

    _allocator.reexec_early()

import csv
import hashlib
import io
import json
import os
import subprocess
import time
from pathlib import Path

import mlflow
import pyarrow as pa
import pyarrow.parquet as pq
from datasets import load_from_disk
from safetensors.torch import load_file

from frugaltune import paths, planner, resolve, tracking
from frugaltune.config import Params, load_params
from frugaltune.federated import local, plots, profiles, rounds
from frugaltune.federated.launch import LocalFederation
from frugaltune.input_template import InputTemplate, wrapped
from frugaltune.io import read_json, write_json, write_text
from frugaltune.models import load_tokenizer
from frugaltune.training import checkpoint

ROOT = Path(__file__).resolve().parents[1]
FLOWER_BIN = ROOT / ".venv-flower" / "bin"
APP = ROOT / "frugaltune" / "federated" / "flower_app"
DATA = Path("data/federated")
REPORT = paths.report("federated")
ROUNDS_CSV = paths.PLOTS / "federated_rounds.csv"
LABELS_CSV = paths.PLOTS / "federated_labels.csv"
CLIENTS_CSV = paths.PLOTS / "federated_clients.csv"
ROUNDS_PNG = paths.FIGURES / "federated_rounds.png"
CLIENTS_PNG = paths.FIGURES / "federated_clients.png"
ADAPTERS = paths.MODELS / "federated"  # one served adapter dir per run: models/federated/<method>_<partition>/


def classifier_template(params: Params, tokenizer) -> InputTemplate | None:
    """`train.input_template`, built for this tokenizer: the federation trains the train stage's classifier, so its
    clients, its server and its centralized reference see the rows the train stage sees (wrapped), and its adapters
    record the template for serving. None without one (and for causal_lm, which the federation does not train)."""
    template = params.train.input_template
    if template is None or params.task.type != "classification":
        return None
    return InputTemplate.build(template, tokenizer)


def write_split(split, out: Path, template: InputTemplate | None = None, max_length: int = 0) -> None:
    """A tokenized split as the federation's rows (parquet): wrapped in `template` (cut to `max_length`) if any."""
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"input_ids": wrapped(split["input_ids"], template, max_length), "labels": split["labels"]})
    pq.write_table(table, out)


def partition(fp, seed: int, scheme: str, out: Path) -> dict:
    """flwr-datasets' partitioners run in the Flower venv (frugaltune/federated/partition.py)."""
    cmd = [str(FLOWER_BIN / "python"), "-m", "frugaltune.federated.partition", "--train",
           str((DATA / "train.parquet").resolve()), "--out", str(out.resolve()), "--scheme", scheme,
           "--num-clients", str(fp.num_clients), "--alpha", str(fp.alpha), "--seed", str(seed)]
    cmd += ["--by", fp.partition_by] if fp.partition_by else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"partition failed ({proc.returncode}): {proc.stderr[-3000:]}")
    print(proc.stdout.strip())
    return json.loads((out / "partitions.json").read_text())


def plan_calibration(bf16: bool) -> tuple[planner.Constants, int | None, str]:
    """(constants, threads they were measured with, where from) for the clients' time estimates: the plan stage's
    calibration (reports/plan.json) when it measured this CPU (reports/hardware.json), on a CPU, in the precision the
    clients train in; else the planner's uncalibrated defaults, and the plans carry no time estimate."""
    if not paths.PLAN.exists():
        return planner.Constants(), None, f"{paths.PLAN} missing: no time estimate (dvc repro plan)"
    plan = read_json(paths.PLAN)
    hardware = read_json(paths.HARDWARE) if paths.HARDWARE.exists() else {}
    device, values = plan.get("device", {}), plan.get("constants") or {}
    precision = "bf16" if bf16 else "fp32"
    if device.get("kind") != "cpu" or device.get("name") != hardware.get("cpu", {}).get("model"):
        why = f"{paths.PLAN} describes {device.get('name')!r}, not this CPU"
    elif values.get("seconds_per_token") is None:
        why = f"{paths.PLAN} is not calibrated (probe.calibrate)"
    elif plan.get("run", {}).get("precision") != precision:
        why = f"{paths.PLAN} was calibrated in {plan.get('run', {}).get('precision')}, the clients train in {precision}"
    elif (plan.get("calibration") or {}).get("int8_products"):  # the clients' loop has no int8 products
        why = f"{paths.PLAN} was calibrated with int8 products, which the clients do not use"
    else:
        return planner.Constants(**values), plan.get("threads"), f"{paths.PLAN}: {values.get('source')}"
    return planner.Constants(), None, why + ": no time estimate"


def client_lengths(parts: Path, client: int) -> tuple[int, ...]:
    """Token counts of a client's rows: the plan pads and batches them as its training loop will."""
    table = pq.read_table(str(parts / f"client_{client}.parquet"), columns=["input_ids"])
    return tuple(len(ids) for ids in table.column("input_ids").to_pylist())


def plan_clients(fp, summary: dict, parts: Path, model_dir: Path, num_labels: int, max_length: int, seed: int,
                 bf16: bool) -> list[dict]:
    """Each client's plan on its declared hardware (frugaltune/federated/profiles.py): method, rank, micro-batch and
    local steps, with the time the plan stage's calibration of this CPU predicts (`round_budget_s` caps the steps by
    it) and the memory the planner's model predicts."""
    knobs = planner.MethodKnobs(r=fp.lora.r, alpha=fp.lora.alpha, dropout=fp.lora.dropout,
                                target_modules=tuple(fp.lora.target_modules))
    constants, calibrated_cores, source = plan_calibration(bf16)
    plans = []
    for entry in summary["clients"]:
        preset = fp.profiles[entry["client"] % len(fp.profiles)]
        lengths = client_lengths(parts, entry["client"]) or (max_length,)
        run = planner.RunSpec(method="lora", batch_size=fp.batch_size, grad_accum=1, epochs=1.0,
                              max_steps=fp.local_steps, seq_len=max_length, lengths=lengths, seed=seed)
        plan = profiles.plan_client(profiles.resolve(preset), run, str(model_dir), num_labels, knobs, constants,
                                    fp.local_steps, fp.round_budget_s, calibrated_cores, fp.threads)
        plans.append({"client": entry["client"], "preset": preset, "examples": entry["examples"], **plan,
                      "calibration": source})
    return plans


# The code a round's numbers come from: the clients' training, the aggregation and the server's evaluation (not the
# export, plots or launch). Part of the run key, so a code change starts the federations over instead of resuming
# rounds the old code computed: DVC reruns the stage when this code changes, and a resumed finished run would
# report the old code's figures under the new lock.
ROUND_CODE = ("frugaltune/federated/aggregation.py", "frugaltune/federated/client_app.py",
              "frugaltune/federated/local.py", "frugaltune/federated/privacy.py", "frugaltune/federated/secure.py",
              "frugaltune/federated/server_app.py", "frugaltune/federated/wire.py", "frugaltune/training")


def round_code_sha256() -> str:
    digest = hashlib.sha256()
    for entry in ROUND_CODE:
        path = ROOT / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(str(file.relative_to(ROOT)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def data_fingerprint(parts: Path, test: Path) -> str:
    """The rows a federation trains and is judged on: each client's partition that `parts/partitions.json` lists (in
    its order) and the server's test split, as token ids and labels (checkpoint.data_fingerprint, the train stage's),
    not file bytes."""
    clients = [parts / f"client_{entry['client']}.parquet" for entry in read_json(parts / "partitions.json")["clients"]]
    return rows_fingerprint(clients + [test])[:16]


def rows_fingerprint(files: list[Path]) -> str:
    """sha256 over the files' names and rows (token ids and labels, checkpoint.data_fingerprint), in this order."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + checkpoint.data_fingerprint(*local.read_examples(path)).encode())
    return digest.hexdigest()


def base_weights_sha() -> str | None:
    """The base model's weights as the import_model stage hashed them (None before it ran)."""
    report = paths.report("import_model")
    return read_json(report).get("weights_sha256") if report.exists() else None


def run_key(params: Params, scheme: str, method: str, data: str, plans: list[dict] | None = None) -> str:
    """The federation's identity in checkpoints/federated/: its settings, seed, base weights, round code, `data`
    (data_fingerprint) and the local steps each client's plan gave it (`round_budget_s` makes them the calibration's:
    a recalibration that moves them is another federation, one that does not resumes this one). Until 2026-11-26
    the data was not in it, so new rows under the same settings (another dataset, another tokenize.max_length)
    resumed the finished rounds of the old ones."""
    fp = params.federated
    steps = {str(p["client"]): p["local_steps"] for p in plans or [] if p.get("fits")}
    blob = json.dumps({"federated": fp.model_dump(), "seed": params.common.seed, "scheme": scheme, "method": method,
                       "model": base_weights_sha(), "code": round_code_sha256(), "data": data, "steps": steps},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def machine_precision(params: Params) -> tuple[bool, int]:
    """(bf16?, eager attention up to this many tokens) for the clients on this machine: the plan's machine decisions
    (frugaltune.resolve), or `federated.precision` when it is set."""
    decided = resolve.machine(params.federated.precision, plan=resolve.read_plan())
    return bool(decided["bf16"]), int(decided["eager_attention_max_len"])


def federate(params: Params, scheme: str, method: str, plans: list[dict], parts: Path, labels: list[str],
             pad_token_id: int, workdir: Path) -> Path:
    fp = params.federated
    included = [p for p in plans if p["fits"]]
    if len(included) < fp.min_completed:
        raise RuntimeError(f"federated: {len(included)} clients fit their hardware, fewer than federated."
                           f"min_completed {fp.min_completed}: " + "; ".join(
                               f"client {p['client']} ({p['preset']}): {p['reason']}" for p in plans if not p["fits"]))
    bf16, eager = machine_precision(params)  # every client of this stage trains on this machine
    data = data_fingerprint(parts, DATA / "test.parquet")
    out = (paths.CHECKPOINTS_DIR / "federated" / run_key(params, scheme, method, data, plans)).resolve()
    # each client's own disk, simulated: where it keeps its optimizer's moments between rounds (client_state: kept)
    nodes = [{"data": str((parts / f"client_{p['client']}.parquet").resolve()), "lora-rank": p["lora_rank"],
              "micro-batch": p["micro_batch_size"], "local-steps": p["local_steps"], "threads": fp.threads,
              "client-id": p["client"],
              "precision": "bf16" if bf16 else "fp32", "eager-attention-max-len": eager,
              "state-dir": str(out / "clients" / f"client_{p['client']}")}
             for p in included]
    config = {"out-dir": str(out), "model-dir": str(paths.BASE_MODEL.resolve()),
              "test-data": str((DATA / "test.parquet").resolve()), "labels": json.dumps(labels),
              "pad-token-id": pad_token_id, "num-rounds": fp.num_rounds, "fraction": fp.fraction,
              "min-clients": min(len(included), max(fp.min_completed, 2)), "min-completed": fp.min_completed,
              "round-timeout": float(fp.round_timeout_s), "method": method, "lora-r": fp.lora.r,
              "lora-alpha": fp.lora.alpha, "lora-dropout": fp.lora.dropout,
              "lora-target-modules": json.dumps(list(fp.lora.target_modules)), "local-steps": fp.local_steps,
              "lr": fp.lr, "server-lr": fp.server_lr, "server-momentum": fp.server_momentum,
              "lr-schedule": fp.lr_schedule, "batch-size": fp.batch_size, "seed": params.common.seed,
              # the server evaluates between rounds, while this host's clients wait: it may use every core
              "threads": resolve.physical_threads(),
              "dp-epsilon": fp.dp.epsilon if fp.dp.enabled else 0.0, "dp-delta": fp.dp.delta,
              "dp-clip": fp.dp.clipping_norm, "proximal-mu": fp.proximal_mu,
              "logit-adjustment": fp.logit_adjustment, "client-state": fp.client_state,
              "transmit-dtype": fp.transmit_dtype, "secure-aggregation": fp.secure_aggregation,
              "precision": "bf16" if bf16 else "fp32",
              # SecAgg+ quantizes each update weighted by num_examples / this: the largest client's share
              "secure-max-weight": float(max(p["examples"] for p in included))}
    # Simulation Engine: one Ray worker per `threads` physical cores, so clients train side by side without
    # oversubscribing (2 workers on this project's 2-core machines)
    attempt = 1
    while True:
        before = rounds.last_completed_round(out)
        # the stage starts every SuperNode anew with its SuperLink: a database kept from an earlier start would only
        # add the nodes of that start, which a round then samples and waits for in vain
        for stale in Path(workdir).glob("superlink.db*"):
            stale.unlink()
        # every process of the federation on train.allocator, the malloc the plan's calibration ran on
        with LocalFederation(FLOWER_BIN, workdir, nodes, ROOT, threads=fp.threads, runtime=fp.runtime,
                             workers=max(1, resolve.physical_threads() // fp.threads),
                             allocator=params.train.allocator) as fed:
            result = fed.submit(APP, config, timeout=None)
        if (out / "done.json").exists():  # `flwr run` exits 0 even when the ServerApp raised
            return out
        failure = f"the ServerApp did not finish{serverapp_status(workdir)}:\n{result.stdout[-4000:]}"
        # A run that ended without completing a training round is started once more, from the last completed
        # round: Ray's node can time out during startup on this 2-core machine (2026-11-27: "The current node timed
        # out during startup", the third federation of a stage, no raylet log; the ServerApp had written round 0,
        # the seeded start, which is no training), and the rounds on disk make a second start cheap. A run that
        # trained a round, or fails twice, stops the stage with the reason.
        if attempt > 1 or (rounds.last_completed_round(out) or 0) > (before or 0):
            raise RuntimeError(f"federated {scheme}/{method}: {failure}")
        print(f"federated {scheme}/{method}: ended before training a round; starting it once more from round "
              f"{before or 0}. First attempt: {failure[-1500:]}", flush=True)
        attempt += 1


def serverapp_status(workdir: Path) -> str:
    """Why the SuperLink ended the ServerApp, from its database (e.g. "No heartbeat received from the task": a
    ServerApp starved of CPU for 60 s is failed without a traceback in the stream); "" when it says nothing."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{workdir / 'superlink.db'}?mode=ro", uri=True) as db:
            rows = db.execute("SELECT sub_status, details FROM task WHERE type = 'flwr-serverapp'").fetchall()
    except sqlite3.Error:
        return ""
    return "".join(f" (SuperLink: {status}: {details})" for status, details in rows[-1:] if status or details)


def summarize(out: Path, model_dir: Path) -> tuple[dict, list[dict]]:
    reports = rounds.reports(out)
    last = rounds.round_path(out, rounds.last_completed_round(out), "safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in load_file(str(last)).values())
    full_bytes = sum(t.numel() * t.element_size() for f in model_dir.glob("*.safetensors")
                     for t in load_file(str(f)).values())
    rows, sent = [], 0
    for report in reports:
        clients = report.get("clients", [])
        sent += sum(c["bytes-up"] + c["bytes-down"] for c in clients)
        rows.append({"round": report["round"], **report["evaluation"], "bytes_total": sent,
                     "clients_completed": report.get("completed", 0)})
    ups = [c["bytes-up"] for r in reports for c in r.get("clients", [])]
    downs = [c["bytes-down"] for r in reports for c in r.get("clients", [])]
    summary = {"final": reports[-1]["evaluation"], "baseline": reports[0]["evaluation"],
               "rounds": len(reports) - 1, "bytes_up_per_client_round_max": max(ups, default=0),
               "bytes_down_per_client_round": max(downs, default=0), "bytes_total": sent,
               "adapter_bytes": adapter_bytes, "full_model_bytes": full_bytes,
               "full_model_over_adapter": round(full_bytes / adapter_bytes, 1),
               "failures": sum(len(r.get("failures", [])) for r in reports)}
    return summary, rows


def client_rows(name: str, out: Path, plans: list[dict]) -> list[dict]:
    """Per client of run `name`: its plan's predicted peak memory and time beside what it measured, over the rounds
    it completed (peak RSS: the largest; seconds: the mean)."""
    done: dict[int, list[dict]] = {}
    for report in rounds.reports(out):
        for client in report.get("clients", []):
            if "client-id" in client:
                done.setdefault(int(client["client-id"]), []).append(client)
    rows = []
    for plan in plans:
        mine = done.get(plan["client"], [])
        if not plan["fits"] or not mine:
            continue
        rows.append({"run": name, "client": plan["client"], "preset": plan["preset"], "rounds": len(mine),
                     "peak_rss_mb": max(c["peak-rss-mb"] for c in mine),
                     "predicted_peak_mb": plan.get("predicted_peak_mb"),
                     "seconds": round(sum(c["seconds"] for c in mine) / len(mine), 3),
                     "predicted_seconds": plan.get("predicted_seconds"),
                     "predicted_seconds_here": plan.get("predicted_seconds_here")})
    return rows


def export_adapter(out: Path, params: Params, labels: list[str], pad_token_id: int, dest: Path,
                   template: str | None = None) -> None:
    """The run's last global adapter + head as a PEFT dir with the tokenizer and labels.json: what serving loads
    (frugaltune/serving.py), the same layout the train stage writes to models/adapter/. labels.json records the input
    `template` the clients trained with, from where serving wraps its inputs."""
    from frugaltune.io import atomic_dir
    from frugaltune.training.methods import save_trained

    fp = params.federated
    number = rounds.last_completed_round(out)  # a round exists when its JSON does, not the folder's last file
    last = rounds.round_path(out, number, "safetensors")
    spec = local.LoraSpec(fp.lora.r, fp.lora.alpha, fp.lora.dropout, tuple(fp.lora.target_modules))
    model = local.build_model(paths.BASE_MODEL, labels, pad_token_id, params.common.seed, spec)
    local.load_tensors(model, load_file(str(last)))
    with atomic_dir(dest) as tmp:
        save_trained(model, "lora", tmp)
        load_tokenizer(paths.BASE_MODEL).save_pretrained(tmp)
        manifest = {"labels": labels, "max_length": params.tokenize.max_length, "method": "lora",
                    "federated": {"run": dest.name, "round": number}}
        write_json(tmp / "labels.json", manifest | ({"input_template": template} if template else {}))


def examples_trained(out: Path, batch_size: int) -> int:
    """Training examples the clients of a run went through: steps x batch size, over every completed client-round."""
    return sum(int(client.get("steps", 0)) * batch_size for report in rounds.reports(out)
               for client in report.get("clients", []))


def centralized_baseline(params: Params, labels: list[str], pad_token_id: int, examples: int,
                         seed: int | None = None, precision: tuple[bool, int] | None = None) -> dict:
    """The reference the issue compares a federation with: centralized LoRA, i.e. the train stage's own recipe
    (`train.lr`, `train.head_lr`, `train.batch_size`, its schedule, clipping and weight decay) on the federation's
    LoRA (`federated.lora`), trained in one process on the whole training split (the union of what the clients own)
    for as many examples as the federation's clients trained on, and evaluated on the same test split by the same
    function as the server's rounds. `seed` (default `common.seed`) and `precision` ((bf16?, eager attention up to),
    default this machine's measurement) are for benchmarks/federated_rounds.py, which runs it over seeds. Its rows
    are the clients' rows, data/federated/train.parquet: wrapped in `train.input_template` as theirs are (bare rows
    until 2026-11-27, when the clients did not use the template).

    Until 2026-11-26 it trained at the clients' lr and batch (0.002, 8): over seeds 42 / 1 / 2 that ended at 0.774 /
    0.754 / 0.688 (sd 0.045), a reference that moved more than the federations it judged (0.720 / 0.710 / 0.715); the
    train stage's recipe ends at 0.747 / 0.732 / 0.753 (sd 0.011) on the same 6,400 examples (docs/DECISIONS.md,
    "The centralized reference is the train stage's recipe")."""
    import time

    import torch

    from frugaltune.training.loop import LoopConfig, peak_rss_mb, train_classifier

    fp, tp = params.federated, params.train
    seed = params.common.seed if seed is None else seed
    per_step = tp.batch_size * tp.grad_accum
    steps = max(1, round(examples / per_step))
    threads = torch.get_num_threads()
    spec = local.LoraSpec(fp.lora.r, fp.lora.alpha, fp.lora.dropout, tuple(fp.lora.target_modules))
    bf16, eager = precision or machine_precision(params)  # as the clients train
    model = local.build_model(paths.BASE_MODEL, labels, pad_token_id, seed, spec, bf16=bf16)
    input_ids, targets = local.read_examples(DATA / "train.parquet")
    cfg = LoopConfig(lr=tp.lr, head_lr=tp.head_lr, lora_plus_ratio=tp.lora_plus_ratio, weight_decay=tp.weight_decay,
                     scheduler=tp.scheduler, warmup_ratio=tp.warmup_ratio, max_steps=steps, batch_size=tp.batch_size,
                     grad_accum=tp.grad_accum, max_grad_norm=tp.max_grad_norm, bf16=bf16,
                     group_by_length=tp.group_by_length, log_every=steps, seed=seed, checkpoint_dir=None,
                     eager_attention_max_len=eager)
    began = time.perf_counter()
    train_classifier(model, input_ids, targets, cfg, pad_token_id, progress=False)
    seconds = time.perf_counter() - began
    test_ids, test_targets = local.read_examples(DATA / "test.parquet")
    final = local.evaluate(model, test_ids, test_targets, labels, pad_token_id, bf16=bf16)
    return {"examples": steps * per_step, "steps": steps, "batch_size": per_step, "lr": tp.lr,
            "head_lr": tp.head_lr, "precision": "bf16" if bf16 else "fp32", "scheduler": tp.scheduler,
            "warmup_ratio": tp.warmup_ratio, "training_rows": len(targets), "threads": threads,
            "train_seconds": round(seconds, 1),
            "peak_rss_mb": round(peak_rss_mb()), "final": final}


# the train stage's recipe fields the reference trains with (centralized_baseline)
REFERENCE_RECIPE = ("lr", "head_lr", "lora_plus_ratio", "weight_decay", "scheduler", "warmup_ratio", "batch_size",
                    "grad_accum", "max_grad_norm", "group_by_length")


def reference_key(params: Params, examples: int, pad_token_id: int, bf16: bool, eager: int, threads: int) -> str:
    """The centralized reference's identity: what its numbers depend on (the recipe, the federation's LoRA, seed,
    examples, pad id, precision, threads, base weights, the training and evaluation code with centralized_baseline's own
    source, and the rows of data/federated/train.parquet and test.parquet). The run keys' rule, for one run."""
    import inspect

    blob = json.dumps({"recipe": {k: getattr(params.train, k) for k in REFERENCE_RECIPE},
                       "lora": params.federated.lora.model_dump(), "seed": params.common.seed, "examples": examples,
                       "pad_token_id": pad_token_id, "bf16": bf16, "eager": eager, "threads": threads,
                       "model": base_weights_sha(), "code": round_code_sha256(),
                       "function": inspect.getsource(centralized_baseline),
                       "data": rows_fingerprint([DATA / "train.parquet", DATA / "test.parquet"])},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference(params: Params, labels: list[str], pad_token_id: int, examples: int) -> dict:
    """centralized_baseline, trained once per reference_key: kept in checkpoints/federated/centralized/<key>.json,
    so a rerun whose federations all resume (a new boot rewrites hardware.json, a dependency) does not train the
    ~9 minutes of reference again. A reused result says so (`reused_from`); its seconds are those it was trained in."""
    import torch

    bf16, eager = machine_precision(params)
    kept = paths.CHECKPOINTS_DIR / "federated" / "centralized" / (
        reference_key(params, examples, pad_token_id, bf16, eager, torch.get_num_threads()) + ".json")
    if kept.exists():
        central = read_json(kept)
        print(f"federated: centralized LoRA reused from {kept} (trained in {central['train_seconds']} s)", flush=True)
        return {**central, "reused_from": str(kept)}
    central = centralized_baseline(params, labels, pad_token_id, examples, precision=(bf16, eager))
    write_json(kept, central)  # atomic (frugaltune.io): a killed stage leaves none, not half of one
    return central


def csv_text(rows: list[dict], fields: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def run(params: Params) -> dict:
    began = time.perf_counter()  # the report's wall_seconds: what this invocation took (resumed runs take less)
    fp, seed = params.federated, params.common.seed
    if not (FLOWER_BIN / "flower-superlink").exists():
        raise RuntimeError(f"{FLOWER_BIN}: no Flower. Run `make flower-env` first (make federated does).")
    labels = read_json(paths.LABELS)["labels"]
    tokenized = load_from_disk(str(paths.TOKENIZED_DIR))
    tokenizer = load_tokenizer(paths.BASE_MODEL)
    max_length = params.tokenize.max_length
    # the clients' partitions and the server's test split are cut from these rows, wrapped as the train stage wraps
    template = classifier_template(params, tokenizer)
    write_split(tokenized["train"], DATA / "train.parquet", template, max_length)
    write_split(tokenized["test"], DATA / "test.parquet", template, max_length)
    pad_token_id = json.loads((paths.BASE_MODEL / "config.json").read_text()).get("pad_token_id")
    if pad_token_id is None:  # as the train stage: the tokenizer's pad id
        pad_token_id = tokenizer.pad_token_id

    runs = [(fp.partition, method) for method in fp.methods]
    if fp.iid_control and fp.partition != "iid":
        runs.append(("iid", fp.methods[0]))
    report = {"runs": {}, "partitions": {}, "clients": {}}
    round_rows, label_rows, clients = [], [], []
    outs: dict[str, Path] = {}  # run name -> its rounds (checkpoints/federated/<run key>)
    tracking.setup("federated")
    with mlflow.start_run(run_name="federated", tags=tracking.run_tags()) as mlrun:
        report["mlflow_run_id"] = mlrun.info.run_id  # stages/federated_register.py registers into this run
        mlflow.log_params({f"federated.{k}": json.dumps(v) if isinstance(v, (list, dict)) else v
                           for k, v in fp.model_dump().items()})
        for scheme in dict.fromkeys(s for s, _ in runs):
            parts = DATA / f"partitions_{scheme}"
            summary = partition(fp, seed, scheme, parts)
            report["partitions"][scheme] = summary["clients"]
            label_rows += [{"partition": scheme, "client": c["client"], "label": labels[int(k)], "count": n}
                           for c in summary["clients"] for k, n in c["label_histogram"].items()]
            report["clients"][scheme] = plan_clients(fp, summary, parts, paths.BASE_MODEL, len(labels), max_length,
                                                     seed, machine_precision(params)[0])
        for scheme, method in runs:
            name = f"{method}_{scheme}"
            print(f"federated: {name}: {fp.num_rounds} rounds over {fp.num_clients} clients", flush=True)
            run_began = time.perf_counter()
            out = outs[name] = federate(params, scheme, method, report["clients"][scheme],
                                        DATA / f"partitions_{scheme}", labels, pad_token_id,
                                        paths.CHECKPOINTS_DIR / "federated" / "work" / name)
            summary, rows = summarize(out, paths.BASE_MODEL)
            export_adapter(out, params, labels, pad_token_id, ADAPTERS / name,
                           template.template if template else None)
            summary["adapter_dir"] = str(ADAPTERS / name)
            summary["partition"], summary["method"] = scheme, method
            summary["wall_seconds"] = round(time.perf_counter() - run_began, 1)
            report["runs"][name] = summary
            clients += client_rows(name, out, report["clients"][scheme])
            for row in rows:
                round_rows.append({"run": name, **row})
                mlflow.log_metrics({f"{name}.{k}": row[k] for k in ("accuracy", "macro_f1", "loss", "bytes_total")},
                                   step=row["round"])
        if fp.centralized_baseline and report["runs"]:
            first = next(iter(report["runs"]))
            examples = examples_trained(outs[first], fp.batch_size)
            print(f"federated: centralized LoRA on {examples} examples (as many as {first}'s clients trained on)",
                  flush=True)
            central = report["centralized"] = reference(params, labels, pad_token_id, examples)
            central["examples_of"] = first
            for summary in report["runs"].values():
                summary["macro_f1_gap_to_centralized"] = round(central["final"]["macro_f1"]
                                                               - summary["final"]["macro_f1"], 4)
            mlflow.log_metrics({f"centralized.{k}": v for k, v in central["final"].items()})
        report["wall_seconds"] = round(time.perf_counter() - began, 1)
        write_json(REPORT, report)
        write_text(ROUNDS_CSV, csv_text(round_rows, ["run", "round", "accuracy", "macro_f1", "loss", "bytes_total",
                                                     "clients_completed"]))
        write_text(LABELS_CSV, csv_text(label_rows, ["partition", "client", "label", "count"]))
        write_text(CLIENTS_CSV, csv_text(clients, ["run", "client", "preset", "rounds", "peak_rss_mb",
                                                   "predicted_peak_mb", "seconds", "predicted_seconds_here",
                                                   "predicted_seconds"]))
        plots.plot_rounds(round_rows, ROUNDS_PNG)
        plots.plot_clients(clients, CLIENTS_PNG)
        for figure in (ROUNDS_PNG, CLIENTS_PNG):
            mlflow.log_artifact(str(figure))
        mlflow.log_artifact(str(REPORT))
    for name, summary in report["runs"].items():
        final = summary["final"]
        print(f"federated: {name}: test macro-F1 {final['macro_f1']:.4f} accuracy {final['accuracy']:.4f} "
              f"(base {summary['baseline']['macro_f1']:.4f}); {summary['bytes_up_per_client_round_max']:,} bytes up "
              f"per client per round, full model / adapter {summary['full_model_over_adapter']}x"
              + (f"; {summary['macro_f1_gap_to_centralized']:+.4f} macro-F1 below centralized"
                 if "macro_f1_gap_to_centralized" in summary else ""))
    if "centralized" in report:
        central = report["centralized"]
        print(f"federated: centralized LoRA, {central['examples']} examples ({central['steps']} steps of "
              f"{central['batch_size']}): test macro-F1 {central['final']['macro_f1']:.4f} accuracy "
              f"{central['final']['accuracy']:.4f}")
    print(f"federated: {report['wall_seconds']:.0f} s in all; each run "
          + ", ".join(f"{name} {summary['wall_seconds']:.0f} s" for name, summary in report["runs"].items()))
    return report


def main() -> None:
    run(load_params())


if __name__ == "__main__":
    main()
