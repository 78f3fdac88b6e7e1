"""Reading and checking a params file: `load_params` (duplicated keys refused), `parse_params`, `ParamsError`
naming every bad key with a suggestion, and `main`, the check by hand with its data-source check.

Library code; `python -m frugaltune.config [params.yaml]` runs `main` (frugaltune/config/__main__.py).
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from frugaltune import checkout
from frugaltune.config.params import Params


class ParamsError(ValueError):
    """A params file that does not match the schema. The message names every bad key and the fix."""


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        path = f"{prefix}{key}"
        keys.append(path)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(_known_keys(annotation, path + "."))
    return keys


def _describe(error: dict[str, Any], known: list[str], source: str) -> str:
    path = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        parent = path.rsplit(".", 1)[0] + "." if "." in path else ""
        siblings = [k for k in known if k.startswith(parent) and "." not in k[len(parent):]]
        close = difflib.get_close_matches(path, siblings, n=1, cutoff=0.6)
        hint = f" Did you mean `{close[0]}`?" if close else f" Known keys here: {', '.join(siblings)}."
        return f"{source}: `{path}`: unknown key.{hint}"
    value = error.get("input")
    return f"{source}: `{path}` = {value!r}: {error['msg']}."


def parse_params(raw: dict[str, Any] | None, source: str = "params.yaml", params_dir: Path | None = None) -> Params:
    """Validate a params mapping; raise ParamsError naming every bad key. With `params_dir` (the directory of the
    file it was read from), the files it names must exist there too (`scheduling.trace`)."""
    try:
        return Params.model_validate(raw or {}, context={"params_dir": params_dir})
    except ValidationError as exc:
        known = _known_keys(Params)
        lines = [_describe(err, known, source) for err in exc.errors()]
        raise ParamsError("\n".join(lines)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last one, silently)."""


class DuplicateKeyError(yaml.MarkedYAMLError):
    pass


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise DuplicateKeyError(
                None, None,
                f"`{key}` is given twice (lines {seen[key].start_mark.line + 1} and {key_node.start_mark.line + 1}); "
                "YAML would keep the last one silently. Merge the two into one",
                key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate `params.yaml` (relative to the working directory, the project root)."""
    path = Path(path)
    if not path.is_file():
        if (path.parent / "dvc.yaml").is_file():  # in the project: the file itself is gone
            raise ParamsError(f"{path}: missing: the project's dvc.yaml is beside it, its params file is not. Restore "
                              f"it with `git checkout -- {path}` (`git log -- {path}` shows when it went).")
        raise ParamsError(f"{path}: not found. Run from the project root (the directory with dvc.yaml).")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except DuplicateKeyError as exc:
        raise ParamsError(f"{path}: line {exc.problem_mark.line + 1}: {exc.problem}.") from None
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}.")
    return parse_params(raw, str(path), params_dir=path.parent)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m frugaltune.config",
                                     description="Check a params file against the schema (unknown or misspelled "
                                                 "keys, types, ranges, duplicated keys, a missing trace file) "
                                                 "before any compute.")
    parser.add_argument("path", nargs="?", default="params.yaml", help="the params file (default: params.yaml)")
    path = parser.parse_args(argv).path
    try:
        params = load_params(path)
    except ParamsError as exc:
        sys.exit(str(exc))
    # What DVC would do without a word (rerun from a damaged dvc.lock) or fail on (a read-only checkout), first; the
    # write test only in a project (dvc.yaml beside the file): a params file elsewhere may well be read-only.
    project = Path(path).parent
    for problem in (checkout.lock_problem(project / "dvc.lock"),
                    checkout.write_problem(project) if (project / "dvc.yaml").is_file() else None):
        if problem is not None:
            sys.exit(problem)
    data = _check_data_source(params, project)
    print(f"{path}: OK ({len(_known_keys(Params))} keys known); register.model_name {params.register_.model_name}, "
          f"train.input_template {params.train.input_template!r}; {data}")


def _check_data_source(params: Params, params_dir: Path) -> str:
    """`data.source` exists and holds the columns the params name (headers only: frugaltune.data.check_source), or
    exit with its one line. Not part of load_params: the stages after ingest read the ingested copy, not the source.
    A source that a stage of the pipeline beside the params file writes (scheduling's data/sft.jsonl) is not there
    before that stage has run: named, not checked."""
    from frugaltune.data import DataSourceError, check_source

    source, task = params.data.source, params.task
    pipeline = params_dir / "dvc.yaml"
    stages = (yaml.safe_load(pipeline.read_text(encoding="utf-8")) or {}).get("stages", {}) if pipeline.is_file() else {}
    for name, stage in stages.items():
        outs = [next(iter(out)) if isinstance(out, dict) else out for out in (stage or {}).get("outs") or []]
        if any(Path(source) == Path(out) or Path(out) in Path(source).parents for out in outs):
            return f"data.source {source} is written by the {name} stage (not checked)"
    if task.type == "causal_lm" and task.prompt_template is None:  # prompt -> response rows (stages/ingest.py)
        columns = ({"task.messages_column": task.messages_column} if task.messages_column else
                   {"task.prompt_column": task.prompt_column, "task.response_column": task.response_column})
        if task.candidates_column:
            columns["task.candidates_column"] = task.candidates_column
    else:
        columns = {"data.text_column": params.data.text_column, "data.label_column": params.data.label_column}
    try:
        files = check_source(source, params.data.format, params.data.encoding, columns, params_dir)
    except DataSourceError as exc:
        sys.exit(str(exc))
    return f"data.source {source}: {len(files)} file(s) with columns {', '.join(columns.values())}"
