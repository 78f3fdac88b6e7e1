"""The scale ladder: the plan's choices at 0.36-3 B parameters under 4, 8 and 16 GiB, each run for real beside its
prediction.

    python benchmarks/scale_ladder.py                               # every shape x 4/8/16 GiB (hours on 2 cores)
    python benchmarks/scale_ladder.py --models SmolLM2-360M Qwen2.5-0.5B --steps 20
    python benchmarks/scale_ladder.py --report                      # the report and picture from the rows so far

Needs `models/base`, `data/tokenized` and the label set (`make pipeline`): the rows are the project's tweets,
tokenized by its tokenizer, trained as params.yaml says with the method set per row. For each shape in
`frugaltune/assets/shapes/` and each limit, the plan is made as `frugaltune plan --model <shape> --memory-limit-gb N`
makes it (frugaltune.planner.assembly.build_plan, analytic first): every method it says fits gives one
configuration (method, micro-batch, accumulation, gradient checkpointing, NF4, int8 products), and a configuration
picked at two limits is run once, at the tighter one. Each configuration is then planned with calibration, as the
plan stage plans the run it will train (random weights of the shape, written once into `--weights-dir` and kept
there for the next row), and trained for `--steps` optimizer steps (`--large-steps` from 2.5 B parameters) in a
fresh process set up by the train stage's own calls (frugaltune.training.setup) on its malloc; its peak RSS is the
process's whole life (loading included), its time the loop's wall time, as the train stage reports them.

Every measured row is appended to `reports/scale_ladder.csv` at once, so a run stopped after any row resumes where
it was (a row measured on another CPU is measured again; the report keeps the rows of every CPU, each naming
its own, and lists as not measured what no CPU has measured). A configuration the calibrated plan does not fit is not
run (the plan stage would refuse it): its row keeps the calibrated peak and why, with nothing measured. Writes
`reports/scale_ladder.md` (the table, the fit line of each shape at each limit, the bounds: peak within +-15 %, time
within +-25 %, no run above its limit) and `reports/scale_ladder.png` (seconds per 1 k tokens and peak RSS against
parameters, per method, measured and predicted, log axes).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import resource
import sys
from pathlib import Path

import common
from common import BASE, LABELS_FILE, TOKENIZED

OUT = Path("reports/scale_ladder")
METHODS = ("full", "lora", "qlora")
LIMITS = (4.0, 8.0, 16.0)
LARGE = 2.5e9  # parameters from which a row trains --large-steps
COLUMNS = ("model", "params_b", "method", "limits_gb", "micro_batch", "grad_accum", "checkpointing", "nf4", "int8",
           "steps", "tokens", "predicted_peak_mb", "measured_peak_mb", "peak_error", "predicted_seconds",
           "measured_seconds", "eta_error", "predicted_s_per_1k", "measured_s_per_1k", "within_limit", "calibration",
           "cpu")


def _params(method: str, steps: int):
    """params.yaml's run with `method` and `steps` optimizer steps, no checkpoints written."""
    from frugaltune.config import load_params

    params = load_params()
    train = params.train.model_copy(update={"method": method, "max_steps": steps, "checkpoint_every": 10**9})
    return params.model_copy(update={"train": train})


def _machine():
    from frugaltune import paths
    from frugaltune.hardware import probe
    from frugaltune.planner.machine import measured_on

    hw = probe(use_nvml=False)
    kernels = paths.report("kernels")
    return hw, measured_on(hw, json.loads(kernels.read_text()) if kernels.is_file() else None)


