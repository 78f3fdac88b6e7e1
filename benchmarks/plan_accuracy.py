"""How good is the planner? Predicted vs measured peak RSS and training time, per method and sequence length.

    python benchmarks/plan_accuracy.py                        # full, lora, qlora x lengths 64, 128; 20 steps each
    python benchmarks/plan_accuracy.py --methods lora --lengths 128 --steps 40

Needs `models/base` and `data/tokenized` (`make pipeline`). For each (method, length): the training split is cut to
`length` tokens (what `tokenize.max_length: <length>` gives) and to its first steps x batch examples; the planner
calibrates on this machine as the plan stage does (`frugaltune.planner.calibrate`: the measured run's own loop,
fp32 without int8 products, over a few of its micro-batches in a fresh process) and predicts the run's peak RSS and wall time; then the run itself trains in a fresh process
(`train_classifier`, as the train stage) and its peak RSS (ru_maxrss) and training wall time are measured. Both
run on `--allocator` (default `auto`, mimalloc where installed, as the train stage runs).

Writes `reports/plan_accuracy.csv` + `.md` (the table, kept in git), `reports/plots/plan_accuracy.csv` (for
`dvc plots show reports/plots/plan_accuracy.csv`) and `reports/plan_accuracy.png`. Targets: peak within +-15%, ETA
within +-25%.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

import common
from common import BASE, LABELS_FILE, TOKENIZED

OUT = Path("reports/plan_accuracy")


def _data(length: int, count: int) -> tuple[list[list[int]], list[int]]:
    from datasets import load_from_disk

    train = load_from_disk(str(TOKENIZED))["train"].select(range(count))
    return [list(ids)[:length] for ids in train["input_ids"]], list(train["labels"])


def _loop(method: str, steps: int, batch: int):
    """The measured run's LoopConfig, which the calibration times too (fp32, SDPA, no int8 products)."""
    from frugaltune.training.loop import LoopConfig

    return LoopConfig(lr=5e-5 if method == "full" else 1e-3, batch_size=batch, epochs=1, seed=42, log_every=steps)


def measure(method: str, length: int, steps: int, batch: int, threads: int) -> dict:
    """The real run, in this (fresh) process: train_classifier as the train stage calls it."""
    import torch

    from frugaltune.models import load_tokenizer
    from frugaltune.planner import MethodKnobs
    from frugaltune.training.loop import train_classifier
    from frugaltune.training.methods import prepare_model

    torch.set_num_threads(threads)
    ids, labels = _data(length, steps * batch)
    tokenizer = load_tokenizer(BASE)
    model = prepare_model(BASE, common.labels(), tokenizer.pad_token_id, 42, method, MethodKnobs())
    result = train_classifier(model, ids, labels, _loop(method, steps, batch), tokenizer.pad_token_id, progress=False)
    from frugaltune import allocator

    return {"seconds": result.wall_seconds, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "steps": result.steps, "malloc": allocator.active()}


def predict(method: str, length: int, steps: int, batch: int, threads: int, hw: dict, malloc: str) -> dict:
    from dataclasses import asdict

    from frugaltune import planner
    from frugaltune.models import load_tokenizer

    ids, labels = _data(length, steps * batch)
    names = common.labels()
    run = planner.RunSpec(method=method, batch_size=batch, grad_accum=1, epochs=1, max_steps=None, seq_len=length,
                          lengths=tuple(len(x) for x in ids), seed=42, precision="fp32", threads=threads)
    shape = planner.model_shape(BASE, len(names), method)
    _, order = planner.planned_order(list(run.lengths), batch, 1, 1, None, 42)
    constants, _ = planner.calibrate(
        BASE, names, load_tokenizer(BASE).pad_token_id, method, planner.MethodKnobs(), shape, rows=ids,
        targets=labels, order=order, loop=asdict(_loop(method, steps, batch)), int8=common.forced_int8(False),
        gradient_checkpointing=False, threads=threads, seed=42, allocator=malloc)
    plan = planner.make_plan(run, hw, {method: shape}, constants)["methods"][method]
    return {"peak_bytes": plan["predicted_peak_bytes"], "eta_seconds": plan["eta_seconds"],
            "largest_batch": plan["largest_batch"]}


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
    parser.add_argument("--methods", nargs="+", default=["full", "lora", "qlora"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--allocator", default="auto", choices=["auto", "mimalloc", "system"],
                        help="train.allocator for the calibration and the measured run (default: auto, as training)")
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # child process: METHOD LENGTH
    args = parser.parse_args()

    from frugaltune import allocator
    from frugaltune.hardware import probe

    hw = probe(use_nvml=False)
    threads = hw["cpu"]["physical_cores"] or os.cpu_count()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]), args.steps, args.batch_size, threads)))
        return
    common.require(BASE, TOKENIZED, LABELS_FILE)
    rows = []
    for method in args.methods:
        for length in args.lengths:
            print(f"{method} at length {length}: calibrating ...", flush=True)
            predicted = predict(method, length, args.steps, args.batch_size, threads, hw, args.allocator)
            print(f"{method} at length {length}: training ...", flush=True)
            measured = common.run_child([sys.executable, __file__, "--measure", method, str(length), "--steps",
                                         str(args.steps), "--batch-size", str(args.batch_size)],
                                        f"{method}/{length}", allocator.child_env(args.allocator))
            row = {"method": method, "length": length, "steps": measured["steps"],
                   "largest_batch": f"{predicted['largest_batch']['sequences']}x{predicted['largest_batch']['length']}",
                   "predicted_peak_mb": round(predicted["peak_bytes"] / 2**20),
                   "measured_peak_mb": round(measured["peak_rss_bytes"] / 2**20),
                   "predicted_seconds": round(predicted["eta_seconds"], 1),
                   "measured_seconds": round(measured["seconds"], 1)}
            row["peak_error"] = round(row["predicted_peak_mb"] / row["measured_peak_mb"] - 1, 4)
            row["eta_error"] = round(row["predicted_seconds"] / row["measured_seconds"] - 1, 4)
            rows.append(row)
            print(f"  peak {row['predicted_peak_mb']} MB predicted, {row['measured_peak_mb']} MB measured "
                  f"({row['peak_error']:+.1%}); time {row['predicted_seconds']} s predicted, "
                  f"{row['measured_seconds']} s measured ({row['eta_error']:+.1%})", flush=True)

    columns = list(rows[0])
    csv = "\n".join([",".join(columns)] + [",".join(str(r[c]) for c in columns) for r in rows]) + "\n"
    header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    md = header + "".join("| " + " | ".join(f"{r[c]:+.1%}" if c.endswith("error") else str(r[c]) for c in columns)
                          + " |\n" for r in rows)
    within = all(abs(r["peak_error"]) <= 0.15 for r in rows), all(abs(r["eta_error"]) <= 0.25 for r in rows)
    md += (f"\nPeak RSS within +-15%: {'yes' if within[0] else 'NO'}; ETA within +-25%: {'yes' if within[1] else 'NO'}. "
           f"{args.steps} steps of batch {args.batch_size}, {threads} threads, malloc {measured['malloc']}, "
           f"{hw['cpu']['model']}. "
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
