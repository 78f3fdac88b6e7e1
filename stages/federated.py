"""Federated fine-tuning: the training split partitioned across clients that keep their rows, each planned for its
own hardware, LoRA adapters + head trained where the data is and averaged by a Flower ServerApp.
Run by DVC as:  python -m stages.federated   (make federated = dvc repro federated/dvc.yaml; not in `make pipeline`)

Reads `federated.*`, `common.seed`, `data/tokenized/` (train = what the clients own, test = the server's held-out
split), the label set, `models/base/` and `train.input_template`: every row, the clients' and the server's, is
wrapped in it as the train stage wraps its own (frugaltune/input_template.py), and each exported adapter records it.
Needs the Flower venv (`make flower-env`).

For every method in `federated.methods` (and, with `iid_control`, the first method on an IID partition) it runs a
federation on this machine (frugaltune/federated/federation.py: Flower's Simulation Engine, or a SuperLink and one
SuperNode per included client on 127.0.0.1) with the app frugaltune/federated/{server,client}_app.py. Rounds are kept
in `checkpoints/federated/<run>/` (outside the outs, which dvc deletes): a killed stage resumes from the last round.
The library does the work (frugaltune/federated/: rows, plans, keys, settings, federation, results, centralized);
this file reads the params, calls it in order and writes the outputs.

Writes `data/federated/` (the partitions), `models/federated/<run>/` (each run's final global adapter + head, a PEFT
dir served like models/adapter/; `python -m stages.federated_register` registers the best), `reports/federated.json`
(per run: the final global test accuracy, macro-F1 and loss, bytes per client per round up and down, adapter vs
full-model size; the partition's label histograms; each client's plan or why it was left out; the MLflow run id),
`reports/plots/federated_rounds.csv` (metric vs round vs cumulative bytes, per run), `reports/plots/
federated_labels.csv` (per-client label counts), `reports/plots/federated_clients.csv` and the PNGs
`reports/figures/federated_rounds.png` (metric vs round and vs bytes) and `reports/figures/federated_clients.png`
(each client's measured time and memory against its plan); one MLflow run with the per-round metrics.
With `federated.budget_minutes`, the report's `budget` says how many of `num_rounds` fit (frugaltune/federated/
budget.py: a client-round measured on this machine, then the first federation's rounds 1 and 2, after which it can
end that federation with fewer rounds, the first decision kept as `initial`; then, before each later federation,
the rounds that fit what remains at the slowest pace measured so far, `later`) and each run's `round_seconds` puts
every round's predicted seconds beside what it took. With `federated.centralized_baseline`, the report's
`centralized` is LoRA trained in one process, right after the first run, on as many examples as its clients trained
on (the federation's LoRA and seed, the train stage's lr, batch and schedule; the same test split), and each run
gets its `macro_f1_gap_to_centralized`.
"""

from __future__ import annotations

if __name__ == "__main__":
    # as the train stage: before the heavy imports, this process may re-execute itself on `train.allocator`
    # (mimalloc), which the centralized reference trains on and every process of the federations inherits
    from frugaltune import allocator as _allocator

    _allocator.reexec_early()

import json
import time
from pathlib import Path

import mlflow
from datasets import load_from_disk

from frugaltune import models, paths, store, tracking
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.federated import budget, centralized, federation, keys, plans, plots, results, rounds, rows
from frugaltune.io import csv_text, read_json, write_json, write_text
from frugaltune.planner.assembly import PlanError

DATA = paths.FEDERATED_DATA
REPORT = paths.report("federated")
ROUNDS_CSV = paths.PLOTS / "federated_rounds.csv"
LABELS_CSV = paths.PLOTS / "federated_labels.csv"
CLIENTS_CSV = paths.PLOTS / "federated_clients.csv"
ROUNDS_PNG = paths.FIGURES / "federated_rounds.png"
CLIENTS_PNG = paths.FIGURES / "federated_clients.png"


