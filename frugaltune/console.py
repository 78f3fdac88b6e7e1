"""Progress bars only on a terminal: a stage whose output goes to a file or a pipe logs no `\\r` redraws.

Library code. `quiet_progress_unless_terminal()` runs at the start of every stage (frugaltune.faults.stage_errors,
which wraps each stage's `main()`); `progress_bars_on()` tells this project's own loops whether to draw theirs,
`is_terminal(stream)` whether a stream is a terminal (the training loop prints progress lines where it is not).
Under `dvc repro > log`, in CI or in the Prefect flow (which reads the stage's output through a pipe), tqdm's bars
(`datasets` map and save_to_disk "Saving the dataset (0/1 shards)", transformers' "Writing model shards" and its
GGUF conversion's "Converting and de-quantizing GGUF tensors", MLflow's artifact uploads, the training loop's own)
would each write hundreds of `\\r` redraws into the log. On a terminal they stay, as the user expects.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

# Each library's own switch, so a child process (torchrun ranks, the plan's calibration, Flower's clients) and a
# library imported later read it too. A variable the user set already is left as it is.
QUIET_ENV = {
    "TQDM_DISABLE": "1",  # tqdm itself, and this project's loops (progress_bars_on)
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub, and transformers (which follows it)
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}
_TRUE = {"1", "true", "yes", "on"}


def _is_set(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def is_terminal(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def quiet_progress_unless_terminal(stream: TextIO | None = None) -> None:
    """Turn every progress bar off when `stream` (stderr, where tqdm draws) is not a terminal; else do nothing."""
    if is_terminal(sys.stderr if stream is None else stream):
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    # A library imported before this call read its variable at import: tell it directly.
    if "tqdm" in sys.modules and _is_set("TQDM_DISABLE"):
        _quiet_tqdm()
    if "datasets" in sys.modules and _is_set("HF_DATASETS_DISABLE_PROGRESS_BARS"):
        from datasets.utils import disable_progress_bars

        disable_progress_bars()
    if _is_set("HF_HUB_DISABLE_PROGRESS_BARS"):
        if "transformers" in sys.modules:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()  # huggingface_hub's as well
        elif "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars as disable_hub_bars

            disable_hub_bars()


def _quiet_tqdm() -> None:
    """tqdm reads TQDM_DISABLE once, when it is first imported (a stage's imports, transformers' among them, import
    it before the stage's `main()` runs): make `disable=True` the default of every bar made from now on, as tqdm's
    own environment override does (a bar that passes `disable` itself keeps its choice). transformers' GGUF
    conversion draws its bar with tqdm.auto directly, past its own progress-bar switch."""
    from functools import partialmethod

    from tqdm import std

    init = std.tqdm.__dict__["__init__"]
    if not (isinstance(init, partialmethod) and init.keywords.get("disable") is True):
        std.tqdm.__init__ = partialmethod(std.tqdm.__init__, disable=True)


def progress_bars_on() -> bool:
    """Whether this project's loops draw a progress bar: not when TQDM_DISABLE is set (by the user, or by
    `quiet_progress_unless_terminal`). Read at each call: tqdm reads the variable only when it is first imported."""
    return not _is_set("TQDM_DISABLE")
