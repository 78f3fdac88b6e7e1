"""How good is the planner? Predicted vs measured peak RSS and training time, per method and sequence length.

    python benchmarks/plan_accuracy.py                         # the default run, then lora, full, qlora, dora, prelayer x 64, 128
    python benchmarks/plan_accuracy.py --methods lora --lengths 128 --steps 40 --repeats 3

Needs `models/base` and `data/tokenized` (`make pipeline`). Its first row is the default run itself: the pipeline's
`reports/plan.json` against `reports/train.json`, when both describe this CPU. Then, for each (method, length),
the run is params.yaml's `train.*` with that method (its own knobs, `train.<method>`), the training rows as the
model sees them (input template), cut to `length` tokens and to the first `--steps` x batch rows; the plan is made
as the plan stage makes it (`planner.machine.decide_machine` for this machine: precision, int8 products for that
method, attention crossover; `planner.calibration.calibrate`: the run's own loop over a few of its micro-batches in a
fresh process) and the run itself then trains in a fresh process, set up by the same `frugaltune.training.setup`
calls as the train stage, on the same malloc; its peak RSS (ru_maxrss) and the loop's wall time are measured.

Each (method, length) is planned and run `--repeats` times (2 by default), calibration and run taken in turn, and its
row shows the median prediction against the median measurement, with each pair's own errors beside them
(`peak_errors`, `eta_errors`). Why: a shared VM's speed drifts within minutes, and a 20-step run is short, so a single
calibration against the single run a minute later judges the VM as much as the plan (the figures: docs/DECISIONS.md,
"plan_accuracy as pairs taken in turn").

lora's rows run first: their calibration also times every other method on one micro-batch, as the plan stage does
for the methods it does not calibrate, and each other method's row shows that estimate beside its own calibration's
(`peak_from_lora_mb`, `seconds_from_lora`): what the plan stage prints for a method it was not configured with.

Writes `reports/plan_accuracy.csv` + `.md` (the table, kept in git, naming the CPU), `reports/plots/plan_accuracy.csv`
(for `dvc plots show reports/plots/plan_accuracy.csv`) and `reports/plan_accuracy.png`. Targets: peak within +-15%,
ETA within +-25%.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path
from statistics import median

import common
from common import BASE, LABELS_FILE, TOKENIZED

OUT = Path("reports/plan_accuracy")


def _params(method: str, steps: int):
    """params.yaml's run with `method`, `steps` optimizer steps, no checkpoints."""
    from frugaltune.config import load_params

    params = load_params()
    train = params.train.model_copy(update={"method": method, "max_steps": steps, "checkpoint_every": 10**9})
    return params.model_copy(update={"train": train})


def _rows(params, length: int, count: int) -> tuple[list[list[int]], list]:
    from datasets import load_from_disk

    from frugaltune.models import load_tokenizer
    from frugaltune.training import setup

    train = load_from_disk(str(TOKENIZED))["train"].select(range(count))
    rows = setup.training_rows(params, train["input_ids"], load_tokenizer(BASE))
    return [list(ids)[:length] for ids in rows], list(train["labels"])


def _decided(params, method: str, threads: int) -> dict:
    """The plan's machine decisions for this machine and `method`, made as the plan stage makes them."""
    from frugaltune import resolve
    from frugaltune.planner.machine import decide_machine

    hardware, measured = resolve.machine_facts()
    return decide_machine(hardware, measured, params.train.precision, params.train.int8_products, (method,),
                          resolve.model_dims(), threads)


def _loop(params, method: str, decided: dict, micro: int):
    from frugaltune import methods
    from frugaltune.training import setup

    return setup.loop_config(params, method=methods.get(method), bf16=decided["bf16"], micro_batch_size=micro,
                             eager_attention_max_len=decided["eager_attention_max_len"], log_every=10**9)


def measure(method: str, length: int, steps: int, threads: int, decided: dict, micro: int) -> dict:
    """The real run, in this (fresh) process, set up as the train stage sets it up."""
    import torch

    from frugaltune import allocator, methods
    from frugaltune.models import load_tokenizer
    from frugaltune.training import setup
    from frugaltune.training.loop import train_classifier

    torch.set_num_threads(threads)
    params = _params(method, steps)
    ids, labels = _rows(params, length, steps * params.train.batch_size)
    tokenizer = load_tokenizer(BASE)
    spec = methods.get(method)
    model = setup.build_model(params, spec, common.labels(), tokenizer.pad_token_id, decided["bf16"])
    setup.apply_int8(model, decided["int8"][method], spec)
    result = train_classifier(model, ids, labels, _loop(params, method, decided, micro), tokenizer.pad_token_id,
                              progress=False)
    return {"seconds": result.wall_seconds, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "steps": result.steps, "malloc": allocator.active()}