def run_federation(params: Params, scheme: str, method: str, client_plans: list[dict], labels: list[str],
                   pad_token_id: int, precision: plans.Precision, watch: budget.FirstRounds | None = None) -> Path:
    """One federation of `method` on the `scheme` partition, to its last round; the folder of its rounds. `watch`:
    the budget's replan, after the round it watches for (the server waits for it there)."""
    fp = params.federated
    parts = DATA / f"partitions_{scheme}"
    included = federation.included_clients(fp, client_plans)
    data = rows.data_fingerprint(parts, DATA / "test.parquet")
    key = keys.run_key(params, scheme, method, data, client_plans, precision)
    out = (paths.FEDERATED_CHECKPOINTS / key).resolve()
    settings = federation.run_settings(params, method, out, included, labels, pad_token_id, precision,
                                       replan_after=watch.last if watch else 0)
    nodes = federation.node_settings(fp, parts, out, included, precision)
    return federation.federate(params, f"{scheme}/{method}", settings, nodes,
                               paths.FEDERATED_CHECKPOINTS / "work" / f"{method}_{scheme}", watch)


def run(params: Params) -> dict:
    began = time.perf_counter()  # the report's wall_seconds: what this invocation took (resumed runs take less)
    fp, seed = params.federated, params.common.seed
    federation.require_flower()
    precision = plans.machine_precision(params)  # the plan's, read once: every client trains on this machine
    labels = read_json(paths.LABELS)["labels"]
    tokenized = load_from_disk(str(paths.TOKENIZED_DIR))
    tokenizer = models.load_tokenizer(paths.BASE_MODEL)
    max_length = params.tokenize.max_length
    # the clients' partitions and the server's test split are cut from these rows, wrapped as the train stage wraps
    template = rows.classifier_template(params, tokenizer)
    rows.write_split(tokenized["train"], DATA / "train.parquet", template, max_length)
    rows.write_split(tokenized["test"], DATA / "test.parquet", template, max_length)
    pad_token_id = models.pad_token_id(paths.BASE_MODEL, tokenizer)

    runs = [(fp.partition, method) for method in fp.methods]
    if fp.iid_control and fp.partition != "iid":
        runs.append(("iid", fp.methods[0]))
    report = {"runs": {}, "partitions": {}, "clients": {}}
    round_rows, label_rows, clients = [], [], []
    tracking.setup("federated")
    with mlflow.start_run(run_name="federated", tags={**tracking.run_tags(), **tracking.process_tags()}) as mlrun:
        report["mlflow_run_id"] = mlrun.info.run_id  # stages/federated_register.py registers into this run
        mlflow.log_params({f"federated.{k}": json.dumps(v) if isinstance(v, (list, dict)) else v
                           for k, v in fp.model_dump().items()})
        for scheme in dict.fromkeys(s for s, _ in runs):
            parts = DATA / f"partitions_{scheme}"
            summary = federation.partition(fp, seed, scheme, parts)
            report["partitions"][scheme] = summary["clients"]
            label_rows += [{"partition": scheme, "client": c["client"], "label": labels[int(k)], "count": n}
                           for c in summary["clients"] for k, n in c["label_histogram"].items()]
            report["clients"][scheme] = plans.plan_clients(fp, summary, parts, paths.BASE_MODEL, len(labels),
                                                           max_length, seed, precision)
        # the rounds that fit federated.budget_minutes, from a client-round measured here; the federations are
        # identified by the rounds they run, not by the budget that chose them
        decision = report["budget"] = budget.decide(params, report["clients"], runs, labels, pad_token_id,
                                                    precision, time.perf_counter() - began,
                                                    DATA, paths.BASE_MODEL)
        print(f"federated: budget: {decision['trade']}", flush=True)
        # and once more after the first federation's rounds 1 and 2, from what they took (budget.FirstRounds)
        watch = budget.FirstRounds(decision, f"{runs[0][1]}_{runs[0][0]}", began) if decision["minutes"] else None
        done: list[dict] = []  # what each run took against its prediction: the federations after the first fit it
        for index, (scheme, method) in enumerate(runs):
            name = f"{method}_{scheme}"
            # never more than the federations before ran: the budget's guard chose them for every one after
            rounds_ = min([decision["rounds"], *(later["rounds"] for later in decision.get("later", []))])
            if decision["minutes"] and index:  # what remains of the budget, at the slowest pace measured so far
                later = budget.later_rounds(decision, [f"{m}_{s}" for s, m in runs[index:]], done,
                                            time.perf_counter() - began, rounds_)
                decision.setdefault("later", []).append(later)
                rounds_ = later["rounds"]
                print(f"federated: budget: {later['trade']}", flush=True)
            print(f"federated: {name}: {rounds_} rounds over {fp.num_clients} clients", flush=True)
            run_began = time.perf_counter()
            ran = params.model_copy(update={"federated": fp.model_copy(update={"num_rounds": rounds_,
                                                                               "budget_minutes": None})})
            out = run_federation(ran, scheme, method, report["clients"][scheme], labels, pad_token_id,
                                 precision, watch)
            if watch is not None:  # the federations after the first run the rounds it ended with
                decision = report["budget"] = budget.with_replan(decision, watch.found)
                print(f"federated: budget: {decision.get('replan', {}).get('trade', decision['trade'])}", flush=True)
                watch = None
            summary, found = results.summarize(out, paths.BASE_MODEL)
            adapter = paths.FEDERATED_ADAPTERS / name
            results.export_adapter(out, params, labels, pad_token_id, adapter, template.template if template else None)
            summary["adapter_dir"] = str(adapter)
            summary["partition"], summary["method"] = scheme, method
            summary["wall_seconds"] = round(time.perf_counter() - run_began, 1)
            predicted = decision.get("runs", {}).get(name, [])[:summary["rounds"]]  # the rounds it ran
            summary["round_seconds"] = budget.beside_measured(predicted, out,
                                                              decision.get("last_evaluation_extra_s", 0.0))
            report["runs"][name] = summary
            start = read_json(rounds.round_path(out, 0, "json"))  # round 0: this federation's own, or read
            done.append(budget.federation_took(name, summary["round_seconds"], summary["wall_seconds"],
                                               start["evaluation_seconds"]))
            clients += results.client_rows(name, out, report["clients"][scheme])
            for row in found:
                round_rows.append({"run": name, **row})
                mlflow.log_metrics({f"{name}.{k}": row[k] for k in ("accuracy", "macro_f1", "loss", "bytes_total")},
                                   step=row["round"])
            if fp.centralized_baseline and not index:  # before the other federations: they fit what it took too
                examples = centralized.examples_trained(out, fp.batch_size)
                print(f"federated: centralized LoRA on {examples} examples (as many as {name}'s clients trained on)",
                      flush=True)
                central = report["centralized"] = centralized.reference(params, labels, pad_token_id, examples,
                                                                                  precision)
                central["examples_of"] = name
                if "reused_from" not in central:  # a reused reference's seconds are another invocation's
                    done.append(budget.reference_took(decision, central["train_seconds"]))
                mlflow.log_metrics({f"centralized.{k}": v for k, v in central["final"].items()})
        if "centralized" in report:
            for summary in report["runs"].values():
                summary["macro_f1_gap_to_centralized"] = round(report["centralized"]["final"]["macro_f1"]
                                                               - summary["final"]["macro_f1"], 4)
        report["wall_seconds"] = decision["measured_seconds"] = round(time.perf_counter() - began, 1)
        write_outputs(report, round_rows, label_rows, clients)
    results.print_summary(report)
    return report


def write_outputs(report: dict, round_rows: list[dict], label_rows: list[dict], clients: list[dict]) -> None:
    """The report, the CSVs and the figures, each logged to the MLflow run in progress."""
    write_json(REPORT, report)
    write_text(ROUNDS_CSV, csv_text(round_rows, ["run", "round", "accuracy", "macro_f1", "loss",
                                                 "bytes_total", "clients_completed", "evaluation_rows"]))
    write_text(LABELS_CSV, csv_text(label_rows, ["partition", "client", "label", "count"]))
    write_text(CLIENTS_CSV, csv_text(clients, ["run", "client", "preset", "rounds", "peak_rss_mb",
                                               "predicted_peak_mb", "seconds", "predicted_seconds_here",
                                               "predicted_seconds"]))
    plots.plot_rounds(round_rows, ROUNDS_PNG)
    plots.plot_clients(clients, CLIENTS_PNG)
    for figure in (ROUNDS_PNG, CLIENTS_PNG):
        mlflow.log_artifact(str(figure))
    mlflow.log_artifact(str(REPORT))


def main() -> None:
    # a damaged store, a tracking server that is down, no plan (or one for other settings): one line
    stage_main("federated", run, store.StoreError, PlanError)


if __name__ == "__main__":
    main()