def configurations(names: list[str], limits: tuple[float, ...], methods: tuple[str, ...], steps: int,
                   large_steps: int, workdir: Path):
    """Each shape's analytic plan at each limit: ({config key: config}, {(shape, limit): fit line})."""
    from frugaltune import shapes
    from frugaltune.fit_summary import fit_line
    from frugaltune.planner.assembly import build_plan

    hw, measured = _machine()
    configs, lines = {}, {}
    for name in names:
        model = shapes.resolve(name, workdir / name, "float32")
        for limit in limits:
            params = _params(methods[0], steps)
            plan = build_plan(params, hw, measured, run_calibration=False, memory_limit_gb=limit, methods=methods,
                              model=model, log=lambda line: None)
            lines[name, limit] = fit_line(plan)
            for method, entry in plan["methods"].items():
                if not entry["fits"]:
                    continue
                key = (name, method, entry["micro_batch_size"], entry["grad_accum"], entry["gradient_checkpointing"])
                config = configs.setdefault(key, {"model": name, "method": method, "limits": [],
                                                  "params": entry["total_params"],
                                                  "steps": large_steps if entry["total_params"] >= LARGE else steps})
                config["limits"].append(limit)
    return configs, lines


def predict(config: dict, model_dir: Path) -> dict:
    """The plan of this configuration's run at its tightest limit, calibrated as the plan stage calibrates."""
    from frugaltune import shapes
    from frugaltune.planner.assembly import build_plan

    hw, measured = _machine()
    method = config["method"]
    model = shapes.resolve(str(model_dir), model_dir.parent, "float32")
    plan = build_plan(_params(method, config["steps"]), hw, measured, run_calibration=True,
                      memory_limit_gb=min(config["limits"]), methods=(method,), model=model,
                      log=lambda line: print(f"  {line}", flush=True))
    entry, machine = plan["methods"][method], plan["machine"]
    calibration = plan.get("calibration") or {}
    return {"peak_bytes": entry["predicted_peak_bytes"], "eta_seconds": entry["eta_seconds"],
            "micro": entry["micro_batch_size"], "grad_accum": entry["grad_accum"],
            "checkpointing": entry["gradient_checkpointing"], "fits": entry["fits"],
            "decided": {"bf16": machine["bf16"], "int8": machine["int8"][method], "threads": machine["threads"],
                        "eager_attention_max_len": machine["eager_attention_max_len"]},
            "calibration": ("analytic: " + (calibration.get("busy_note") or calibration.get("skipped") or "")
                            if not plan["constants"].get("calibrated_method") else
                            f"{calibration.get('seconds', 0):.0f} s")}


