"""The `frugaltune` command line.

    frugaltune predict "I love it" "worst day ever"        # label per text, from models:/<name>@champion
    echo "I love it" | frugaltune predict                   # one text per input line
    frugaltune predict --model-uri models:/frugaltune-sentiment/3 --json "I love it"
    frugaltune predict --max-new-tokens 32 "What is 2+2?"          # a causal_lm model: prints its response
    frugaltune predict --candidates 3,4,5 "What is 2+2?"            # ...or the likeliest of these answers
    frugaltune export --merged exported/                    # base + adapter as one plain Hugging Face model
    frugaltune export --model-uri models:/frugaltune-dates@champion --merged exported/   # a registered one
    frugaltune plan                                         # will train.method fit here, and how long will it take?
    frugaltune plan --memory-limit-gb 4 --no-calibrate --json
    frugaltune plan --model SmolLM2-1.7B --memory-limit-gb 8      # a bigger model, before its weights
    frugaltune registry restore                             # a damaged mlflow.db: its newest good backup back
    frugaltune registry backups                             # the backups of mlflow.db, newest first
    frugaltune exp-clean                                    # what a killed `dvc exp run --temp` left: removed

Each subcommand is a `_<name>(args) -> int` handler registered in `build_parser()`; heavy imports stay inside
the handlers so `frugaltune --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from frugaltune import methods  # the method registry: no import beyond the standard library


DEFAULT_PARAMS = "params.yaml"


class CommandError(RuntimeError):
    """A problem the user can fix; printed without a traceback."""


def _register_params(params_path: Path, explicit: bool):
    """The params' `register` section, and a note to show with the model's name when it is the default's."""
    from frugaltune.config import load_params, parse_params

    # In a project (dvc.yaml here) a missing params.yaml is an error (load_params says how to restore it): the
    # defaults would name another model than the one its params.yaml registered.
    if not params_path.is_file() and not explicit and not (params_path.parent / "dvc.yaml").is_file():
        # outside a project checkout: the defaults, `auto` resolved; said wherever the model's name is shown
        return parse_params({}).register_, (f" (the default model: no {params_path} here; --params or --model-uri "
                                            "name another)")
    return load_params(params_path).register_, ""


def _read_texts(args: argparse.Namespace) -> list[str]:
    if args.texts:
        return list(args.texts)
    if sys.stdin.isatty():
        raise CommandError("give texts as arguments, or pipe them in one per line.")
    return [line.rstrip("\n") for line in sys.stdin if line.strip()]


def _predict(args: argparse.Namespace) -> int:
    texts = _read_texts(args)
    from frugaltune import store, tracking
    from frugaltune.config import ParamsError

    model_uri, default = args.model_uri, ""
    if model_uri is None:  # the params only name the model: with --model-uri they are not read
        try:
            register, default = _register_params(Path(args.params or DEFAULT_PARAMS), explicit=args.params is not None)
        except ParamsError as exc:
            raise CommandError(str(exc)) from None
        model_uri = f"models:/{register.model_name}@{register.alias}"
    uri = tracking.tracking_uri()
    try:
        # damaged, or deleted with backups left: the restore command, not MLflow's SQL error; a server that is down:
        # the URI and the fix within seconds (before MLflow is even imported), not minutes of MLflow's retries and
        # then a wrong hint
        store.check(uri)
    except store.StoreError as exc:
        raise CommandError(str(exc)) from None
    # Progress bars would interleave with the predictions on a terminal.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow
    import pandas as pd
    from mlflow.exceptions import MlflowException

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
        try:
            store.check_server(uri)  # the server answered before the load; if it died since, that is the error
        except store.StoreUnreachable as down:
            raise CommandError(str(down)) from None
        registered = store.registered_models(uri)
        if registered:  # a healthy store with models: registering again would not help
            hint = (f"The store holds {', '.join(registered)}: check register.model_name / register.alias in "
                    "--params, or pass --model-uri.")
        else:
            hint = "Register a model first (`dvc repro register`), or pass --model-uri / set MLFLOW_TRACKING_URI."
        raise CommandError(f"cannot load {model_uri}{default} from {mlflow.get_tracking_uri()}: {exc.message}\n"
                           f"{hint}") from None
    except (OSError, ValueError) as exc:
        # its files damaged (serving.files.verify_model_files), the base model's cache or files (base.resolve_base)
        raise CommandError(f"cannot load {_describe_loaded(model_uri).removeprefix('loaded ')}{default}: {exc}") from None
    # Which model answered, on stderr: stdout stays one prediction per line for whatever parses it.
    print(f"frugaltune predict: {_describe_loaded(model_uri)}{default}", file=sys.stderr)
    # The signature says which kind of model this is: a classifier reads `text`, a generative model `prompt`.
    schema = model.metadata.get_input_schema()
    if schema is not None and "prompt" in schema.input_names():
        params = {key: value for key, value in (("max_new_tokens", args.max_new_tokens),
                                                ("temperature", args.temperature)) if value is not None}
        frame = pd.DataFrame({"prompt": texts})
        if args.candidates is not None:  # chosen by likelihood, as evaluation scores a task with candidates
            frame["candidates"] = [_candidate_list(args.candidates)] * len(texts)
        responses = list(model.predict(frame, params=params or None))
        for prompt, response in zip(texts, responses):
            print(json.dumps({"prompt": prompt, "response": response}, ensure_ascii=False) if args.json else response)
        return 0
    if args.max_new_tokens is not None or args.temperature is not None or args.candidates is not None:
        raise CommandError(f"{model_uri} is a classifier: --max-new-tokens, --temperature and --candidates apply to "
                           "generative (causal_lm) models only; a classifier chooses among its own labels.")
    labels = list(model.predict(pd.DataFrame({"text": texts})))
    for text, label in zip(texts, labels):
        print(json.dumps({"text": text, "label": label}, ensure_ascii=False) if args.json else label)
    return 0


