"""The `frugaltune` command line.

    frugaltune predict "I love it" "worst day ever"        # label per text, from models:/<name>@champion
    echo "I love it" | frugaltune predict                   # one text per input line
    frugaltune predict --model-uri models:/frugaltune-sentiment/3 --json "I love it"
    frugaltune plan                                         # will train.method fit here, and how long will it take?
    frugaltune plan --memory-limit-gb 4 --no-calibrate --json

Each subcommand is a `_<name>(args) -> int` handler registered in `build_parser()`; heavy imports stay inside
the handlers so `frugaltune --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path


DEFAULT_PARAMS = "params.yaml"


class CommandError(RuntimeError):
    """A problem the user can fix; printed without a traceback."""


def _register_params(params_path: Path, explicit: bool):
    from frugaltune.config import RegisterParams, load_params

    if not params_path.is_file() and not explicit:
        return RegisterParams()  # outside a project checkout: the documented defaults
    return load_params(params_path).register_


def _read_texts(args: argparse.Namespace) -> list[str]:
    if args.texts:
        return list(args.texts)
    if sys.stdin.isatty():
        raise CommandError("give texts as arguments, or pipe them in one per line.")
    return [line.rstrip("\n") for line in sys.stdin if line.strip()]


def _predict(args: argparse.Namespace) -> int:
    texts = _read_texts(args)
    # Progress bars would interleave with the predictions on a terminal.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow
    import pandas as pd
    from mlflow.exceptions import MlflowException

    from frugaltune import tracking
    from frugaltune.config import ParamsError

    try:
        register = _register_params(Path(args.params or DEFAULT_PARAMS), explicit=args.params is not None)
    except ParamsError as exc:
        raise CommandError(str(exc)) from None
    model_uri = args.model_uri or f"models:/{register.model_name}@{register.alias}"
    uri = tracking.tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        # MLflow would create an empty store here and then fail to find the model.
        raise CommandError(
            f"no MLflow store at {uri} (run from the project root, or set MLFLOW_TRACKING_URI). "
            "Register a model first: `dvc repro register`."
        )
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(model_uri)
    except MlflowException as exc:
        raise CommandError(
            f"cannot load {model_uri} from {mlflow.get_tracking_uri()}: {exc.message}\n"
            "Register a model first (`dvc repro register`), or pass --model-uri / set MLFLOW_TRACKING_URI."
        ) from None
    labels = list(model.predict(pd.DataFrame({"text": texts})))
    for text, label in zip(texts, labels):
        print(json.dumps({"text": text, "label": label}, ensure_ascii=False) if args.json else label)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from frugaltune import paths, planner
    from frugaltune.config import ParamsError, load_params
    from frugaltune.hardware import probe

    try:
        params = load_params(Path(args.params or DEFAULT_PARAMS))
        if args.method:
            params = params.model_copy(update={"train": params.train.model_copy(update={"method": args.method})})
        hardware = probe(use_nvml=params.probe.nvml)
        # bf16 vs fp32 as the kernels stage measured it, if it measured this CPU (reports/kernels.json): a
        # measurement from another machine would be a guess (the same flags have measured 0.7x and 2.3x).
        kernels = paths.report("kernels")
        measured = planner.measured_on(hardware, json.loads(kernels.read_text()) if kernels.is_file() else None)
        plan = planner.build_plan(params, hardware, measured,
                                  run_calibration=args.calibrate, memory_limit_gb=args.memory_limit_gb)
    except (ParamsError, FileNotFoundError, RuntimeError) as exc:
        raise CommandError(str(exc)) from None
    print(json.dumps(plan, indent=2) if args.json else planner.render(plan))
    try:
        planner.check_fits(plan)
    except planner.PlanError as exc:
        print(f"frugaltune plan: {exc}", file=sys.stderr)
        return 1
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("frugaltune")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="frugaltune", description="Fine-tune small language models on the hardware people have."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    predict = commands.add_parser(
        "predict",
        help="label texts with a registered model",
        description="Print the predicted label of each text, one per line, in input order.",
    )
    predict.add_argument("texts", nargs="*", metavar="TEXT", help="texts to label; none: read lines from stdin")
    predict.add_argument(
        "--model-uri",
        help="any MLflow model URI (models:/name@alias, models:/name/3, runs:/...); "
        "default: models:/<register.model_name>@<register.alias> from --params",
    )
    predict.add_argument("--params", help=f"params file naming the model (default: {DEFAULT_PARAMS})")
    predict.add_argument("--json", action="store_true", help='print {"text": ..., "label": ...} per line')
    predict.set_defaults(handler=_predict)

    plan = commands.add_parser(
        "plan",
        help="predict peak memory and training time of every method on this machine",
        description="Plan the configured training run (params.yaml, models/base, data/tokenized) on this machine: "
        "for every method, whether it fits, the predicted peak memory, the micro-batch / accumulation / gradient "
        "checkpointing / precision / threads it recommends and the ETA. Exit status 1 when train.method cannot fit.",
    )
    plan.add_argument("--params", help=f"params file (default: {DEFAULT_PARAMS})")
    plan.add_argument("--method", choices=["none", "full", "lora", "qlora", "prelayer", "dora"],
                      help="plan (and calibrate) this method instead of train.method")
    plan.add_argument("--memory-limit-gb", type=float, help="memory the run may use (default: probe.memory_limit_gb, "
                      "else the machine's)")
    plan.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                      help="run a few real training steps to fit this machine's constants (default: probe.calibrate)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except CommandError as exc:
        print(f"frugaltune {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