def measure(job: dict) -> dict:
    """The real run, in this (fresh) process, set up as the train stage sets it up."""
    import torch
    from datasets import load_from_disk

    from frugaltune import methods
    from frugaltune.models import load_tokenizer
    from frugaltune.training import setup
    from frugaltune.training.loop import train_classifier

    decided = job["decided"]
    torch.set_num_threads(decided["threads"])
    params = _params(job["method"], job["steps"])
    tokenizer = load_tokenizer(BASE)
    train = load_from_disk(str(TOKENIZED))["train"]
    rows = setup.training_rows(params, train["input_ids"], tokenizer)
    method = methods.get(job["method"])
    model = setup.build_model(params, method, common.labels(), tokenizer.pad_token_id, decided["bf16"],
                              gradient_checkpointing=job["checkpointing"], model_dir=job["model_dir"])
    setup.apply_int8(model, decided["int8"], method)
    loop = setup.loop_config(params, method=method, bf16=decided["bf16"], micro_batch_size=job["micro"],
                             eager_attention_max_len=decided["eager_attention_max_len"], log_every=10**9)
    result = train_classifier(model, rows, list(train["labels"]), loop, tokenizer.pad_token_id, progress=False)
    return {"seconds": result.wall_seconds, "tokens": result.tokens, "steps": result.steps,
            "micro": result.micro_batch_size,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _planned(config: dict, predicted: dict, cpu: str) -> dict:
    """A row's configuration and the calibrated plan's peak for it: what a run row and a refused row share."""
    return {"model": config["model"], "params_b": round(config["params"] / 1e9, 3), "method": config["method"],
            "limits_gb": "/".join(f"{limit:g}" for limit in config["limits"]), "micro_batch": predicted["micro"],
            "grad_accum": predicted["grad_accum"], "checkpointing": int(predicted["checkpointing"]),
            "nf4": int(config["method"] == "qlora"), "int8": int(predicted["decided"]["int8"]["on"]),
            "steps": config["steps"], "predicted_peak_mb": round(predicted["peak_bytes"] / 2**20),
            "calibration": predicted["calibration"], "cpu": cpu}


def _row(config: dict, predicted: dict, measured: dict, cpu: str) -> dict:
    per_1k = lambda seconds: round(seconds / measured["tokens"] * 1000, 3)  # noqa: E731
    limit_bytes = min(config["limits"]) * 2**30
    return _planned(config, predicted, cpu) | {
        "micro_batch": measured["micro"], "steps": measured["steps"], "tokens": measured["tokens"],
        "measured_peak_mb": round(measured["peak_rss_bytes"] / 2**20),
        "peak_error": round(predicted["peak_bytes"] / measured["peak_rss_bytes"] - 1, 4),
        "predicted_seconds": round(predicted["eta_seconds"], 1), "measured_seconds": round(measured["seconds"], 1),
        "eta_error": round(predicted["eta_seconds"] / measured["seconds"] - 1, 4),
        "predicted_s_per_1k": per_1k(predicted["eta_seconds"]), "measured_s_per_1k": per_1k(measured["seconds"]),
        "within_limit": int(measured["peak_rss_bytes"] <= limit_bytes)}


def _refused(config: dict, predicted: dict, cpu: str) -> dict:
    """The row of a configuration the analytic plan fits and the calibrated plan does not: its calibrated peak at
    the smallest setting tried, nothing measured (no run: the plan would have refused it)."""
    from frugaltune.planner.assembly import HEADROOM

    usable = min(config["limits"]) * 2**30 * HEADROOM
    setting = f"micro-batch {predicted['micro']}{' with checkpointing' if predicted['checkpointing'] else ''}"
    return dict.fromkeys(COLUMNS, "") | _planned(config, predicted, cpu) | {
        "calibration": f"calibrated ({predicted['calibration']}): needs {predicted['peak_bytes'] / 2**30:.2f} GiB at "
                       f"{setting}, over the {usable / 2**30:.2f} GiB usable"}


def _key(config: dict) -> tuple[str, str, str, str]:
    """A configuration as its rows are known: shape, method, tightest limit, steps."""
    return config["model"], config["method"], f"{min(config['limits']):g}", str(config["steps"])


def _row_key(row: dict) -> tuple[str, str, str, str]:
    """A row's configuration, as _key gives it."""
    return row["model"], row["method"], row["limits_gb"].split("/")[0], row["steps"]


def was_run(row: dict) -> bool:
    """Whether a row was run (not one the calibrated plan refused)."""
    return row["measured_peak_mb"] != ""


def read_rows() -> list[dict]:
    path = Path(f"{OUT}.csv")
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def append_row(row: dict) -> None:
    path = Path(f"{OUT}.csv")
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def report(rows: list[dict], lines: dict, pending: list[dict], cpu: str) -> str:
    """The markdown report: the measured rows, the bounds, the fit lines, what is not measured yet. Rows from
    more than one CPU (a ladder finished on another machine) name theirs: each was planned and measured there."""
    cpus = sorted({r["cpu"] for r in rows}, key=lambda c: (c != cpu, c))  # this machine's ladder first
    columns = [c for c in COLUMNS if c != "cpu" or len(cpus) > 1]
    md = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    refused, rows = [r for r in rows if not was_run(r)], [r for r in rows if was_run(r)]
    rows = sorted(rows, key=lambda r: cpus.index(r["cpu"]))  # stable: by parameters within each CPU
    for r in rows:
        md.append("| " + " | ".join(f"{float(r[c]):+.1%}" if c.endswith("_error") else str(r[c]) for c in columns)
                  + " |")
    if rows:
        md += [""]
    for each in cpus:  # the bounds on each CPU's rows: each was planned and measured there
        mine = [r for r in rows if r["cpu"] == each]
        if not mine:  # only rows the calibrated plan turned down
            continue
        peak_ok = sum(abs(float(r["peak_error"])) <= 0.15 for r in mine)
        eta_ok = sum(abs(float(r["eta_error"])) <= 0.25 for r in mine)
        limit_ok = sum(r["within_limit"] == "1" for r in mine)
        md += [f"- {each}: peak RSS within +-15 % of the plan in {peak_ok} of {len(mine)} rows; time within +-25 % in "
               f"{eta_ok} of {len(mine)}; at or under the limit in {limit_ok} of {len(mine)}."]
    if rows:
        md += ["", "Peak: the training process's whole life (loading included), ru_maxrss; time: the loop's wall "
                   "time; `limits_gb`: the limits at which the plan picks this configuration (run at the tightest)."]
    if refused:
        md += ["", "Fitted by the analytic plan, not by the calibrated one (so not run, as the plan stage would not run "
                   "them):", ""]
        md += [f"- {r['model']} {r['method']} at {r['limits_gb']} GiB: {r['calibration']} ({r['cpu']})" for r in refused]
    md += ["", f"What the plan says at each limit on {cpu} (analytic, `frugaltune plan --model <shape> "
               "--memory-limit-gb N --no-calibrate`):", ""]
    md += [f"- {name} at {limit:g} GiB: {line}" for (name, limit), line in lines.items()]
    if pending:
        md += ["", "Not measured yet (`python benchmarks/scale_ladder.py` resumes with them): "
               + "; ".join(f"{c['model']} {c['method']} at {min(c['limits']):g} GiB" for c in pending) + "."]
    md += ["", "Regenerate: `python benchmarks/scale_ladder.py` (resumes; `--report` redraws from the rows so far)."]
    return "\n".join(md) + "\n"


def render_png(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cpus = sorted({r["cpu"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8 if len(cpus) == 1 else 5.6))
    colors = {"full": "tab:red", "lora": "tab:blue", "qlora": "tab:green", "dora": "tab:purple",
              "prelayer": "tab:orange"}
    for ax, (pred, meas, unit) in zip(axes, (("predicted_s_per_1k", "measured_s_per_1k", "seconds per 1 k tokens"),
                                             ("predicted_peak_mb", "measured_peak_mb", "peak RSS (MB)"))):
        # one marker per CPU (filled: measured, hollow: planned), one colour per method
        for cpu, marker in zip(cpus, ("o", "^", "D", "v", "P")):
            on = f" ({' '.join(cpu.split(',')[0].split()[-4:]).strip('()')})" if len(cpus) > 1 else ""  # family F model M
            for method in dict.fromkeys(r["method"] for r in rows):
                mine = sorted((r for r in rows if r["method"] == method and r["cpu"] == cpu),
                              key=lambda r: float(r["params_b"]))
                if not mine:
                    continue
                x = [float(r["params_b"]) for r in mine]
                color = colors.get(method, "black")
                ax.scatter(x, [float(r[meas]) for r in mine], color=color, marker=marker,
                           label=f"{method} measured{on}")
                ax.scatter(x, [float(r[pred]) for r in mine], facecolors="none", edgecolors=color, marker=marker,
                           s=70, label=f"{method} planned{on}")
        if unit.startswith("peak"):
            for limit in LIMITS:
                ax.axhline(limit * 1024, color="grey", linewidth=0.6, linestyle=":")
                ax.annotate(f"{limit:g} GiB", (0, limit * 1024), xycoords=("axes fraction", "data"), fontsize=7,
                            color="grey", va="bottom")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers on log axes, not 2.6x10^1
            axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel(unit)
    handles, labels = axes[0].get_legend_handles_labels()  # one legend for both, under them: no point hidden
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle(f"scale ladder: plan vs measured ({', '.join(cpus)})", fontsize=9)
    fig.tight_layout(rect=(0, 0.02 + 0.035 * math.ceil(len(labels) / 4), 1, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    from frugaltune import shapes

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=shapes.names(), help="shapes (frugaltune/assets/shapes)")
    parser.add_argument("--limits", nargs="+", type=float, default=list(LIMITS), help="GiB")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per row")
    parser.add_argument("--large-steps", type=int, default=8, help="optimizer steps per row from 2.5 B parameters")
    parser.add_argument("--weights-dir", type=Path, default=Path(".cache/shapes"),
                        help="where each shape's random weights are written once and kept (a 3 B shape: 12 GiB)")
    parser.add_argument("--report", action="store_true", help="only write the report and picture from the rows so far")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # child process: the job as JSON
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))))
        return

    from frugaltune import allocator
    from frugaltune.config import load_params

    common.require(BASE, TOKENIZED, LABELS_FILE)
    hw, _ = _machine()
    cpu = common.cpu_label(hw)
    configs, lines = configurations(args.models, tuple(args.limits), tuple(args.methods), args.steps,
                                    args.large_steps, args.weights_dir)
    # a row measured on this CPU with these steps is done; the calibrated plan may pick another micro-batch than the
    # analytic one, so a configuration is known by the analytic plan's pick (the tightest limit) as well
    done = {_row_key(r) for r in read_rows() if r["cpu"] == cpu}
    pending = [c for c in configs.values() if _key(c) not in done]
    malloc = allocator.child_env(load_params().train.allocator)
    for config in [] if args.report else list(pending):
        tag = f"{config['model']} {config['method']} at {min(config['limits']):g} GiB"
        model_dir = common.model_dir(config["model"], args.weights_dir)
        print(f"{tag}: planning (calibrated) ...", flush=True)
        predicted = predict(config, model_dir)
        if not predicted["fits"]:  # a result too: the calibrated plan turns down what the analytic one fitted
            row = _refused(config, predicted, cpu)
            append_row(row)
            pending.remove(config)
            print(f"{tag}: the calibrated plan does not fit it ({row['calibration']}); not run", flush=True)
            continue
        print(f"{tag}: training {config['steps']} steps at micro-batch {predicted['micro']} ...", flush=True)
        job = {"method": config["method"], "steps": config["steps"], "model_dir": str(model_dir),
               "micro": predicted["micro"], "checkpointing": predicted["checkpointing"],
               "decided": predicted["decided"]}
        measured = common.run_child([sys.executable, __file__, "--measure", json.dumps(job)], tag, malloc)
        row = _row(config, predicted, measured, cpu)
        append_row(row)
        pending.remove(config)
        print(f"{tag}: peak {row['predicted_peak_mb']} MB planned, {row['measured_peak_mb']} MB measured "
              f"({row['peak_error']:+.1%}); {row['predicted_seconds']} s planned, {row['measured_seconds']} s "
              f"measured ({row['eta_error']:+.1%})", flush=True)
    rows = sorted(read_rows(), key=lambda r: (float(r["params_b"]), r["method"]))
    # the report's "not measured yet": on no CPU (a run resumes with what this CPU has not measured)
    anywhere = {_row_key(r) for r in rows}
    md = report(rows, lines, [c for c in pending if _key(c) not in anywhere], cpu)
    Path(f"{OUT}.md").write_text(md)
    rows = [r for r in rows if was_run(r)]
    if rows:
        render_png(rows, Path(f"{OUT}.png"))
    print("\n" + md)
    print(f"wrote {OUT}.md" + (f", {OUT}.png" if rows else "") + f" ({OUT}.csv holds the rows)")


if __name__ == "__main__":
    main()