def _candidate_list(value: str) -> list[str]:
    """`--candidates`: "19,29,31", or a JSON list for answers that hold commas ('["1,000", "100"]')."""
    try:
        options = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
    except json.JSONDecodeError as exc:
        raise CommandError(f"--candidates {value!r}: not a JSON list ({exc.msg}).") from None
    options = [str(option).strip() for option in options]
    if not options or not all(options):
        raise CommandError(f"--candidates {value!r}: expected answers separated by commas, e.g. --candidates 19,29,31.")
    return options


def _describe_loaded(model_uri: str) -> str:
    """The URI and the registered version it resolves to (an alias moves; the version says which model this was)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if not model_uri.startswith("models:/"):
        return f"loaded {model_uri}"
    name, _, rest = model_uri.removeprefix("models:/").partition("/")
    name, alias = name.split("@", 1) if "@" in name else (name, None)
    try:
        client = MlflowClient()
        version = (client.get_model_version_by_alias(name, alias) if alias
                   else client.get_model_version(name, rest) if rest.isdigit() else None)
    except MlflowException:
        version = None
    if version is None:
        return f"loaded {model_uri}"
    return f"loaded {model_uri} = {name} version {version.version} (run {version.run_id})"


def _registered_adapter(model_uri: str, into: Path) -> tuple[Path, Path]:
    """(base dir, adapter dir) of a registered model: its files downloaded into `into`, the base from the local
    cache or the store (hash-checked, as loading the model does)."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    from frugaltune import store, tracking
    from frugaltune.serving.base import BASE_ARTIFACT, resolve_base
    from frugaltune.serving.files import verify_model_files
    from frugaltune.serving.pyfunc import ADAPTER_ARTIFACT

    uri = tracking.tracking_uri()
    try:
        store.check(uri)
    except store.StoreError as exc:
        raise CommandError(str(exc)) from None
    mlflow.set_tracking_uri(uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(into)))
    except MlflowException as exc:
        raise CommandError(f"cannot load {model_uri} from {uri}: {exc.message}") from None
    flavor = Model.load(local).flavors.get("python_function", {})
    # MLmodel maps each artifact name to where it lies in the model (the source dir's name, not the artifact's).
    artifacts = {name: local / entry["path"] for name, entry in (flavor.get("artifacts") or {}).items()}
    config = flavor.get("config") or {}
    if ADAPTER_ARTIFACT not in artifacts:
        raise CommandError(f"{model_uri} is not a frugaltune model: it has no `{ADAPTER_ARTIFACT}` artifact.")
    if BASE_ARTIFACT in artifacts:  # versions logged before the base was stored once
        return artifacts[BASE_ARTIFACT], artifacts[ADAPTER_ARTIFACT]
    try:
        base = resolve_base(config["base_model_sha256"], config["base_model_uri"])
    except (KeyError, OSError, ValueError) as exc:
        raise CommandError(f"{model_uri}: its base model cannot be found: {exc}") from None
    try:  # the files it was logged with, as loading it checks them
        verify_model_files(base, artifacts[ADAPTER_ARTIFACT], config)
    except ValueError as exc:
        raise CommandError(f"{model_uri}: {exc}") from None
    return base, artifacts[ADAPTER_ARTIFACT]