def predict(method: str, length: int, steps: int, threads: int, hw: dict, others: tuple[str, ...] = (),
            constants=None) -> dict:
    """The plan of `method`'s run: calibrated on that method itself (timing `others` too, as the plan stage times
    the methods it does not calibrate), or, given another method's calibrated `constants`, the plan stage's estimate
    for a method it did not calibrate."""
    from frugaltune.planner.assembly import make_plan, run_spec
    from frugaltune.models import load_tokenizer
    from frugaltune.planner.calibration import calibrate
    from frugaltune.planner.memory import Constants, MethodKnobs, model_shape, planned_order

    params = _params(method, steps)
    batch = params.train.batch_size
    ids, labels = _rows(params, length, steps * batch)
    names = common.labels()
    decided = _decided(params, method, threads)
    run = run_spec(params, [len(x) for x in ids])
    knobs = run.knobs.get(method, MethodKnobs())
    shape = model_shape(BASE, len(names), method, knobs)
    draft = make_plan(run, hw, {method: shape}, Constants(), decided=decided)["methods"][method]
    _, order = planned_order(list(run.lengths), batch, run.grad_accum, run.epochs, run.max_steps, run.seed)
    calibration = {"seconds": None}
    if constants is None:
        timed = [{"method": m, "knobs": run.knobs.get(m, MethodKnobs()),
                  "int8": _decided(params, m, threads)["int8"][m]} for m in others]
        constants, calibration = calibrate(
            BASE, names, load_tokenizer(BASE).pad_token_id, method, knobs, shape, rows=ids, targets=labels,
            order=order, loop=_loop(params, method, decided, draft["micro_batch_size"]),
            int8=decided["int8"][method], gradient_checkpointing=False, threads=threads, seed=run.seed,
            time_samples=params.probe.calibration_steps, allocator=params.train.allocator, others=timed,
            others_share=None)  # every method timed: the 20-step runs are shorter than any calibration
    plan = make_plan(run, hw, {method: shape}, constants, decided=decided)["methods"][method]
    return {"peak_bytes": plan["predicted_peak_bytes"], "eta_seconds": plan["eta_seconds"],
            "largest_batch": plan["largest_batch"], "decided": decided, "micro": plan["micro_batch_size"],
            "calibration_seconds": calibration["seconds"], "int8": decided["int8"][method]["on"],
            "constants": constants}


def default_run(hw: dict) -> dict | None:
    """The pipeline's own run: reports/plan.json's prediction for it against reports/train.json's measurement."""
    from frugaltune import paths
    from frugaltune.io import read_json

    plan_file, train_file = paths.PLAN, paths.report("train")
    if not (plan_file.exists() and train_file.exists()):
        return None
    plan, train = read_json(plan_file), read_json(train_file)
    if plan.get("device", {}).get("name") != hw["cpu"]["model"] or not train.get("plan"):
        return None
    entry = plan["methods"][plan["configured_method"]]
    return {"method": f"{plan['configured_method']} (make pipeline)", "length": plan["methods"]["none"]["seq_len"],
            "steps": train["steps"], "int8": int(bool(plan["run"].get("int8_products"))),
            "largest_batch": f"{entry['largest_batch']['sequences']}x{entry['largest_batch']['length']}",
            "predicted_peak_mb": train["plan"]["predicted_peak_mb"], "measured_peak_mb": round(train["peak_rss_mb"]),
            "predicted_seconds": train["plan"]["eta_seconds"], "measured_seconds": train["wall_seconds"],
            "calibration_seconds": (plan.get("calibration") or {}).get("seconds")}


