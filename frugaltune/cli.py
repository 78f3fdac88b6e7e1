"""The `frugaltune` command line.

    frugaltune predict "I love it" "worst day ever"        # label per text, from models:/<name>@champion
    echo "I love it" | frugaltune predict                   # one text per input line
    frugaltune predict --model-uri models:/frugaltune-sentiment/3 --json "I love it"
    frugaltune predict --max-new-tokens 32 "What is 2+2?"          # a causal_lm model: prints its response
    frugaltune export --merged exported/                    # base + adapter as one plain Hugging Face model
    frugaltune plan                                         # will train.method fit here, and how long will it take?
    frugaltune plan --memory-limit-gb 4 --no-calibrate --json
    frugaltune registry restore                             # a damaged mlflow.db: its newest good backup back
    frugaltune registry backups                             # the backups of mlflow.db, newest first

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

    from frugaltune import store, tracking
    from frugaltune.config import ParamsError

    try:
        register = _register_params(Path(args.params or DEFAULT_PARAMS), explicit=args.params is not None)
    except ParamsError as exc:
        raise CommandError(str(exc)) from None
    model_uri = args.model_uri or f"models:/{register.model_name}@{register.alias}"
    uri = tracking.tracking_uri()
    try:
        store.check(uri)  # damaged, or deleted with backups left: the restore command, not MLflow's SQL error
    except store.StoreError as exc:
        raise CommandError(str(exc)) from None
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
        registered = store.registered_models(uri)
        if registered:  # a healthy store with models: registering again would not help
            hint = (f"The store holds {', '.join(registered)}: check register.model_name / register.alias in "
                    "--params, or pass --model-uri.")
        else:
            hint = "Register a model first (`dvc repro register`), or pass --model-uri / set MLFLOW_TRACKING_URI."
        raise CommandError(f"cannot load {model_uri} from {mlflow.get_tracking_uri()}: {exc.message}\n{hint}") from None
    # The signature says which kind of model this is: a classifier reads `text`, a generative model `prompt`.
    schema = model.metadata.get_input_schema()
    if schema is not None and "prompt" in schema.input_names():
        params = {key: value for key, value in (("max_new_tokens", args.max_new_tokens),
                                                ("temperature", args.temperature)) if value is not None}
        responses = list(model.predict(pd.DataFrame({"prompt": texts}), params=params or None))
        for prompt, response in zip(texts, responses):
            print(json.dumps({"prompt": prompt, "response": response}, ensure_ascii=False) if args.json else response)
        return 0
    if args.max_new_tokens is not None or args.temperature is not None:
        raise CommandError(f"{model_uri} is a classifier: --max-new-tokens and --temperature apply to generative "
                           "(causal_lm) models only.")
    labels = list(model.predict(pd.DataFrame({"text": texts})))
    for text, label in zip(texts, labels):
        print(json.dumps({"text": text, "label": label}, ensure_ascii=False) if args.json else label)
    return 0


def _export(args: argparse.Namespace) -> int:
    from frugaltune import paths
    from frugaltune.io import atomic_dir

    out = Path(args.merged)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"{out} exists and is not an empty directory; choose a new path or remove it first.")
    adapter = Path(args.adapter or paths.ADAPTER_DIR)
    base = Path(args.base or paths.BASE_MODEL)
    from peft import PeftModel

    from frugaltune import serving

    try:
        task = serving.read_task(adapter)
        if task == serving.CAUSAL_LM:
            model, tokenizer = serving.load_causal_lm(base, adapter)
        else:
            classifier = serving.load_classifier(base, adapter)
            model, tokenizer = classifier.model, classifier.tokenizer
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    # Folding the adapter into the weights gives a plain transformers model: no peft needed to load it, and no
    # adapter matmuls at inference.
    if isinstance(model, PeftModel):
        model = model.merge_and_unload()
    # A temp dir beside DIR renamed into place: an interrupted export leaves no half-written model behind.
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    written = sorted(p.name for p in out.iterdir())
    kind = "text-generation" if task == serving.CAUSAL_LM else "text-classification"
    print(f"wrote {out}/ ({', '.join(written)}): {type(model).__name__}, base {base} + adapter {adapter} merged. "
          f'Load it with transformers.pipeline("{kind}", model="{out}").')
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


def _store_path(args: argparse.Namespace) -> Path:
    from frugaltune import store, tracking

    if args.store:
        return Path(args.store)
    uri = tracking.tracking_uri()
    db = store.sqlite_path(uri)
    if db is None:
        raise CommandError(f"the tracking store {uri} is not a local sqlite file: a tracking server keeps (and backs "
                           "up) its own database. Pass --store PATH for a local mlflow.db.")
    return db


def _registry_restore(args: argparse.Namespace) -> int:
    from frugaltune import store

    db = _store_path(args)
    try:
        used, moved = store.restore(db, Path(args.backup) if args.backup else None, force=args.force)
    except store.StoreError as exc:
        raise CommandError(str(exc)) from None
    kept = f"; the previous file is kept as {moved}" if moved else ""
    print(f"restored {db} from {used.describe()}{kept}")
    return 0


def _registry_backups(args: argparse.Namespace) -> int:
    from frugaltune import store

    db = _store_path(args)
    found = store.backups(db)
    if not found:
        print(f"no backups of {db} in {store.backup_dir(db)}")
    for backup in found:
        print(backup.describe())
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
    predict.add_argument("--json", action="store_true", help='print {"text": ..., "label": ...} per line '
                         '({"prompt": ..., "response": ...} for a generative model)')
    predict.add_argument("--max-new-tokens", type=int, help="generative models: response length limit "
                         "(default: the trained setting)")
    predict.add_argument("--temperature", type=float, help="generative models: 0 = greedy (default: the trained "
                         "setting)")
    predict.set_defaults(handler=_predict)

    export = commands.add_parser(
        "export",
        help="write base model + adapter as one merged Hugging Face model",
        description="Merge the trained adapter into the base model and save the result (weights + tokenizer) as a "
        "plain Hugging Face directory: transformers.pipeline('text-generation' or 'text-classification', model=DIR) "
        "loads it without peft or frugaltune.",
    )
    export.add_argument("--merged", required=True, metavar="DIR", help="where to write it (must not exist, or be "
                        "empty)")
    export.add_argument("--adapter", help="the adapter dir (default: models/adapter)")
    export.add_argument("--base", help="the base model dir (default: models/base)")
    export.set_defaults(handler=_export)

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

    registry = commands.add_parser(
        "registry",
        help="back up and restore the local MLflow store (mlflow.db)",
        description="The registry's sqlite store is backed up before and after every register into mlflow-backups/ "
        "beside it (frugaltune/store.py). `restore` puts a backup back in its place.",
    )
    actions = registry.add_subparsers(dest="action", required=True, metavar="ACTION")
    restore = actions.add_parser("restore", help="replace a damaged or missing store with a backup",
                                 description="Replace the store with BACKUP, or with its newest good backup; the "
                                 "current file is moved to mlflow-backups/replaced/, never deleted.")
    restore.add_argument("backup", nargs="?", metavar="BACKUP", help="a backup file (default: the newest that passes "
                         "sqlite's integrity check)")
    restore.add_argument("--force", action="store_true", help="replace a store that passes its integrity check too")
    listing = actions.add_parser("backups", help="list the store's backups, newest first")
    for sub, handler in ((restore, _registry_restore), (listing, _registry_backups)):
        sub.add_argument("--store", help="the sqlite file (default: the tracking store, ./mlflow.db unless "
                         "MLFLOW_TRACKING_URI says otherwise)")
        sub.set_defaults(handler=handler)
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