def _export(args: argparse.Namespace) -> int:
    import tempfile

    from frugaltune import paths
    from frugaltune.io import atomic_dir

    out = Path(args.merged)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"{out} exists and is not an empty directory; choose a new path or remove it first.")
    if args.model_uri and (args.adapter or args.base):
        raise CommandError("give --model-uri (a registered model) or --adapter/--base (files), not both.")
    from peft import PeftModel

    from frugaltune.serving import files, load_classifier, load_generator

    plain_strings = False  # a chat-templated model's exported tokenizer templates a plain string too
    with tempfile.TemporaryDirectory(prefix="frugaltune-export-") as download:
        if args.model_uri:
            base, adapter = _registered_adapter(args.model_uri, Path(download))
        else:
            base, adapter = Path(args.base or paths.BASE_MODEL), Path(args.adapter or paths.ADAPTER_DIR)
        try:
            task = files.read_task(adapter)
            if task == files.CAUSAL_LM:
                generator = load_generator(base, adapter)
                model, tokenizer = generator.model, generator.tokenizer
            else:
                classifier = load_classifier(base, adapter)
                model, tokenizer = classifier.model, classifier.tokenizer
        except (FileNotFoundError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        # Folding the adapter into the weights gives a plain transformers model: no peft needed to load it, and no
        # adapter matmuls at inference.
        if isinstance(model, PeftModel):
            model = model.merge_and_unload()
        if task == files.CAUSAL_LM:
            # pipeline("text-generation") then decodes as serving does: greedy (or the trained temperature), the
            # trained length, stopping at the EOS the responses were trained to end with.
            config = generator.config
            model.generation_config.update(
                max_new_tokens=int(config["max_new_tokens"]), do_sample=float(config["temperature"]) > 0,
                temperature=float(config["temperature"]) or None, top_p=None, top_k=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            if config.get("templated"):
                from frugaltune.generation import template_plain_strings

                try:
                    template_plain_strings(tokenizer, config.get("system"))
                    plain_strings = True
                except ValueError as exc:  # still a model that answers chat messages: say so, write it
                    print(f"export: {exc}", file=sys.stderr)
        # A temp dir beside DIR renamed into place: an interrupted export leaves no half-written model behind.
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    written = sorted(p.name for p in out.iterdir())
    source = args.model_uri or f"base {base} + adapter {adapter}"
    print(f"wrote {out}/ ({', '.join(written)}): {type(model).__name__}, {source} merged.")
    if task != files.CAUSAL_LM:
        print(f'Load it with transformers.pipeline("text-classification", model="{out}").')
    elif generator.config.get("templated"):
        print(f'Load it with pipe = transformers.pipeline("text-generation", model="{out}") and ask in chat messages, '
              'as it was trained: pipe([{"role": "user", "content": "..."}])[0]["generated_text"][-1]["content"]'
              + (', or a plain string: pipe("...", return_full_text=False)[0]["generated_text"] (its tokenizer puts '
                 'a string in the chat template it was trained with; tokenizer(text, add_special_tokens=False) gives '
                 'the raw tokens).' if plain_strings else '.'))
    else:
        print(f'Load it with pipe = transformers.pipeline("text-generation", model="{out}"): '
              'pipe("...", return_full_text=False)[0]["generated_text"].')
    return 0


def _plan(args: argparse.Namespace) -> int:
    import tempfile

    from frugaltune import paths, processes, shapes
    from frugaltune.planner.assembly import PlanError, build_plan, check_fits
    from frugaltune.planner.machine import measured_on
    from frugaltune.planner.render import render
    from frugaltune.config import ParamsError, load_params
    from frugaltune.fit_summary import fit_line
    from frugaltune.hardware import probe

    # SIGTERM as an exit, not a sudden death: --model's random weights (gigabytes) and the calibration go with it
    previous = processes.sigterm_as_exit("frugaltune plan")
    try:
        params = load_params(Path(args.params or DEFAULT_PARAMS))
        if args.method:
            params = params.model_copy(update={"train": params.train.model_copy(update={"method": args.method})})
        hardware = probe(use_nvml=params.probe.nvml)
        # bf16 vs fp32 as the kernels stage measured it, if it measured this CPU (reports/kernels.json): a
        # measurement from another machine would be a guess (CPUs with the same flags measure bf16 slower or faster).
        kernels = paths.report("kernels")
        measured = measured_on(hardware, json.loads(kernels.read_text()) if kernels.is_file() else None)
        # --model: its config (and random weights of its shape, when it has none) in a directory removed after
        with tempfile.TemporaryDirectory(prefix="frugaltune-model-") as workdir:
            model = shapes.resolve(args.model, Path(workdir), params.model.dtype) if args.model else None
            if model and paths.BASE_MODEL.exists():
                from frugaltune.models import load_tokenizer

                shapes.check_vocabulary(model, len(load_tokenizer(paths.BASE_MODEL)), paths.BASE_MODEL)
            # --json: stdout is the plan alone, the calibration's progress goes to stderr
            plan = build_plan(params, hardware, measured, run_calibration=args.calibrate,
                              memory_limit_gb=args.memory_limit_gb, model=model,
                              log=(lambda line: print(line, file=sys.stderr)) if args.json else print)
    except (ParamsError, FileNotFoundError, RuntimeError, shapes.ShapeError) as exc:
        raise CommandError(str(exc)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    plan["fit"] = fit_line(plan)
    if model:
        plan["model"] = {"given": model.given, "source": model.source, "by_shape": model.by_shape,
                         "note": model.note(plan["constants"]["calibrated_method"] is not None, paths.BASE_MODEL)}
    print(json.dumps(plan, indent=2) if args.json else "\n".join(
        [render(plan), plan["fit"]] + ([plan["model"]["note"]] if model else [])))
    try:
        check_fits(plan)
    except PlanError as exc:
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


def _exp_clean(args: argparse.Namespace) -> int:
    from frugaltune import exp_clean, store

    try:
        lines = exp_clean.clean(Path.cwd())
    except store.StoreError as exc:
        raise CommandError(str(exc)) from None
    print("\n".join(lines))
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
    predict.add_argument("--candidates", metavar="A,B,...", help="generative models: answer each text with the "
                         "likeliest of these (comma-separated, or a JSON list), as evaluation scores a task with "
                         "candidates; default: the model's labels when it was trained on a label set, else generated")
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
    export.add_argument("--model-uri", help="a registered model to export (models:/name@alias, models:/name/3), "
                        "e.g. one a `dvc exp run --temp` experiment registered; default: the workspace's files")
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
    plan.add_argument("--method", choices=methods.NAMES,
                      help="plan (and calibrate) this method instead of train.method")
    plan.add_argument("--model", metavar="NAME|CONFIG|DIR",
                      help="plan this model instead of models/base: a shape the repository holds (SmolLM2-360M, "
                      "Qwen2.5-0.5B, Llama-3.2-1B, SmolLM2-1.7B, Llama-3.2-3B), a config.json, or a model directory; "
                      "without weights the calibration runs a random model of the same shape")
    plan.add_argument("--memory-limit-gb", type=float, help="memory the run may use (default: probe.memory_limit_gb, "
                      "else the machine's)")
    plan.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                      help="run a few real training steps to fit this machine's constants (default: probe.calibrate)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=_plan)

    clean = commands.add_parser(
        "exp-clean",
        help="remove what a killed `dvc exp run --temp` or `dvc repro` left behind",
        description="Run from the project root after DVC was killed (kill -9, a closed terminal): a temp experiment "
        "`dvc exp show` lists as Running whose DVC process is gone has its workspace under .dvc/tmp/exps removed "
        "(and anything still running in it stopped); MLflow runs left RUNNING by a process that is gone are marked "
        "KILLED. Nothing a live process uses is touched (frugaltune/exp_clean.py).",
    )
    clean.set_defaults(handler=_exp_clean)

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