def _row(method: str, length: int, pairs: list[tuple[dict, dict | None, dict]]) -> dict:
    """One table row from a (method, length)'s calibrate-then-train pairs: the median prediction against the median
    measurement (each pair's errors in `eta_errors`/`peak_errors`, so the single-pair spread stays in view)."""
    first = pairs[0][0]
    mb = lambda value: round(value / 2**20)  # noqa: E731
    predicted_s = [p["eta_seconds"] for p, _, _ in pairs]
    measured_s = [m["seconds"] for _, _, m in pairs]
    predicted_b = [p["peak_bytes"] for p, _, _ in pairs]
    measured_b = [m["peak_rss_bytes"] for _, _, m in pairs]
    estimated = [e for _, e, _ in pairs if e]
    spread = lambda xs, ys: [round(x / y - 1, 4) for x, y in zip(xs, ys)]  # noqa: E731
    return {"method": method, "length": length, "steps": pairs[0][2]["steps"], "int8": int(first["int8"]),
            "largest_batch": f"{first['largest_batch']['sequences']}x{first['largest_batch']['length']}",
            "predicted_peak_mb": mb(median(predicted_b)), "measured_peak_mb": mb(median(measured_b)),
            "predicted_seconds": round(median(predicted_s), 1), "measured_seconds": round(median(measured_s), 1),
            "calibration_seconds": round(median(p["calibration_seconds"] for p, _, _ in pairs), 1),
            "peak_from_lora_mb": mb(median(e["peak_bytes"] for e in estimated)) if estimated else None,
            "seconds_from_lora": round(median(e["eta_seconds"] for e in estimated), 1) if estimated else None,
            "pairs": len(pairs), "peak_errors": spread(predicted_b, measured_b),
            "eta_errors": spread(predicted_s, measured_s)}


def outside(rows: list[dict], column: str, bound: float) -> str:
    """'k of n': how many single pairs' errors (a row's `column`, a list of fractions) are beyond `bound`."""
    errors = [e for r in rows if r.get("pairs", 1) > 1 for e in r[column]]
    return f"{sum(abs(e) > bound for e in errors)} of {len(errors)}"


def render_png(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['method']}\nlen {r['length']}" for r in rows]
    x = range(len(rows))
    for ax, (pred, meas, unit, title) in zip(axes, (
            ("predicted_peak_mb", "measured_peak_mb", "MB", "Peak RSS"),
            ("predicted_seconds", "measured_seconds", "s", "Training wall time"))):
        ax.bar([i - 0.2 for i in x], [r[pred] for r in rows], width=0.4, label="predicted (planner)")
        ax.bar([i + 0.2 for i in x], [r[meas] for r in rows], width=0.4, label="measured")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=["lora", "full", "qlora", "dora", "prelayer"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2,
                        help="calibrate-then-train pairs per row, taken in turn; the row shows their medians")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # child process: JSON of method, length, decided, micro
    args = parser.parse_args()

    from frugaltune import allocator
    from frugaltune.config import load_params
    from frugaltune.hardware import probe

    hw = probe(use_nvml=False)
    threads = _decided(load_params(), "none", load_params().train.threads)["threads"]  # the plan's rule, not a count
    if args.measure:
        job = json.loads(args.measure)
        print(json.dumps(measure(job["method"], job["length"], args.steps, threads, job["decided"], job["micro"])))
        return
    common.require(BASE, TOKENIZED, LABELS_FILE)
    rows = [row for row in [default_run(hw)] if row]
    malloc, child_malloc = allocator.child_env(load_params().train.allocator), "none run"
    # lora first: its calibration, timing the other methods on one micro-batch as the plan stage does, gives each
    # other method's row the estimate the plan stage would print for it (eta_from_lora)
    methods = sorted(args.methods, key=lambda m: m != "lora")
    from_lora = {}  # (length, repeat): lora's constants
    for method in methods:
        for length in args.lengths:
            pairs = []
            for repeat in range(args.repeats):  # calibrate, train, calibrate, train: each pair a minute apart
                tag = f"{method} at length {length}" + (f" ({repeat + 1}/{args.repeats})" if args.repeats > 1 else "")
                print(f"{tag}: calibrating ...", flush=True)
                others = tuple(m for m in methods if m != "lora") if method == "lora" else ()
                predicted = predict(method, length, args.steps, threads, hw, others=others)
                if method == "lora":
                    from_lora[length, repeat] = predicted["constants"]
                estimated = (predict(method, length, args.steps, threads, hw, constants=from_lora[length, repeat])
                             if method != "lora" and (length, repeat) in from_lora else None)
                print(f"{tag}: training ...", flush=True)
                job = {"method": method, "length": length, "decided": predicted["decided"], "micro": predicted["micro"]}
                measured = common.run_child([sys.executable, __file__, "--measure", json.dumps(job), "--steps",
                                             str(args.steps)], f"{method}/{length}", malloc)
                child_malloc = measured["malloc"]
                pairs.append((predicted, estimated, measured))
            rows.append(_row(method, length, pairs))
    for row in rows:
        row["peak_error"] = round(row["predicted_peak_mb"] / row["measured_peak_mb"] - 1, 4)
        row["eta_error"] = round(row["predicted_seconds"] / row["measured_seconds"] - 1, 4)
        for kind, measured_key, key in (("peak", "measured_peak_mb", "peak_from_lora_mb"),
                                        ("eta", "measured_seconds", "seconds_from_lora")):
            row.setdefault(key, None)
            row[f"{kind}_from_lora_error"] = (round(row[key] / row[measured_key] - 1, 4) if row[key] is not None
                                              else None)
        row.setdefault("pairs", 1)  # the default run: the pipeline's one plan against its one run
        row.setdefault("peak_errors", [row["peak_error"]])
        row.setdefault("eta_errors", [row["eta_error"]])
        print(f"  {row['method']} @ {row['length']}: peak {row['predicted_peak_mb']} MB predicted, "
              f"{row['measured_peak_mb']} MB measured ({row['peak_error']:+.1%}); time {row['predicted_seconds']} s "
              f"predicted, {row['measured_seconds']} s measured ({row['eta_error']:+.1%})", flush=True)
    measured = {"malloc": child_malloc}
    columns = list(dict.fromkeys(c for r in rows for c in r))
    shown = lambda value, column: ("-" if value is None else "/".join(f"{e:+.1%}" for e in value)  # noqa: E731
                                   if isinstance(value, list) else f"{value:+.1%}" if column.endswith("_error")
                                   else str(value))
    csv = "\n".join([",".join(columns)] + [",".join("" if r[c] is None else shown(r[c], c) if isinstance(r[c], list)
                                                     else str(r[c]) for c in columns) for r in rows]) + "\n"
    header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    md = header + "".join("| " + " | ".join(shown(r[c], c) for c in columns) + " |\n" for r in rows)
    within = all(abs(r["peak_error"]) <= 0.15 for r in rows), all(abs(r["eta_error"]) <= 0.25 for r in rows)
    estimated = [r for r in rows if r["eta_from_lora_error"] is not None]
    within_estimated = (all(abs(r["peak_from_lora_error"]) <= 0.15 for r in estimated),
                        all(abs(r["eta_from_lora_error"]) <= 0.25 for r in estimated))
    md += (f"\nPeak RSS within +-15%: {'yes' if within[0] else 'NO'}; ETA within +-25%: {'yes' if within[1] else 'NO'}. "
           f"The plan stage's estimates for the methods it does not calibrate (`*_from_lora`: lora's calibration, "
           f"each method's step timed against lora's on one micro-batch): peak within +-15% "
           f"{'yes' if within_estimated[0] else 'NO'}, ETA within +-25% {'yes' if within_estimated[1] else 'NO'}. "
           f"Each method row is the median of {args.repeats} calibrate-then-train pairs taken in turn (the VM's "
           f"speed drifts between a calibration and the run a minute later; `peak_errors`/`eta_errors` are the "
           f"pairs' own): single pairs outside +-15% peak {outside(rows, 'peak_errors', 0.15)}, outside +-25% ETA "
           f"{outside(rows, 'eta_errors', 0.25)}. "
           f"{args.steps} steps of params.yaml's batch per method row, {threads} threads, malloc "
           f"{measured['malloc']}, {hw['cpu']['model']}. "
           "Regenerate: `python benchmarks/plan_accuracy.py`.\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{OUT}.csv").write_text(csv)
    Path(f"{OUT}.md").write_text(md)
    plots = Path("reports/plots/plan_accuracy.csv")
    plots.parent.mkdir(parents=True, exist_ok=True)
    plots.write_text("run,kind,peak_mb\n" + "".join(
        f"{r['method']}@{r['length']},{kind},{r[f'{kind}_peak_mb']}\n" for r in rows for kind in ("predicted", "measured")))
    render_png(rows, Path(f"{OUT}.png"))
    print("\n" + md)
    print(f"wrote {OUT}.csv, {OUT}.md, {OUT}.png and {plots}")


if __name__ == "__main__":
    main()
